"""`tflms trace`: capture a Keras model's training step as a trace file.

TensorFlow is imported only when the command runs, so `tflms --help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from tflms.trace.models import MODEL_NAMES, MODEL_SPECS, check_input_size, resolve_model_name


def add_parsers(sub: Any) -> None:
    parser = sub.add_parser(
        "trace",
        help="capture a Keras model's training step as a trace (CPU, nothing executed)",
        description=(
            "Build the training step (forward, loss, gradients, optimizer update: SGD with "
            "momentum for the vision models, Adam for the transformers) of a model as a "
            "TensorFlow graph without running it, and save its ops, tensors, persistent "
            "tensors and estimated costs as a trace file (docs/trace-format.md)."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help=f"model name (case-insensitive): {', '.join(MODEL_NAMES)}",
    )
    parser.add_argument(
        "--batch-size", type=int, help="batch size (default 32, and 1 for the 3D U-Nets)"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="image edge in pixels, the 3D U-Net's cube edge, or a transformer's sequence "
        "length in tokens (default: the model's own)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "mixed"),
        default="fp32",
        help="fp32 (default) or mixed: Keras' mixed_bfloat16 policy (bfloat16 compute, "
        "float32 variables and optimizer state)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="trace file to write; .gz compresses (default: MODEL-bBATCH-sSIZE.trace.json.gz)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    parser.add_argument("--log-file", type=Path, default=None, help="also write logs to FILE")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    parser.set_defaults(func=run)


def _setup_logging(verbose: bool, log_file: Path | None) -> None:
    logger = logging.getLogger("tflms")
    logger.setLevel(logging.INFO)
    stream = logging.StreamHandler(sys.stderr)
    stream.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.addHandler(stream)
    if log_file is not None:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def run(args: argparse.Namespace) -> int:
    try:
        model = resolve_model_name(args.model)
        size = check_input_size(model, args.image_size)
    except ValueError as exc:
        print(f"tflms trace: {exc}", file=sys.stderr)
        return 2
    if args.batch_size is None:
        args.batch_size = MODEL_SPECS[model].default_batch
    if args.batch_size < 1:
        print(
            f"tflms trace: --batch-size must be at least 1, got {args.batch_size}", file=sys.stderr
        )
        return 2
    mixed = "" if args.precision == "fp32" else f"-{args.precision}"
    output: Path = args.output or Path(f"{model}-b{args.batch_size}-s{size}{mixed}.trace.json.gz")
    if output.exists() and not args.force:
        print(
            f"tflms trace: {output} already exists; pass --force to overwrite it "
            "or --output to write elsewhere",
            file=sys.stderr,
        )
        return 1
    if output.parent and not output.parent.exists():
        print(f"tflms trace: directory {output.parent} does not exist", file=sys.stderr)
        return 2
    _setup_logging(args.verbose, args.log_file)

    from tflms.trace.capture import trace_model
    from tflms.trace.format import save_trace

    try:
        trace = trace_model(
            model,
            args.batch_size,
            size,
            progress=not args.no_progress,
            precision=args.precision,
        )
    except ValueError as exc:
        print(f"tflms trace: {exc}", file=sys.stderr)
        return 1
    save_trace(trace, output)
    summary = trace.summary()
    print(f"{model}, batch {args.batch_size}, input {'x'.join(map(str, trace.input_shape))}")
    print(f"  ops:              {summary['ops']}")
    print(f"  tensors:          {summary['tensors']} ({summary['persistent_tensors']} persistent)")
    print(
        f"  persistent bytes: {summary['persistent_bytes']} ({_gib(summary['persistent_bytes'])})"
    )
    print(f"  peak live bytes:  {summary['peak_live_bytes']} ({_gib(summary['peak_live_bytes'])})")
    print(f"  est. GFLOP/step:  {summary['total_flops'] / 1e9:.1f}")
    print(f"  traced in {trace.metadata.get('trace_seconds', 0):.1f} s -> {output}")
    return 0
