"""Builds the tflms.tfcpu library against the installed TensorFlow wheel.

The library is the patch's TensorFlow-side C++ (laid out with the patched headers by
the same overlay `tflms verify` compiles), the engine with its simulated device, and the
harness's own device and hooks (csrc/). The build itself is shared with the stock-wheel
add-on (tflms/_wheel_build.py); it is cached per content under
$TFLMS_CACHE_DIR (default ~/.cache/tflms)/tfcpu/<hash>/ and shows its progress.
"""

from __future__ import annotations

from pathlib import Path

from tflms import _wheel_build
from tflms._wheel_build import ENGINE_DIR, BuildError, LibrarySpec

__all__ = [
    "CSRC",
    "ENGINE_DIR",
    "LIBRARY_NAME",
    "PATCH_SOURCES",
    "SPEC",
    "SUPPORTED_TF_VERSIONS",
    "BuildError",
    "cache_dir",
    "check_tensorflow_version",
    "library_path",
]

SUPPORTED_TF_VERSIONS = ("2.21.0",)
LIBRARY_NAME = "libtflms_tfcpu.so"
CSRC = Path(__file__).resolve().parent / "csrc"
# The patch's files the harness runs (paths in the TensorFlow tree).
PATCH_SOURCES = (
    "tensorflow/core/framework/movable_tensor_buffer.cc",
    "tensorflow/core/common_runtime/lms/lms_allocator.cc",
    "tensorflow/core/common_runtime/lms/lms_options.cc",
    "tensorflow/core/common_runtime/lms/kernel_pins.cc",
)

SPEC = LibrarySpec(
    package="tflms.tfcpu",
    library=LIBRARY_NAME,
    cache_subdir="tfcpu",
    csrc=CSRC,
    supported_versions=SUPPORTED_TF_VERSIONS,
    distribution="tensorflow-cpu",
    patch_sources=PATCH_SOURCES,
    # The simulated device is the engine's test backend, not in the patch.
    engine_extra=("sim_device.cc",),
    # The harness reads EagerTensors (C API, Python's buffer protocol).
    link_cc_and_pywrap=True,
    digest_files=(Path(__file__).resolve(),),
)


def check_tensorflow_version(version: str) -> None:
    _wheel_build.check_tensorflow_version(SPEC, version)


def cache_dir() -> Path:
    return _wheel_build.cache_dir(SPEC)


def library_path(quiet: bool = False) -> Path:
    """The harness library for this TensorFlow, built first if needed."""
    return _wheel_build.library_path(SPEC, quiet=quiet)[0]
