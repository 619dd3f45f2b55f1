"""Builds bench/tf_bfc_harness: the engine's sources plus TensorFlow's own BFC allocator.

The harness links the tflms engine (core/src, sim backend; no CUDA) with
libtensorflow_framework.so.2 from the installed tensorflow-cpu wheel. Only
bench/tf_side.cc sees TensorFlow's headers, included with -isystem so their
deprecation warnings do not trip -Werror on our code.

Everything lands under build/bench/: one object per source, keyed by a hash of
what it depends on, and the linked binary keyed by a hash of all of it, so an
unchanged tree links nothing and compiles nothing. Compiles run two at a time
(the machines this runs on have two cores).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO / "build" / "bench"
CXX = os.environ.get("CXX", "g++")
# Same optimisation as TensorFlow's release build of the allocator we compare with.
OPT_FLAGS = ["-O2", "-DNDEBUG"]
OUR_WARNINGS = ["-Wall", "-Wextra", "-Werror"]
JOBS = 2
_TF_HEADERS = ("allocator.h", "bfc_allocator.h")


class BuildError(RuntimeError):
    """The harness could not be built; the message says what to change."""


@dataclass(frozen=True)
class TensorFlowPaths:
    package_dir: Path
    include_dir: Path
    framework_lib: Path


def find_tensorflow() -> TensorFlowPaths:
    """Locates the wheel's headers and libtensorflow_framework without importing TensorFlow.

    The compile flags are those `tf.sysconfig.get_compile_flags()` reports for
    the 2.21 wheel (C++17, the new libstdc++ ABI); importing TensorFlow just to
    ask would add seconds to every cached run.
    """
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            "tensorflow is not installed in this Python; install the baseline with "
            "`pip install tensorflow-cpu==2.21.0` (or `pip install -e .[dev]`)"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    include = pkg / "include"
    lib = pkg / "libtensorflow_framework.so.2"
    if not (include / "xla" / "tsl" / "framework" / "bfc_allocator.h").is_file():
        raise BuildError(
            f"{include} has no xla/tsl/framework/bfc_allocator.h; the harness needs the "
            "tensorflow-cpu 2.21.0 wheel's headers"
        )
    if not lib.is_file():
        raise BuildError(f"{lib} is missing; reinstall tensorflow-cpu==2.21.0")
    return TensorFlowPaths(pkg, include, lib)


def tf_compile_flags(tf: TensorFlowPaths) -> list[str]:
    return [
        "-std=c++17",
        "-D_GLIBCXX_USE_CXX11_ABI=1",
        "-DEIGEN_MAX_ALIGN_BYTES=64",
        "-isystem",
        str(tf.include_dir),
    ]


def engine_sources() -> list[Path]:
    src = REPO / "core" / "src"
    return sorted(p for p in src.glob("*.cc") if not p.name.startswith("cuda_"))


def _headers() -> list[Path]:
    found: list[Path] = []
    for folder in (REPO / "core" / "include", REPO / "core" / "src", REPO / "bench"):
        found += sorted(folder.rglob("*.h"))
    return found


def _digest(paths: list[Path], extra: list[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update((str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)).encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class CompileJob:
    source: Path
    flags: tuple[str, ...]
    obj: Path


def _unity_source(sources: list[Path], key: str) -> Path:
    """One translation unit including every engine source: a third of the compile time."""
    path = BUILD_DIR / "obj" / f"engine_unity-{key}.cc"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(f'#include "{s}"\n' for s in sources)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def _plan(tf: TensorFlowPaths, unity: bool) -> tuple[list[CompileJob], Path, list[str]]:
    headers = _headers()
    engine_flags = ["-std=c++17", *OPT_FLAGS, "-Wall", "-Wextra", "-pthread"]
    engine_flags += ["-I", str(REPO / "core" / "include"), "-I", str(REPO / "core" / "src")]
    bench_flags = [*engine_flags, *OUR_WARNINGS, "-I", str(REPO / "bench")]
    tf_flags = [*tf_compile_flags(tf), *OPT_FLAGS, *OUR_WARNINGS, "-I", str(REPO / "bench")]
    jobs: list[CompileJob] = []
    sources = engine_sources()
    if unity:
        key = _digest([*sources, *headers], [CXX, *engine_flags])
        unit = _unity_source(sources, key)
        jobs.append(CompileJob(unit, tuple(engine_flags), unit.with_suffix(".o")))
    else:
        for src in sources:
            key = _digest([src, *headers], [CXX, *engine_flags])
            obj = BUILD_DIR / "obj" / f"{src.stem}-{key}.o"
            jobs.append(CompileJob(src, tuple(engine_flags), obj))
    # The slowest compile (TensorFlow's headers) first, so two workers finish together.
    tf_side = REPO / "bench" / "tf_side.cc"
    tf_headers = [tf.include_dir / "xla" / "tsl" / "framework" / n for n in _TF_HEADERS]
    key = _digest([tf_side, REPO / "bench" / "tf_side.h"], [CXX, *tf_flags])
    key = _digest(tf_headers, [key])  # a different wheel in the same place rebuilds
    jobs.insert(0, CompileJob(tf_side, tuple(tf_flags), BUILD_DIR / "obj" / f"tf_side-{key}.o"))
    harness = REPO / "bench" / "tf_bfc_harness.cc"
    key = _digest([harness, *headers], [CXX, *bench_flags])
    jobs.append(CompileJob(harness, tuple(bench_flags), BUILD_DIR / "obj" / f"harness-{key}.o"))
    link_flags = [f"-L{tf.package_dir}", "-l:libtensorflow_framework.so.2"]
    link_flags += [f"-Wl,-rpath,{tf.package_dir}", "-pthread"]
    binary_key = hashlib.sha256("".join(j.obj.name for j in jobs).encode())
    binary_key.update(" ".join(link_flags).encode())
    binary = BUILD_DIR / f"tf_bfc_harness-{binary_key.hexdigest()[:16]}"
    return jobs, binary, link_flags


def _run(cmd: list[str], log: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    with log.open("a") as f:
        f.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr + "\n")
    if proc.returncode != 0:
        raise BuildError(f"command failed (see {log}):\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")


def build_harness(
    progress: Callable[[str], None] | None = None, force: bool = False, unity: bool = False
) -> Path:
    """Returns the path of an up-to-date harness binary, compiling what changed.

    `unity` compiles the engine as one translation unit (fast; for the parity
    test). The benchmark compiles each engine source on its own, as
    TensorFlow's build would, so the engine gets no cross-file inlining that
    it would not get there. A unity build that fails (two sources defining the
    same internal name) falls back to separate objects.
    """
    if unity:
        try:
            return _build(progress, force, unity=True)
        except BuildError:
            if progress:
                progress("unity build failed; compiling engine sources separately")
    return _build(progress, force, unity=False)


def _build(progress: Callable[[str], None] | None, force: bool, unity: bool) -> Path:
    tf = find_tensorflow()
    if not engine_sources():
        raise BuildError(f"no engine sources under {REPO / 'core' / 'src'}")
    jobs, binary, link_flags = _plan(tf, unity)
    if binary.is_file() and not force:
        return binary
    (BUILD_DIR / "obj").mkdir(parents=True, exist_ok=True)
    log = BUILD_DIR / "build.log"
    todo = [j for j in jobs if force or not j.obj.is_file()]

    def compile_one(job: CompileJob) -> str:
        tmp = job.obj.with_suffix(f".{os.getpid()}.tmp.o")
        _run([CXX, *job.flags, "-c", str(job.source), "-o", str(tmp)], log)
        tmp.replace(job.obj)  # atomic: a concurrent build never sees half an object
        return job.source.name

    done = 0
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        for name in pool.map(compile_one, todo):
            done += 1
            if progress:
                progress(f"compiled {name} ({done}/{len(todo)})")
    tmp_bin = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    _run([CXX, "-o", str(tmp_bin), *(str(j.obj) for j in jobs), *link_flags], log)
    tmp_bin.replace(binary)
    if progress:
        progress(f"linked {binary.relative_to(REPO)}")
    return binary


def harness_env() -> dict[str, str]:
    """Environment for running the harness: TensorFlow's logging quiet (OOMs are expected)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


if __name__ == "__main__":
    try:
        print(build_harness(progress=lambda m: print(m, file=sys.stderr)))
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
