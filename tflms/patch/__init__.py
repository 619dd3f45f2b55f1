"""The TensorFlow patch: generate it from core/ and tf/, apply it, verify it.

Layout read by the generator (per TensorFlow tag), in the checkout or, installed, in the copy
the package carries (tflms/_data.py):
  tf/v<version>/files/<path in TF>   new files, added verbatim
  tf/v<version>/diffs/NN-<name>.diff  hunks on existing TF files, in name order
  tf/v<version>/COMMIT_MESSAGE        subject line, blank line, body
  core/include/tflms/*.h, core/src/*  the engine, copied under ENGINE_DIR
"""

from __future__ import annotations

from pathlib import Path

from tflms import _data

SUPPORTED_VERSIONS = ("2.21.0",)

# Where the engine lives inside TensorFlow.
ENGINE_DIR = "tensorflow/core/common_runtime/gpu/lms/core"

# Engine backends that stay out of TensorFlow: the simulator is for tests and
# the planner, and inside TensorFlow StreamExecutor replaces the CUDA backend.
ENGINE_EXCLUDED_PREFIXES = ("sim_device", "cuda_device")


def repo_root() -> Path:
    """Where patches/, tf/ and core/ are read from: the checkout, or the installed copy."""
    return _data.source_root()


class NotACheckout(RuntimeError):
    """Something must be written into a tflms checkout, and this package is not in one."""


def checkout_patch_path(version: str) -> Path:
    """Where `tflms patch generate` writes the patch: the checkout's patches/."""
    root = _data.checkout_root()
    if root is None:
        raise NotACheckout(
            f"tflms runs from an installed copy ({_data.PACKAGE_DIR}), not from a checkout, "
            "so there is no patches/ to write to: pass --output FILE, or run it in a checkout"
        )
    return patch_path(version, root)


def tf_dir(version: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / "tf" / f"v{version}"


def patch_path(version: str, root: Path | None = None) -> Path:
    return _data.patch_file(version, root)


def check_version(version: str) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"TensorFlow {version} is not supported; supported: {', '.join(SUPPORTED_VERSIONS)}"
        )
