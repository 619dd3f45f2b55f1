"""The TensorFlow patch: generate it from core/ and tf/, apply it, verify it.

Layout read by the generator (per TensorFlow tag):
  tf/v<version>/files/<path in TF>   new files, added verbatim
  tf/v<version>/diffs/NN-<name>.diff  hunks on existing TF files, in name order
  tf/v<version>/COMMIT_MESSAGE        subject line, blank line, body
  core/include/tflms/*.h, core/src/*  the engine, copied under ENGINE_DIR
"""

from __future__ import annotations

from pathlib import Path

SUPPORTED_VERSIONS = ("2.21.0",)

# Where the engine lives inside TensorFlow.
ENGINE_DIR = "tensorflow/core/common_runtime/gpu/lms/core"

# Engine backends that stay out of TensorFlow: the simulator is for tests and
# the planner, and inside TensorFlow StreamExecutor replaces the CUDA backend.
ENGINE_EXCLUDED_PREFIXES = ("sim_device", "cuda_device")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def tf_dir(version: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / "tf" / f"v{version}"


def patch_path(version: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / "patches" / f"tensorflow_v{version}_large_model_support.patch"


def check_version(version: str) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"TensorFlow {version} is not supported; supported: {', '.join(SUPPORTED_VERSIONS)}"
        )
