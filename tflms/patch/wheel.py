"""The installed tensorflow-cpu wheel and where TF source paths live in it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

# TF source tree prefix -> location in the wheel's include/ tree. XLA and tsl are
# vendored under third_party/ in TensorFlow's repository but installed flat.
_INCLUDE_PREFIXES = (
    ("third_party/xla/third_party/tsl/", ""),
    ("third_party/xla/", ""),
    ("", ""),
)


class WheelError(RuntimeError):
    pass


def find_wheel(version: str) -> Path:
    """Returns the `tensorflow` package directory of the installed wheel."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise WheelError(
            f"tensorflow is not installed; install the official wheel: "
            f"pip install tensorflow-cpu=={version}"
        )
    installed = None
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            installed = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if installed != version:
        raise WheelError(
            f"the installed TensorFlow is {installed}, but the patch is for {version}; "
            f"pip install tensorflow-cpu=={version}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def wheel_file(wheel_tf: Path, tf_path: str) -> Path | None:
    """The wheel's copy of a TF source file, or None if the wheel lacks it."""
    if tf_path.endswith(".py") and tf_path.startswith("tensorflow/"):
        candidate = wheel_tf / tf_path[len("tensorflow/") :]
        return candidate if candidate.is_file() else None
    if tf_path.endswith((".h", ".hpp", ".inc")):
        rel = include_rel(tf_path)
        candidate = wheel_tf / "include" / rel
        return candidate if candidate.is_file() else None
    return None


def include_rel(tf_path: str) -> str:
    """Where a TF source path sits in an include tree (-I root)."""
    for prefix, repl in _INCLUDE_PREFIXES:
        if prefix and tf_path.startswith(prefix):
            return repl + tf_path[len(prefix) :]
    return tf_path
