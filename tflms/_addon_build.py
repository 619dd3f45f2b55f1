"""Builds the tflms.addon library against the installed stock TensorFlow GPU wheel.

The library is the patch's shared TensorFlow-side C++ (movable tensor buffers, the LMS
allocator, the pin rule), the engine with its CUDA backend, the tensor-constructor hooks
shared with tflms.tfcpu, and the add-on's GPU device (csrc/). Everything is compiled with
the wheel's own headers, including the CUDA 12 headers it ships, and linked against its
libtensorflow_framework.so.2 only: that library also exports TensorFlow's lazily loading
stubs of the CUDA runtime and driver, so the add-on resolves libcudart and libcuda exactly
as TensorFlow does. The build is shared with tflms.tfcpu (tflms/_wheel_build.py) and
cached under $TFLMS_CACHE_DIR (default ~/.cache/tflms)/addon/<hash>/.

It sits outside the tflms.addon package because importing that package installs the
add-on into TensorFlow; building, checking versions and the tests must not.
"""

from __future__ import annotations

from pathlib import Path

from tflms import _wheel_build
from tflms._wheel_build import BuildError, LibrarySpec
from tflms.patch import SUPPORTED_VERSIONS

__all__ = [
    "SPEC",
    "SUPPORTED_TF_VERSIONS",
    "BuildError",
    "check_tensorflow_version",
    "library_path",
]

# One add-on per tag the patch supports, each built against that version's own GPU wheel
# (no stable C++ ABI). The C++ side checks the same list at compile time
# (csrc/lms_gpu_device.cc, from the TF_*_VERSION macros the build defines).
SUPPORTED_TF_VERSIONS = SUPPORTED_VERSIONS
CSRC = Path(__file__).resolve().parent / "addon" / "csrc"
TFCPU_CSRC = Path(__file__).resolve().parent / "tfcpu" / "csrc"

SPEC = LibrarySpec(
    package="tflms.addon",
    library="libtflms_addon.so",
    cache_subdir="addon",
    csrc=CSRC,
    supported_versions=SUPPORTED_TF_VERSIONS,
    distribution="tensorflow",
    patch_sources=(
        "tensorflow/core/framework/movable_tensor_buffer.cc",
        "tensorflow/core/common_runtime/lms/lms_allocator.cc",
        "tensorflow/core/common_runtime/lms/lms_options.cc",
        "tensorflow/core/common_runtime/lms/kernel_pins.cc",
    ),
    # The engine's CUDA backend: host code over the CUDA runtime, compiled as C++.
    engine_extra=("cuda_device.cu",),
    # What the patch's tensor.cc hunk does, done from outside (shared with tfcpu).
    extra_sources=(TFCPU_CSRC / "tensor_hooks.cc",),
    # gpu_device.h needs GOOGLE_CUDA (the wheel was built with it; TF_GPU_USE_PJRT is
    # not defined for the public wheel). The driver's entry points are linked from the
    # wheel's stubs (see core/src/cuda_device.h).
    extra_flags=("-DGOOGLE_CUDA=1", "-DTFLMS_CUDA_LINKED_DRIVER"),
    # TF_MAJOR_VERSION etc., which the 2.20+ headers expect from the build
    # (public/release_version.h): the add-on's code switches on them.
    define_version_macros=True,
    # 2.19's gpu_device.h reaches llvm/ADT (through stream_executor.h), absent from its wheel.
    host_llvm_headers=True,
    wheel_include_dirs=("third_party/gpus/cuda/include",),
    digest_files=(Path(__file__).resolve(), TFCPU_CSRC / "tensor_hooks.cc"),
)


def check_tensorflow_version(version: str) -> None:
    _wheel_build.check_tensorflow_version(SPEC, version)


def library_path(quiet: bool = False) -> tuple[Path, str]:
    """The add-on library for this TensorFlow, built first if needed, and the version."""
    return _wheel_build.library_path(SPEC, quiet=quiet)
