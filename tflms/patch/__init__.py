"""The TensorFlow patch: generate it from core/ and tf/, apply it, verify it.

Layout read by the generator, in the checkout or, installed, in the copy the package carries
(tflms/_data.py):
  tf/<layer>/files/<path in TF>       new files, added verbatim
  tf/<layer>/diffs/NN-<name>.diff     hunks on existing TF files, in name order
  tf/<layer>/COMMIT_MESSAGE           subject line, blank line, body
  tf/v<version>/INHERITS              optional: the tag whose layers come next (one line, vX.Y.Z)
  tf/v<version>/PROVENANCE.md         how that tag's hunks were checked (not part of the patch)
  core/include/tflms/*.h, core/src/*  the engine, copied under ENGINE_DIR

A tag's layers (tf_layers) are, most specific first: tf/v<version>/, then the layers of the
tag its INHERITS file names (if any), ending with tf/common/, which holds what every tag
shares. For each path under files/, each diffs/ file name and COMMIT_MESSAGE, the first
layer that has it wins; a diffs/ file with no hunks (only its '#' comment) removes the diff
of that name from the layers below. So tf/v<version>/ holds only what differs for that tag.
"""

from __future__ import annotations

from pathlib import Path

from tflms import _data

# Oldest first; the last is the newest, the default of every command. Each has a tf/v<version>/
# directory (its PROVENANCE.md at least) and a committed patch.
SUPPORTED_VERSIONS = ("2.19.1", "2.20.0", "2.21.0")
NEWEST_VERSION = SUPPORTED_VERSIONS[-1]
# The layer every tag ends with: what all supported tags share.
COMMON_LAYER = "common"

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
    """The tag's own layer: tf/v<version>/ (what differs for that tag, and its PROVENANCE.md)."""
    return (root or repo_root()) / "tf" / f"v{version}"


def tf_layers(version: str, root: Path | None = None) -> list[Path]:
    """The directories the tag's patch is read from, most specific first (see module doc)."""
    root = root or repo_root()
    layers: list[Path] = []
    current: str | None = version
    while current is not None:
        layer = tf_dir(current, root)
        if layer in layers:
            raise ValueError(f"tf/v{version}: INHERITS files form a cycle through v{current}")
        layers.append(layer)
        current = inherited_version(layer)
    layers.append(root / "tf" / COMMON_LAYER)
    return layers


def inherited_version(layer: Path) -> str | None:
    """The version named by layer/INHERITS ('v2.20.0'), or None without that file."""
    path = layer / "INHERITS"
    if not path.is_file():
        return None
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    tags = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(tags) != 1 or not tags[0].startswith("v"):
        raise ValueError(f"{path}: expected one line naming a tag, like v2.20.0")
    return tags[0][1:]


def patch_path(version: str, root: Path | None = None) -> Path:
    return _data.patch_file(version, root)


def check_version(version: str) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"TensorFlow {version} is not supported; supported: {', '.join(SUPPORTED_VERSIONS)}"
        )
