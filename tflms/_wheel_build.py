"""Builds a native library against the installed TensorFlow wheel (shared build logic).

Two front-ends run the patch's TensorFlow-side C++ inside a stock TensorFlow process:
`tflms.tfcpu` (the CPU harness over the simulated device) and `tflms.addon` (the GPU
add-on for the stock `tensorflow` wheel). Both compile the same things the same way:

  * the patch's files and the engine, laid out by `tflms verify`'s overlay (the wheel's
    own include tree plus the files the patch adds and the patch's header hunks, which
    are ABI-neutral: tensor.h's data pointer becomes an atomic of the same size and
    layout, and a friend is declared);
  * the front-end's own csrc/;
  * with the wheel's compile flags, the wheel's headers as -isystem, so -Werror-style
    warnings judge our code only;
  * linked with -Wl,--no-undefined against the wheel's own shared libraries.

A build is cached per content under $TFLMS_CACHE_DIR (default ~/.cache/tflms)/<front-end>/
<hash>/ and shows its progress (a few minutes on two cores). What differs between the
front-ends is a `LibrarySpec`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where the engine sits in the overlay (the patch puts it under gpu/lms/core).
ENGINE_DIR = "tensorflow/core/common_runtime/gpu/lms/core"


class BuildError(RuntimeError):
    """A front-end's library could not be built; the message says what to change."""


@dataclass(frozen=True)
class LibrarySpec:
    """What one front-end builds."""

    # The Python package, for messages ("tflms.tfcpu").
    package: str
    library: str  # file name of the shared library
    cache_subdir: str  # under $TFLMS_CACHE_DIR
    csrc: Path  # the front-end's own sources (*.cc, *.h)
    supported_versions: tuple[str, ...]
    # pip requirement naming the wheel, for messages ("tensorflow-cpu").
    distribution: str
    # Paths in the TensorFlow tree of the patch's files to compile (from the overlay).
    patch_sources: tuple[str, ...]
    # Engine sources (file names under core/src) to compile besides the portable ones.
    engine_extra: tuple[str, ...] = ()
    # Further sources outside csrc/ (another front-end's shared file).
    extra_sources: tuple[Path, ...] = ()
    extra_flags: tuple[str, ...] = ()
    # Directories of the wheel's include/ tree searched after it (-isystem), such as the
    # CUDA headers the GPU wheel ships.
    wheel_include_dirs: tuple[str, ...] = ()
    # Beyond libtensorflow_framework.so.2: link the C++ API and the Python bindings too.
    link_cc_and_pywrap: bool = False
    # Define TF_MAJOR_VERSION, TF_MINOR_VERSION, TF_PATCH_VERSION and TF_VERSION_SUFFIX
    # from the wheel's version, as TensorFlow's own build does: from 2.20 on,
    # tensorflow/core/public/release_version.h expects them from the build, so the wheel's
    # headers alone do not say which TensorFlow they are (2.19's version.h still defines
    # them, with the same values).
    define_version_macros: bool = False
    # Search the host's LLVM headers last when the wheel lacks llvm/ADT (2.19's
    # StreamExecutor headers include it), as `tflms verify` does.
    host_llvm_headers: bool = False
    # Files that change what is built (each front-end's _build.py).
    digest_files: tuple[Path, ...] = field(default_factory=tuple)

    def versions_text(self) -> str:
        return ", ".join(self.supported_versions)


def tensorflow_version_and_lib(spec: LibrarySpec) -> tuple[str, Path]:
    try:
        import tensorflow as tf  # noqa: PLC0415  (slow import, only when needed)
    except ImportError as e:
        raise BuildError(
            f"{spec.package} needs TensorFlow: pip install "
            f"{spec.distribution}=={spec.supported_versions[-1]}"
        ) from e
    return tf.__version__, Path(tf.sysconfig.get_lib())


def check_tensorflow_version(spec: LibrarySpec, version: str) -> None:
    if version not in spec.supported_versions:
        raise BuildError(
            f"{spec.package} is built for TensorFlow {spec.versions_text()} only (TensorFlow has "
            f"no stable C++ ABI); this process has TensorFlow {version}. Install "
            f"{spec.distribution}=={spec.supported_versions[-1]}, or use the patch for your "
            f"version (tflms patch)."
        )


def version_macros(version: str) -> list[str]:
    """-D flags for TensorFlow's version macros, from its version string ("2.21.0")."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(.*)", version)
    if match is None:
        raise BuildError(f"cannot read TensorFlow's version from {version!r}")
    major, minor, patch, suffix = match.groups()
    suffix = suffix.replace("\\", "").replace('"', "")
    return [
        f"-DTF_MAJOR_VERSION={major}",
        f"-DTF_MINOR_VERSION={minor}",
        f"-DTF_PATCH_VERSION={patch}",
        f'-DTF_VERSION_SUFFIX="{suffix}"',
    ]


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise BuildError(
            "building the LMS library needs a C++17 compiler and found none: install g++ "
            "(apt-get install g++) or set CXX to one"
        )
    return found


def cache_root() -> Path:
    return Path(os.environ.get("TFLMS_CACHE_DIR") or str(Path.home() / ".cache" / "tflms"))


def cache_dir(spec: LibrarySpec) -> Path:
    return cache_root() / spec.cache_subdir


def sources_digest(spec: LibrarySpec, root: Path, version: str, cxx: str, tf_lib: Path) -> str:
    h = hashlib.sha256()
    # The wheel's location too: the library's run path names it.
    h.update(f"{version}\0{cxx}\0{sys.version_info[:2]}\0{spec.library}\0{tf_lib}\0".encode())
    h.update("\0".join(spec.extra_flags).encode())
    from tflms.patch import tf_layers  # noqa: PLC0415

    layers = tf_layers(version, root)  # tf/v<version>/, what it inherits, tf/common/
    inputs = sorted(
        [
            *spec.csrc.glob("*"),
            *(root / "core").rglob("*"),
            *(p for layer in layers for p in (layer / "files").rglob("*")),
            *(p for layer in layers for p in (layer / "diffs").glob("*.diff")),
            *spec.extra_sources,
            *spec.digest_files,
            Path(__file__),
        ]
    )
    for p in inputs:
        if p.is_file() and p.suffix in (".h", ".cc", ".cu", ".diff", ".py"):
            h.update(str(p.relative_to(p.anchor)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise BuildError(f"cannot run {cmd[0]} for {what}: {e}") from e
    if proc.returncode != 0:
        missing = _missing_header(proc.stderr)
        hint = (
            f"\nThe header {missing} was not found: the TensorFlow wheel's include/ tree "
            "(tf.sysconfig.get_include()) should have it; reinstall the wheel, or report "
            "which TensorFlow this is."
            if missing
            else ""
        )
        raise BuildError(f"compiling {what} failed:\n{proc.stderr[-4000:]}{hint}")


def _missing_header(stderr: str) -> str | None:
    for line in stderr.splitlines():
        if "fatal error:" in line and "No such file or directory" in line:
            return line.split("fatal error:", 1)[1].split(":", 1)[0].strip()
    return None


def library_path(
    spec: LibrarySpec, quiet: bool = False, check_version: bool = True
) -> tuple[Path, str]:
    """The front-end's library for this TensorFlow, built first if needed.

    Returns (path, TensorFlow version).
    """
    version, tf_lib = tensorflow_version_and_lib(spec)
    if check_version:
        check_tensorflow_version(spec, version)
    from tflms.patch import repo_root  # noqa: PLC0415
    from tflms.patch.compile_check import (  # noqa: PLC0415
        CompileCheckError,
        _wheel_include,
        build_overlay,
        llvm_fallback_flags,
        python_binding_flags,
        wheel_compile_flags,
    )

    root = repo_root()
    cxx = compiler()
    out_dir = cache_dir(spec) / sources_digest(spec, root, version, cxx, tf_lib)
    lib = out_dir / spec.library
    if lib.is_file():
        return lib, version

    cache_dir(spec).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{spec.cache_subdir}-build-", dir=cache_dir(spec)))
    try:
        overlay = work / "include"
        try:
            build_overlay(version, root, overlay)
            wheel_flags = wheel_compile_flags()
        except CompileCheckError as e:
            raise BuildError(f"{spec.package}: cannot lay out TensorFlow's headers: {e}") from e
        engine_src = overlay / ENGINE_DIR / "src"
        core_src = root / "core" / "src"  # the engine's backends outside the patch
        sources = [
            *sorted(p for p in engine_src.glob("*.cc") if not p.name.startswith("cuda_")),
            *(overlay / s for s in spec.patch_sources),
            *(core_src / name for name in spec.engine_extra),
            *spec.extra_sources,
            *sorted(spec.csrc.glob("*.cc")),
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
            str(spec.csrc),
            "-I",
            str(core_src),
            "-isystem",
            str(overlay),
            *wheel_flags,
            *python_binding_flags(),
            # The 2.19 wheel's StreamExecutor headers include LLVM's ADT, which it does not
            # ship: the host's copy, searched last.
            *(llvm_fallback_flags(wheel_flags) if spec.host_llvm_headers else []),
            *spec.extra_flags,
            *(version_macros(version) if spec.define_version_macros else []),
        ]
        tf_include = _wheel_include(wheel_flags)
        for rel in spec.wheel_include_dirs:
            if tf_include is None or not (tf_include / rel).is_dir():
                raise BuildError(
                    f"{spec.package}: the TensorFlow wheel has no include/{rel} (the headers "
                    f"{spec.distribution} ships); install {spec.distribution}=="
                    f"{spec.supported_versions[-1]}"
                )
            flags += ["-isystem", str(tf_include / rel)]
        objects = [work / f"{i:02d}_{s.stem}.o" for i, s in enumerate(sources)]

        def compile_one(pair: tuple[Path, Path]) -> Path:
            src, obj = pair
            # .cu files of the engine hold host code only (CUDA runtime calls): C++.
            lang = ["-x", "c++"] if src.suffix == ".cu" else []
            _run([cxx, *flags, *lang, "-c", str(src), "-o", str(obj)], src.name)
            return src

        progress_map(
            compile_one,
            list(zip(sources, objects, strict=True)),
            quiet,
            f"{spec.package}: building its LMS library (first use only)",
        )
        link = [
            cxx,
            "-shared",
            "-o",
            str(work / spec.library),
            *map(str, objects),
            f"-L{tf_lib}",
            "-l:libtensorflow_framework.so.2",
        ]
        rpath = [str(tf_lib)]
        if spec.link_cc_and_pywrap:
            pywrap = tf_lib / "python"
            link += [
                "-l:libtensorflow_cc.so.2",
                f"-L{pywrap}",
                "-l:lib_pywrap_tensorflow_common.so",
            ]
            rpath.append(str(pywrap))
        link += [f"-Wl,-rpath,{':'.join(rpath)}", "-Wl,--no-undefined", "-pthread"]
        _run(link, spec.library)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{spec.library}.{os.getpid()}"
        shutil.copyfile(work / spec.library, tmp)
        os.replace(tmp, lib)  # atomic: concurrent builders never see half a file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib, version


def progress_map(fn: Callable[[Any], Any], items: Sequence[Any], quiet: bool, desc: str) -> None:
    """Runs fn over items on the machine's cores, with a progress bar unless quiet."""
    jobs = int(os.environ.get("TFLMS_BUILD_JOBS") or 0) or max(
        1, min(len(items), os.cpu_count() or 1)
    )
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        if quiet:
            list(pool.map(fn, items))
            return
        try:
            from tqdm import tqdm  # noqa: PLC0415
        except ImportError:  # a bare environment: one line per file
            for i, _ in enumerate(pool.map(fn, items), 1):
                print(f"{desc}: {i}/{len(items)}", file=sys.stderr, flush=True)
            return
        for _ in tqdm(pool.map(fn, items), total=len(items), desc=desc, unit="file"):
            pass
