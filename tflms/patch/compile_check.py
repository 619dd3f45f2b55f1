"""Compile the C++ half of the patch against the tensorflow-cpu wheel's headers.

Verification (b): every C++ file the patch adds, and every TensorFlow header
it changes, must compile as the main translation unit with ``-Wall -Wextra
-Werror``, with ``GOOGLE_CUDA`` defined and not. Headers TensorFlow ships
are included with ``-isystem`` so that only the patch's own code is judged
(TensorFlow's headers raise deprecation warnings of their own); a file given
here is never a system header, so its warnings count even when it is one of
TensorFlow's (patched) headers.

``patched_include`` is a directory laid out like the wheel's ``include/``
(``tensorflow/...``, ``xla/...``): either a full copy with the patch applied
or an overlay holding only the changed and new files. It is searched before
the wheel's own tree. ``own_include``, when given, holds the files the patch
adds, laid out the same way and searched first with ``-I``: their warnings
then count wherever they are included, so a header whose own .cc includes it
first is judged by that .cc's compile. The LMS engine's headers, which TensorFlow builds with
``strip_include_prefix = "include"``, are found under
``tensorflow/core/common_runtime/gpu/lms/core/include`` in it.

Files are only compiled (``-fsyntax-only``), never linked: the wheel has no
GPU kernels to link against, and TensorFlow's .cc files are not in it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ENGINE_INCLUDE = Path("tensorflow/core/common_runtime/gpu/lms/core/include")
CUDA_INCLUDE = Path("/usr/local/cuda/include")
WARNING_FLAGS = ["-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]
# A TensorFlow header the patch changes is compiled as the main file, so its
# own pre-existing warnings would count too; in 2.21 those are deprecations
# (tsl::mutex in favour of absl::Mutex), which are TensorFlow's, not ours.
TF_HEADER_EXTRA_FLAGS = ["-Wno-deprecated-declarations"]

# What a missing include looks like in g++'s output.
_MISSING_INCLUDE = re.compile(r"fatal error: ([^:\s]+): No such file or directory")


@dataclass(frozen=True)
class CompileResult:
    path: Path
    cuda: bool
    ok: bool
    seconds: float
    stderr: str

    @property
    def missing_header(self) -> str | None:
        """The header the wheel lacks, when that is why the file failed.

        A file that cannot compile because the wheel does not ship a header it
        needs (some GPU headers, generated protos of a patched .proto) is not
        a defect of the patch but a limit of what the wheel can prove; callers
        list it as such instead of hiding it.
        """
        if self.ok:
            return None
        match = _MISSING_INCLUDE.search(self.stderr)
        return match.group(1) if match else None


class CompileCheckError(RuntimeError):
    """The compile check cannot run at all (no compiler, no TensorFlow)."""


def wheel_compile_flags() -> list[str]:
    """tf.sysconfig.get_compile_flags(), with every -I turned into -isystem."""
    try:
        import tensorflow as tf  # noqa: PLC0415  (slow import, only when needed)
    except ImportError as e:
        raise CompileCheckError(
            "the compile check needs the tensorflow-cpu wheel: pip install tensorflow-cpu==2.21.0"
        ) from e
    flags: list[str] = []
    for flag in tf.sysconfig.get_compile_flags():
        if flag.startswith("-I"):
            flags += ["-isystem", flag[2:]]
        else:
            flags.append(flag)
    return flags


def python_binding_flags() -> list[str]:
    """Python's and pybind11's headers, which TensorFlow's Python bindings use.

    The wheel ships neither; without them a binding the patch adds would be
    reported as missing a header instead of being checked.
    """
    import sysconfig  # noqa: PLC0415

    flags = ["-isystem", sysconfig.get_paths()["include"]]
    try:
        import pybind11  # noqa: PLC0415
    except ImportError:
        return flags
    return [*flags, "-isystem", pybind11.get_include()]


def llvm_fallback_flags(wheel_flags: list[str]) -> list[str]:
    """The host's LLVM headers, searched last, when the wheel's headers need LLVM's.

    The 2.19 wheel's xla/stream_executor/gpu/tma_metadata.h (included by stream_executor.h)
    includes llvm/ADT/ArrayRef.h, which the wheel does not ship. With -idirafter the host's
    copy (llvm-NN-dev) is found only where the wheel has none, so it never shadows the wheel;
    without one the file is reported as missing a header, as before.
    """
    wheel_include = _wheel_include(wheel_flags)
    if wheel_include is None or (wheel_include / "llvm" / "ADT").is_dir():
        return []
    hosts = sorted(Path("/usr/lib").glob("llvm-*/include/llvm/ADT/ArrayRef.h"))
    return ["-idirafter", str(hosts[-1].parents[2])] if hosts else []


def compile_flags(
    patched_include: Path, cuda: bool, wheel_flags: list[str], own_include: Path | None = None
) -> list[str]:
    """The full command line after the compiler, before the file."""
    flags = ["-x", "c++", "-fsyntax-only", *WARNING_FLAGS]
    engine_include = (own_include or patched_include) / ENGINE_INCLUDE
    if engine_include.is_dir():
        # The engine is our code: judged with -Werror like the adapter.
        flags += ["-I", str(engine_include)]
    if own_include is not None:
        flags += ["-I", str(own_include)]
    flags += ["-isystem", str(patched_include)]
    flags += wheel_flags
    flags += python_binding_flags()
    flags += llvm_fallback_flags(wheel_flags)
    if cuda:
        flags += ["-DGOOGLE_CUDA=1"]
        if CUDA_INCLUDE.is_dir():
            flags += ["-isystem", str(CUDA_INCLUDE)]
    return flags


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if compiler is None:
        raise CompileCheckError("no C++ compiler: install g++ or set CXX")
    return compiler


def _wheel_include(wheel_flags: list[str]) -> Path | None:
    for i, flag in enumerate(wheel_flags[:-1]):
        if flag == "-isystem":
            return Path(wheel_flags[i + 1])
    return None


def is_tensorflow_header(path: Path, patched_include: Path, wheel_include: Path | None) -> bool:
    """True for a header of the wheel that the patch changes (not one it adds)."""
    if wheel_include is None:
        return False
    try:
        rel = Path(path).resolve().relative_to(Path(patched_include).resolve())
    except ValueError:
        return False
    return (wheel_include / rel).is_file()


def _compile_one(compiler: str, flags: list[str], path: Path, cuda: bool) -> CompileResult:
    start = time.monotonic()
    proc = subprocess.run(
        [compiler, *flags, str(path)], capture_output=True, text=True, check=False
    )
    return CompileResult(
        path=path,
        cuda=cuda,
        ok=proc.returncode == 0,
        seconds=time.monotonic() - start,
        stderr=proc.stderr,
    )


def compile_check(
    patched_include: Path,
    files: list[Path],
    cuda: bool,
    jobs: int = 1,
    own_include: Path | None = None,
) -> list[CompileResult]:
    """Compiles each file as its own translation unit; results in `files` order.

    Each compile takes about 10 s on a small machine; `jobs` runs that many at
    once (keep it at 1 or 2 on shared machines). `own_include`: see the module's
    docstring.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    patched_include = Path(patched_include)
    if not patched_include.is_dir():
        raise CompileCheckError(f"patched include tree not found: {patched_include}")
    if own_include is not None and not Path(own_include).is_dir():
        raise CompileCheckError(f"include tree of the patch's new files not found: {own_include}")
    for f in files:
        if not Path(f).is_file():
            raise CompileCheckError(f"file to compile not found: {f}")
    compiler = _compiler()
    wheel_flags = wheel_compile_flags()
    wheel_include = _wheel_include(wheel_flags)
    flags = compile_flags(patched_include, cuda, wheel_flags, own_include)

    def one(f: Path) -> CompileResult:
        extra = (
            TF_HEADER_EXTRA_FLAGS if is_tensorflow_header(f, patched_include, wheel_include) else []
        )
        return _compile_one(compiler, [*flags, *extra], Path(f), cuda)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, files))


def wheel_path(tf_path: str) -> str:
    """Where a file of the TensorFlow source tree sits in the wheel's include/."""
    return tf_path.removeprefix("third_party/xla/")


def build_overlay(version: str, root: Path, dest: Path) -> list[Path]:
    """Lays the patch's C++ half out under `dest` for compile_check.

    Copies the engine headers and sources and the new C++ files (wheel layout),
    and writes every header the diffs change, patched from the wheel's copy.
    Returns the files to compile: each .h/.cc the patch adds (the engine's
    included: it builds inside TensorFlow with the same flags) and each
    changed header.
    Raises CompileCheckError when a header diff does not apply to the wheel.
    """
    from tflms.patch.generate import added_files, diff_files  # noqa: PLC0415
    from tflms.patch.unidiff import apply_hunks, merge_file_diffs, parse_diff  # noqa: PLC0415

    wheel_include = _wheel_include(wheel_compile_flags())
    if wheel_include is None:
        raise CompileCheckError("tf.sysconfig.get_compile_flags() names no include directory")
    targets: list[Path] = []
    # What the patch adds, as it adds it (a tag's diffs on new files applied).
    for tf_path, content in added_files(version, root).items():
        if Path(tf_path).suffix not in (".h", ".cc"):
            continue
        out = dest / wheel_path(tf_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(content)
        targets.append(out)
    parsed = []
    for diff in diff_files(version, root):
        parsed += parse_diff(diff.read_text(), origin=diff.name)
    for fd in merge_file_diffs(parsed):
        rel = wheel_path(fd.path)
        original = wheel_include / rel
        if Path(rel).suffix != ".h" or not original.is_file():
            continue  # .cc and BUILD files are not in the wheel; new files are done above
        text, results = apply_hunks(original.read_text(), fd.hunks)
        failed = [r for r in results if not r.applied]
        if failed:
            raise CompileCheckError(
                f"{fd.path}: {len(failed)} hunk(s) do not apply to the wheel's {rel} "
                f"(first from {failed[0].hunk.origin}: {failed[0].message})"
            )
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        targets.append(out)
    return targets
