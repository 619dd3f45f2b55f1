"""Train a tf.keras.applications model on synthetic images, with or without Large Model Support.

Example (on a TensorFlow built with the tflms patch and a GPU):

    python examples/ManyModel.py --model ResNet50 --image_size 2300 --batch_size 1 --lms --stats

Images and labels are random: the point is memory behaviour, not accuracy. Nothing is
downloaded (weights=None). On a TensorFlow without the patch the script says so and trains
without LMS, which is also how it runs on a CPU in CI:

    python examples/ManyModel.py --model MobileNetV2 --image_size 32 --batch_size 2 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Names accepted by --model, matched case-insensitively (tf.keras.applications constructors).
MODEL_NAMES = (
    "ConvNeXtBase",
    "ConvNeXtLarge",
    "ConvNeXtSmall",
    "ConvNeXtTiny",
    "ConvNeXtXLarge",
    "DenseNet121",
    "DenseNet169",
    "DenseNet201",
    "EfficientNetB0",
    "EfficientNetB1",
    "EfficientNetB2",
    "EfficientNetB3",
    "EfficientNetB4",
    "EfficientNetB5",
    "EfficientNetB6",
    "EfficientNetB7",
    "EfficientNetV2B0",
    "EfficientNetV2L",
    "EfficientNetV2M",
    "EfficientNetV2S",
    "InceptionResNetV2",
    "InceptionV3",
    "MobileNet",
    "MobileNetV2",
    "MobileNetV3Large",
    "MobileNetV3Small",
    "NASNetLarge",
    "NASNetMobile",
    "ResNet50",
    "ResNet50V2",
    "ResNet101",
    "ResNet101V2",
    "ResNet152",
    "ResNet152V2",
    "VGG16",
    "VGG19",
    "Xception",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a Keras application model on synthetic data, optionally with LMS."
    )
    parser.add_argument(
        "--model",
        default="ResNet50",
        help="tf.keras.applications model, case-insensitive (default ResNet50): "
        + ", ".join(MODEL_NAMES),
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs (default 1)")
    parser.add_argument("--steps", type=int, default=10, help="steps per epoch (default 10)")
    parser.add_argument(
        "--image_size", type=int, default=500, help="image edge in pixels (default 500)"
    )
    parser.add_argument("--batch_size", type=int, default=1, help="batch size (default 1)")
    lms = parser.add_mutually_exclusive_group()
    lms.add_argument("--lms", dest="lms", action="store_true", help="enable LMS (default)")
    lms.add_argument("--no-lms", dest="lms", action="store_false", help="disable LMS")
    parser.set_defaults(lms=True)
    parser.add_argument(
        "--defrag", action="store_true", help="enable LMS defragmentation (needs --lms)"
    )
    parser.add_argument(
        "--stats",
        "--lms_stats",
        dest="stats",
        action="store_true",
        help="log per-step and aggregate LMS allocator statistics (CSV and TensorBoard)",
    )
    parser.add_argument(
        "--stats_warmup_steps",
        "--lms_stats_warmup_steps",
        dest="stats_warmup_steps",
        type=int,
        default=1,
        help="training steps left out of the aggregate statistics (default 1)",
    )
    parser.add_argument(
        "--output_dir",
        type=Path,
        default=Path("."),
        help="where statistics and TensorBoard logs go (default: current directory)",
    )
    parser.add_argument(
        "--channels_last",
        action="store_true",
        help="use NHWC; without it the model is channels first (NCHW) when a GPU is present "
        "(faster with cuDNN) and channels last on a CPU, which has no NCHW convolutions",
    )
    args = parser.parse_args(argv)
    by_lower = {name.lower(): name for name in MODEL_NAMES}
    if args.model.lower() not in by_lower:
        parser.error(f"unknown --model {args.model!r}; choose one of: {', '.join(MODEL_NAMES)}")
    args.model = by_lower[args.model.lower()]
    for option in ("epochs", "steps", "image_size", "batch_size"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.defrag and not args.lms:
        parser.error("--defrag needs LMS; drop --no-lms")
    return args


def configure_lms(tf: Any, lms: bool, defrag: bool) -> bool:
    """Turn LMS on or off before TensorFlow touches a GPU. Returns whether LMS is on."""
    setter = getattr(tf.config.experimental, "set_lms_enabled", None)
    if setter is None:
        if lms:
            print(
                f"NOTE: this TensorFlow ({tf.__version__}) has no Large Model Support: "
                "tf.config.experimental.set_lms_enabled is missing, so it was not built with "
                "the tflms patch. Training runs WITHOUT LMS. Build TensorFlow with the patch "
                "(tflms build-wheel) to enable it.",
                flush=True,
            )
        return False
    setter(lms)
    if lms and defrag:
        defrag_setter = getattr(tf.config.experimental, "set_lms_defrag_enabled", None)
        if defrag_setter is None:
            print("NOTE: this TensorFlow has no LMS defragmentation; --defrag ignored.")
        else:
            defrag_setter(True)
    return lms


def build_model(keras: Any, name: str, image_size: int, channels_first: bool) -> Any:
    keras.backend.set_image_data_format("channels_first" if channels_first else "channels_last")
    shape = (3, image_size, image_size) if channels_first else (image_size, image_size, 3)
    constructor = getattr(keras.applications, name)
    return constructor(weights=None, input_shape=shape, classes=1000)


def synthetic_dataset(tf: Any, args: argparse.Namespace, channels_first: bool) -> Any:
    """One random batch, repeated: the input pipeline costs nothing and needs no files."""
    size = args.image_size
    shape = (3, size, size) if channels_first else (size, size, 3)
    images = tf.random.uniform((args.batch_size, *shape), dtype=tf.float32)
    labels = tf.random.uniform((args.batch_size,), maxval=1000, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from callbacks import LMSStatsLogger

    lms_on = configure_lms(tf, args.lms, args.defrag)
    gpus = tf.config.list_physical_devices("GPU")
    channels_first = bool(gpus) and not args.channels_last
    print(
        f"{args.model}: image {args.image_size}x{args.image_size}, batch {args.batch_size}, "
        f"{args.epochs} epoch(s) x {args.steps} step(s), LMS {'on' if lms_on else 'off'}"
        f"{' with defragmentation' if lms_on and args.defrag else ''}, "
        f"{'channels first' if channels_first else 'channels last'}, "
        f"{len(gpus)} GPU(s), TensorFlow {tf.__version__}",
        flush=True,
    )
    model = build_model(keras, args.model, args.image_size, channels_first)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        # LMS cannot move the buffers of XLA clusters (docs/enabling.md).
        jit_compile=False if lms_on else "auto",
    )
    callbacks = []
    stats_logger = None
    if args.stats:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        stats_logger = LMSStatsLogger(
            args.output_dir / f"{args.model}_lms_stats.csv",
            gpu_id=0,
            warmup_steps=args.stats_warmup_steps,
            tensorboard_dir=args.output_dir / "tensorboard" / args.model,
        )
        callbacks.append(stats_logger)
    started = time.perf_counter()
    model.fit(
        synthetic_dataset(tf, args, channels_first),
        epochs=args.epochs,
        steps_per_epoch=args.steps,
        callbacks=callbacks,
        verbose=2,
    )
    elapsed = time.perf_counter() - started
    print(f"trained {args.epochs * args.steps} step(s) in {elapsed:.1f} s")
    if stats_logger is not None:
        print(f"statistics: {stats_logger.logfile} (per step), {stats_logger.summary_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
