"""Builds the tflms.tfcpu library against the installed TensorFlow wheel.

The library is the patch's TensorFlow-side C++ (laid out with the patched headers by
the same overlay `tflms verify` compiles), the engine, and the harness's own device
and hooks (csrc/). It is built once per content and cached under
$TFLMS_CACHE_DIR (default ~/.cache/tflms)/tfcpu/<hash>/; a build takes a few minutes
on two cores and shows its progress.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SUPPORTED_TF_VERSIONS = ("2.21.0",)
LIBRARY_NAME = "libtflms_tfcpu.so"
CSRC = Path(__file__).resolve().parent / "csrc"
# The patch's files the harness runs (paths in the TensorFlow tree).
PATCH_SOURCES = (
    "tensorflow/core/framework/movable_tensor_buffer.cc",
    "tensorflow/core/common_runtime/lms/lms_allocator.cc",
    "tensorflow/core/common_runtime/lms/kernel_pins.cc",
)
ENGINE_DIR = "tensorflow/core/common_runtime/gpu/lms/core"


class BuildError(RuntimeError):
    """The harness library could not be built; the message says what to change."""


def _tensorflow() -> tuple[str, Path]:
    try:
        import tensorflow as tf  # noqa: PLC0415  (slow import, only when needed)
    except ImportError as e:
        raise BuildError("tflms.tfcpu needs TensorFlow: pip install tensorflow-cpu==2.21.0") from e
    return tf.__version__, Path(tf.sysconfig.get_lib())


def check_tensorflow_version(version: str) -> None:
    if version not in SUPPORTED_TF_VERSIONS:
        raise BuildError(
            f"tflms.tfcpu runs the patch for TensorFlow {', '.join(SUPPORTED_TF_VERSIONS)}; "
            f"this process has TensorFlow {version}. Install tensorflow-cpu=="
            f"{SUPPORTED_TF_VERSIONS[-1]}."
        )


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise BuildError(
            "tflms.tfcpu builds a C++ library on first use and found no compiler: "
            "install g++ (apt-get install g++) or set CXX"
        )
    return compiler


def _sources_digest(root: Path, version: str, compiler: str) -> str:
    h = hashlib.sha256()
    h.update(f"{version}\0{compiler}\0{sys.version_info[:2]}\0".encode())
    from tflms.patch import tf_layers  # noqa: PLC0415

    layers = tf_layers(version, root)  # tf/v<version>/, what it inherits, tf/common/
    inputs = sorted(
        [
            *CSRC.glob("*"),
            *(root / "core").rglob("*"),
            *(p for layer in layers for p in (layer / "files").rglob("*")),
            *(p for layer in layers for p in (layer / "diffs").glob("*.diff")),
            Path(__file__),
        ]
    )
    for p in inputs:
        if p.is_file() and p.suffix in (".h", ".cc", ".diff", ".py"):
            h.update(str(p.relative_to(p.anchor)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("TFLMS_CACHE_DIR") or str(Path.home() / ".cache" / "tflms")
    return Path(base) / "tfcpu"


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"compiling {what} failed:\n{proc.stderr[-4000:]}")


def library_path(quiet: bool = False) -> Path:
    """The harness library for this TensorFlow, built first if needed."""
    version, tf_lib = _tensorflow()
    check_tensorflow_version(version)
    from tflms.patch import repo_root  # noqa: PLC0415
    from tflms.patch.compile_check import (  # noqa: PLC0415
        build_overlay,
        python_binding_flags,
        wheel_compile_flags,
    )

    root = repo_root()
    compiler = _compiler()
    out_dir = cache_dir() / _sources_digest(root, version, compiler)
    lib = out_dir / LIBRARY_NAME
    if lib.is_file():
        return lib

    work = Path(
        tempfile.mkdtemp(
            prefix="tfcpu-build-", dir=cache_dir().as_posix() if cache_dir().is_dir() else None
        )
    )
    try:
        overlay = work / "include"
        build_overlay(version, root, overlay)
        engine_src = overlay / ENGINE_DIR / "src"
        sources = [
            *sorted(p for p in engine_src.glob("*.cc") if not p.name.startswith("cuda_")),
            *(overlay / s for s in PATCH_SOURCES),
            # The simulated device is the engine's test backend, not in the patch.
            root / "core" / "src" / "sim_device.cc",
            *sorted(CSRC.glob("*.cc")),
        ]
        flags = [
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-DNDEBUG",
            "-Wall",
            "-Wno-unused-parameter",
            "-Wno-deprecated-declarations",
            "-I",
            str(overlay / ENGINE_DIR / "include"),
            "-I",
            str(engine_src),
            "-I",
            str(CSRC),
            "-I",
            str(root / "core" / "src"),
            "-isystem",
            str(overlay),
            *wheel_compile_flags(),
            *python_binding_flags(),
        ]
        objects = [work / f"{i:02d}_{s.stem}.o" for i, s in enumerate(sources)]

        def compile_one(pair: tuple[Path, Path]) -> Path:
            src, obj = pair
            _run([compiler, *flags, "-c", str(src), "-o", str(obj)], src.name)
            return src

        _progress_map(compile_one, list(zip(sources, objects, strict=True)), quiet)
        pywrap = tf_lib / "python"
        link = [
            compiler,
            "-shared",
            "-o",
            str(work / LIBRARY_NAME),
            *map(str, objects),
            f"-L{tf_lib}",
            "-l:libtensorflow_framework.so.2",
            "-l:libtensorflow_cc.so.2",
            f"-L{pywrap}",
            "-l:lib_pywrap_tensorflow_common.so",
            f"-Wl,-rpath,{tf_lib}:{pywrap}",
            "-Wl,--no-undefined",
            "-pthread",
        ]
        _run(link, LIBRARY_NAME)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{LIBRARY_NAME}.{os.getpid()}"
        shutil.copyfile(work / LIBRARY_NAME, tmp)
        os.replace(tmp, lib)  # atomic: concurrent builders never see half a file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib


def _progress_map(fn, items: list, quiet: bool) -> None:  # type: ignore[no-untyped-def]
    jobs = max(1, min(len(items), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        if quiet:
            list(pool.map(fn, items))
            return
        from tqdm import tqdm  # noqa: PLC0415

        desc = "tflms.tfcpu: building the LMS harness (first use only)"
        for _ in tqdm(pool.map(fn, items), total=len(items), desc=desc, unit="file"):
            pass
