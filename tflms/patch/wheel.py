"""The tensorflow-cpu wheel of a tag, and where TF source paths live in it.

Verification imports the wheel it checks (tf.sysconfig's flags, the Python half, the
goldens), so each tag needs an interpreter whose `tensorflow` is that tag's wheel: the one
running tflms when its TensorFlow is that version (the checkout's .venv has the newest), else
a virtual environment per tag under ~/.cache/tflms/venvs/<version> (TFLMS_CACHE_DIR moves
~/.cache/tflms), created on first use with `pip install tensorflow-cpu==<version>`. The
nightly check uses one named `nightly` holding the current tf-nightly-cpu.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# TF source tree prefix -> location in the wheel's include/ tree. XLA and tsl are
# vendored under third_party/ in TensorFlow's repository but installed flat.
_INCLUDE_PREFIXES = (
    ("third_party/xla/third_party/tsl/", ""),
    ("third_party/xla/", ""),
    ("", ""),
)


# What the per-tag environment holds besides TensorFlow: what verify imports.
TAG_VENV_EXTRAS = ("pybind11", "tqdm")
NIGHTLY = "nightly"
# TFLMS_NIGHTLY_DIST=tf-nightly picks the full nightly (same headers and Python sources).
NIGHTLY_DIST = os.environ.get("TFLMS_NIGHTLY_DIST", "tf-nightly-cpu")
# Set in a verification that runs against whatever TensorFlow is installed (the nightly).
ANY_TF_ENV = "TFLMS_VERIFY_ANY_TF"


class WheelError(RuntimeError):
    pass


def installed_tf_version() -> str | None:
    """The version of the TensorFlow distribution this interpreter has, or None."""
    for dist in ("tensorflow-cpu", "tensorflow", "tf-nightly-cpu", "tf-nightly"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def venvs_dir() -> Path:
    base = os.environ.get("TFLMS_CACHE_DIR") or str(Path.home() / ".cache" / "tflms")
    return Path(base) / "venvs"


def tag_python(version: str) -> Path:
    """The interpreter of the per-tag environment (version, or NIGHTLY)."""
    return venvs_dir() / version / "bin" / "python"


def ensure_tag_python(version: str, say: Callable[[str], None] = print) -> Path:
    """The per-tag environment's interpreter, created (or, for NIGHTLY, upgraded) first.

    About 250 MB of wheel plus TensorFlow's dependencies on first use; later calls reuse it.
    """
    venv = venvs_dir() / version
    python = tag_python(version)
    ready = venv / ".tflms-ready"
    if ready.is_file() and python.is_file() and version != NIGHTLY:
        return python
    if not python.is_file():
        say(f"creating {venv} (a virtual environment with the tensorflow-cpu {version} wheel)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    dist = [NIGHTLY_DIST] if version == NIGHTLY else [f"tensorflow-cpu=={version}"]
    flags = ["--pre", "--upgrade"] if version == NIGHTLY else []
    say(f"pip install {' '.join(flags + dist)} into {venv}")
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *flags, *dist, *TAG_VENV_EXTRAS],
        check=False,
    )
    if proc.returncode != 0:
        raise WheelError(
            f"could not install {' '.join(dist)} into {venv} (pip exited {proc.returncode}); "
            f"the wheel may not exist for Python {sys.version_info[0]}.{sys.version_info[1]}"
        )
    ready.write_text(" ".join(dist) + "\n")
    return python


def find_wheel(version: str) -> Path:
    """Returns the `tensorflow` package directory of the installed wheel."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise WheelError(
            f"tensorflow is not installed; install the official wheel: "
            f"pip install tensorflow-cpu=={version}"
        )
    installed = installed_tf_version()
    if installed != version and not os.environ.get(ANY_TF_ENV):
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
