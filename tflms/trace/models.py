"""The models `tflms trace` knows: Keras applications, a 3D U-Net defined here, and keras-hub
transformer language models (tflms.trace.transformers).

Models are built with random initial weights (weights=None): nothing is downloaded. TensorFlow
and Keras are imported inside functions so that importing this module stays cheap. For the
transformers the input size is the sequence length, in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    name: str
    default_size: int
    min_size: int
    # How many times the input edge must divide (pooling/striding levels that need exact halving).
    size_multiple: int = 1
    volumetric: bool = False  # 3-D input (D, H, W, C) and per-voxel labels
    channels: int = 3  # input channels (volumetric models: C)
    text: bool = False  # token ids in, logits over the vocabulary at every position out
    # The optimizer of the traced step: "sgd" (momentum 0.9) for the vision models, "adam" for
    # the transformers, as each family is usually trained.
    optimizer: str = "sgd"
    # The batch the planner traces when none is given. A 3D U-Net trains on one volume at a
    # time: at 480^3, 32 volumes would be 6.3 TiB of tensors.
    default_batch: int = 32


_SPECS = (
    ModelSpec("ResNet50", 224, 32),
    ModelSpec("ResNet101", 224, 32),
    ModelSpec("ResNet152", 224, 32),
    ModelSpec("DenseNet121", 224, 32),
    ModelSpec("DenseNet169", 224, 32),
    ModelSpec("DenseNet201", 224, 32),
    ModelSpec("MobileNetV2", 224, 32),
    ModelSpec("InceptionV3", 299, 75),
    ModelSpec("Xception", 299, 71),
    ModelSpec("NASNetLarge", 331, 32),
    ModelSpec("EfficientNetB0", 224, 32),
    ModelSpec("EfficientNetB1", 240, 32),
    ModelSpec("EfficientNetB2", 260, 32),
    ModelSpec("EfficientNetB3", 300, 32),
    ModelSpec("EfficientNetB4", 380, 32),
    ModelSpec("EfficientNetB5", 456, 32),
    ModelSpec("EfficientNetB6", 528, 32),
    ModelSpec("EfficientNetB7", 600, 32),
    ModelSpec("UNet3D", 64, 16, size_multiple=8, volumetric=True, channels=1, default_batch=1),
    # Closer in width to the BraTS 3D U-Net the TFLMS papers trained (docs/results.md):
    # four MRI channels in, 16 filters at full resolution, five levels.
    ModelSpec(
        "UNet3DBraTS", 64, 16, size_multiple=16, volumetric=True, channels=4, default_batch=1
    ),
    # keras-hub transformers: the size is the sequence length.
    ModelSpec("GPT2-tiny", 128, 8, text=True, optimizer="adam"),
    ModelSpec("GPT2-124M", 1024, 8, text=True, optimizer="adam"),
    ModelSpec("GPT2-355M", 1024, 8, text=True, optimizer="adam"),
    ModelSpec("GPT2-774M", 1024, 8, text=True, optimizer="adam"),
    ModelSpec("GPT2-1.5B", 1024, 8, text=True, optimizer="adam"),
    ModelSpec("BERT-large", 512, 8, text=True, optimizer="adam"),
    ModelSpec("Llama-1B", 2048, 8, text=True, optimizer="adam"),
)

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}
MODEL_NAMES: tuple[str, ...] = tuple(spec.name for spec in _SPECS)

UNET3D_CLASSES = 3
UNET3D_BASE_FILTERS = 32
UNET3D_LEVELS = 4
BRATS_CLASSES = 4  # background and three tumour regions
BRATS_BASE_FILTERS = 16
BRATS_LEVELS = 5
IMAGE_CLASSES = 1000


def resolve_model_name(name: str) -> str:
    """The canonical spelling of a model name, matched case-insensitively."""
    by_lower = {n.lower(): n for n in MODEL_NAMES}
    canonical = by_lower.get(name.lower())
    if canonical is None:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    return canonical


def check_input_size(name: str, input_size: int | None) -> int:
    """The input edge to use for a model, or a ValueError saying what to change."""
    spec = MODEL_SPECS[resolve_model_name(name)]
    if input_size is None:
        return spec.default_size
    if input_size < spec.min_size:
        raise ValueError(
            f"{spec.name} needs an input size of at least {spec.min_size}, got {input_size}"
        )
    if input_size % spec.size_multiple:
        raise ValueError(
            f"{spec.name} needs an input size that is a multiple of {spec.size_multiple} "
            f"(its levels halve the input), got {input_size}"
        )
    return input_size


def input_shape(name: str, input_size: int) -> tuple[int, ...]:
    """Shape of one example (no batch dimension), channels last."""
    spec = MODEL_SPECS[resolve_model_name(name)]
    if spec.text:
        return (input_size,)
    if spec.volumetric:
        return (input_size, input_size, input_size, spec.channels)
    return (input_size, input_size, spec.channels)


def input_dtype(name: str) -> str:
    return "int32" if MODEL_SPECS[resolve_model_name(name)].text else "float32"


def label_shape(name: str, input_size: int) -> tuple[int, ...]:
    """Shape of one example's integer labels: a class, or a class per voxel for the U-Net."""
    spec = MODEL_SPECS[resolve_model_name(name)]
    if spec.volumetric:
        return (input_size, input_size, input_size)
    if spec.text:
        return (input_size,)  # the next token at every position
    return ()


def num_classes(name: str) -> int:
    canonical = resolve_model_name(name)
    if MODEL_SPECS[canonical].text:
        from tflms.trace.transformers import TRANSFORMERS

        return TRANSFORMERS[canonical].vocabulary_size
    if canonical == "UNet3DBraTS":
        return BRATS_CLASSES
    return UNET3D_CLASSES if MODEL_SPECS[canonical].volumetric else IMAGE_CLASSES


def build_model(name: str, input_size: int | None = None) -> Any:
    """A Keras model with random weights for a name in MODEL_NAMES."""
    canonical = resolve_model_name(name)
    size = check_input_size(canonical, input_size)
    if MODEL_SPECS[canonical].text:
        from tflms.trace.transformers import build_language_model

        return build_language_model(canonical, size)
    if canonical == "UNet3D":
        return build_unet3d(size)
    if canonical == "UNet3DBraTS":
        return build_unet3d(
            size, BRATS_CLASSES, BRATS_BASE_FILTERS, BRATS_LEVELS, channels=4, name="unet3d_brats"
        )
    import keras

    constructor = getattr(keras.applications, canonical)
    return constructor(weights=None, input_shape=input_shape(canonical, size))


def build_unet3d(
    input_size: int,
    classes: int = UNET3D_CLASSES,
    base_filters: int = UNET3D_BASE_FILTERS,
    levels: int = UNET3D_LEVELS,
    channels: int = 1,
    name: str = "unet3d",
) -> Any:
    """A standard 3D U-Net (Cicek et al. 2016 shape): `levels` resolution levels, each two
    Conv3D(3x3x3) + BatchNorm + ReLU blocks; max-pooling down, transposed convolution up,
    skip connections by concatenation; a 1x1x1 convolution and softmax give `classes` per voxel.
    Filters double per level from `base_filters`. Input: (D, H, W, channels) with
    D = H = W = input_size.
    """
    import keras
    from keras import layers

    def conv_block(x: Any, filters: int, prefix: str) -> Any:
        for i in (1, 2):
            x = layers.Conv3D(filters, 3, padding="same", use_bias=False, name=f"{prefix}_conv{i}")(
                x
            )
            x = layers.BatchNormalization(name=f"{prefix}_bn{i}")(x)
            x = layers.ReLU(name=f"{prefix}_relu{i}")(x)
        return x

    inputs = keras.Input(shape=(input_size, input_size, input_size, channels), name="volume")
    x = inputs
    skips = []
    for level in range(levels - 1):
        x = conv_block(x, base_filters * 2**level, f"down{level}")
        skips.append(x)
        x = layers.MaxPooling3D(2, name=f"down{level}_pool")(x)
    x = conv_block(x, base_filters * 2 ** (levels - 1), "bottom")
    for level in reversed(range(levels - 1)):
        filters = base_filters * 2**level
        x = layers.Conv3DTranspose(filters, 2, strides=2, name=f"up{level}_upconv")(x)
        x = layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        x = conv_block(x, filters, f"up{level}")
    outputs = layers.Conv3D(classes, 1, activation="softmax", name="classifier")(x)
    return keras.Model(inputs, outputs, name=name)
