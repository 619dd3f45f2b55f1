"""`tflms verify`: checks the patch against the official tensorflow-cpu wheel.

  a) every hunk on a file the wheel carries (headers under include/, Python
     sources) applies cleanly to the wheel's copy;
  b) every C++ file the patch adds, and every header it changes, compiles
     with warnings as errors against the patched headers (compile_check.py),
     with GOOGLE_CUDA defined and not;
  c) the Python half runs in a patched copy of the wheel's package
     (python_half_check.py, plus the patch's own Python tests);
  g) the API golden hunks turn goldens regenerated from the wheel into the
     goldens regenerated from the patched copy (goldens.py).
What none of these can reach (.cc and BUILD files the wheel lacks) is listed
as not checked. report.py turns the result into docs/verification.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tflms.patch.generate import collect, stale_reason
from tflms.patch.goldens import GOLDEN_DIR
from tflms.patch.pycopy import PyCopyError, build_patched_package, subprocess_env
from tflms.patch.unidiff import FileDiff, apply_hunks, render_file_diff
from tflms.patch.wheel import find_wheel, include_rel, installed_tf_version, wheel_file

if TYPE_CHECKING:
    from tflms.patch.compile_check import CompileResult

log = logging.getLogger("tflms.verify")

PASS, FAIL, NA, SKIP = "pass", "fail", "n/a", "not run"
CXX_SUFFIXES = (".h", ".cc", ".hpp", ".cpp", ".inc")


@dataclass
class HunkCheck:
    header: str
    origin: str
    status: str  # pass | fail | n/a
    offset: int = 0


@dataclass
class FileCheck:
    path: str
    new_file: bool
    added: int
    removed: int
    a: str = NA
    b: str = NA
    c: str = NA
    g: str = NA
    notes: list[str] = field(default_factory=list)
    hunks: list[HunkCheck] = field(default_factory=list)

    @property
    def covered(self) -> bool:
        return PASS in (self.a, self.b, self.c, self.g)

    @property
    def failed(self) -> bool:
        return FAIL in (self.a, self.b, self.c, self.g)


@dataclass
class VerifyResult:
    version: str
    wheel: str
    files: list[FileCheck]
    stale: str | None
    python_checks: list[dict[str, object]] = field(default_factory=list)
    python_tests: list[dict[str, object]] = field(default_factory=list)
    compile_summary: list[dict[str, object]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # steps that could not run
    timings: dict[str, float] = field(default_factory=dict)
    proto_fields: list[str] = field(default_factory=list)
    api_lines: list[str] = field(default_factory=list)
    # .diff file -> its leading comment, which says how its context was established
    diff_notes: dict[str, str] = field(default_factory=dict)
    wheel_version: str = ""  # the TensorFlow checked against (the tag's, or a nightly's)
    layers: list[str] = field(default_factory=list)  # tf/ layers the patch is made of
    patched_goldens: dict[str, str] = field(default_factory=dict)  # from c)'s run

    @property
    def ok(self) -> bool:
        return (
            self.stale is None
            and not self.problems
            and not any(f.failed for f in self.files)
            and all(c.get("ok") for c in self.python_checks)
            and all(t.get("ok") for t in self.python_tests)
        )


def _timed(result: VerifyResult, name: str) -> Callable[[], None]:
    start = time.monotonic()

    def done() -> None:
        result.timings[name] = round(time.monotonic() - start, 1)
        log.info("%s: %.1f s", name, result.timings[name])

    return done


def _git_apply_check(fd: FileDiff, original: Path, work: Path) -> str | None:
    """`git apply --check` of one file's diff against the wheel's copy."""
    if shutil.which("git") is None:
        return None
    tree = work / "git-apply"
    if tree.exists():
        shutil.rmtree(tree)
    target = tree / fd.path
    target.parent.mkdir(parents=True)
    shutil.copyfile(original, target)
    patch = work / "one.diff"
    patch.write_text(render_file_diff(fd))
    proc = subprocess.run(
        ["git", "apply", "--check", str(patch)],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    return None if proc.returncode == 0 else (proc.stderr.strip() or "git apply failed")


def check_hunks(
    files: list[FileDiff], checks: dict[str, FileCheck], wheel_tf: Path, work: Path
) -> dict[str, str]:
    """a): applies hunks to the wheel's copies; returns path -> patched text."""
    patched: dict[str, str] = {}
    for fd in files:
        if fd.new_file:
            continue
        fc = checks[fd.path]
        original = wheel_file(wheel_tf, fd.path)
        if original is None:
            fc.hunks = [HunkCheck(h.header(), h.origin, NA) for h in fd.hunks]
            continue
        text, results = apply_hunks(original.read_text(), fd.hunks)
        fc.hunks = [
            HunkCheck(r.hunk.header(), r.hunk.origin, PASS if r.applied else FAIL, r.offset)
            for r in results
        ]
        git_error = _git_apply_check(fd, original, work)
        if git_error:
            fc.notes.append(f"git apply --check: {git_error}")
        ok = all(r.applied for r in results) and git_error is None
        fc.a = PASS if ok else FAIL
        rel = original.relative_to(wheel_tf).as_posix()
        fc.notes.append(f"applied to the wheel's {rel}")
        if ok:
            patched[fd.path] = text
    return patched


def _overlay(
    files: list[FileDiff], patched: dict[str, str], dest: Path, own: Path
) -> dict[str, Path]:
    """Writes the C++ files to compile into two include trees; path -> file.

    TensorFlow's headers the patch changes go to `dest` (searched as a system
    directory, as the wheel's own headers are); the files the patch adds go
    to `own` (searched with -I), so that their warnings count in every
    translation unit that includes them.
    """
    for tree in (dest, own):
        if tree.exists():
            shutil.rmtree(tree)
        tree.mkdir(parents=True)
    out: dict[str, Path] = {}
    for fd in files:
        if not fd.path.endswith(CXX_SUFFIXES):
            continue
        text = fd.content if fd.new_file else patched.get(fd.path)
        if text is None:
            continue
        target = (own if fd.new_file else dest) / include_rel(fd.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        out[fd.path] = target
    _link_python_headers(dest)
    return out


def headers_judged_by_their_source(files: list[FileDiff]) -> dict[str, str]:
    """New headers whose new .cc beside them includes them first: header -> .cc.

    That .cc's compile proves the header self-contained (nothing precedes it) and,
    the patch's new files being searched with -I, counts the header's warnings,
    in both configurations; compiling the header alone as well would only repeat
    a TensorFlow-heavy translation unit (about 10 s each on 2 cores).
    """
    new = {fd.path: fd for fd in files if fd.new_file}
    judged: dict[str, str] = {}
    for path in new:
        if not path.endswith(".h"):
            continue
        source = new.get(path[: -len(".h")] + ".cc")
        if source is None:
            continue
        # The first directive of all: one under an #if might not be compiled in both
        # configurations.
        first = next(
            (ln.strip() for ln in source.content.splitlines() if ln.lstrip().startswith("#")), ""
        )
        # A quoted include is looked for beside the includer first, so the bare name counts.
        if first in (f'#include "{include_rel(path)}"', f'#include "{Path(path).name}"'):
            judged[path] = source.path
    return judged


def _compile_plan(
    files: list[FileDiff], patched: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """b)'s work: the files compiled alone (each in both configurations), in `files`
    order, and the new headers judged by their own .cc instead (header -> .cc)."""
    judged = headers_judged_by_their_source(files)
    alone = [
        fd.path
        for fd in files
        if fd.path.endswith(CXX_SUFFIXES)
        and (fd.new_file or fd.path in patched)
        and fd.path not in judged
    ]
    return alone, judged


def _link_python_headers(dest: Path) -> None:
    """Makes pybind11 and Python.h visible to the pybind wrapper of the patch.

    TensorFlow builds its pybind modules with both on the include path; the
    overlay is on compile_check's include path, so links there suffice.
    """
    import sysconfig

    try:
        import pybind11
    except ImportError:
        return
    (dest / "pybind11").symlink_to(Path(pybind11.get_include()) / "pybind11")
    py_include = Path(sysconfig.get_paths()["include"])
    for entry in py_include.iterdir():
        link = dest / entry.name
        if not link.exists():
            link.symlink_to(entry)


def _is_engine_file(path: Path) -> bool:
    """The LMS engine's own sources and headers, which compile in about a second."""
    return "/lms/core/" in path.as_posix()


def check_compile(
    files: list[FileDiff],
    checks: dict[str, FileCheck],
    patched: dict[str, str],
    work: Path,
    jobs: int,
    result: VerifyResult,
    tick: Callable[[str], None] = lambda _msg: None,
) -> None:
    """b): compiles new C++ files and changed headers, with and without CUDA.

    A new header its own .cc includes first is judged by that .cc's compiles
    (headers_judged_by_their_source).

    All compiles of both configurations share one pool of `jobs`, the adapter's files
    first: each takes 10-15 s against about 1 s for an engine file, and running the two
    configurations one after the other, `jobs` files at a time, left a core idle behind
    every slow file (about a minute of the check's five on 2 cores).
    """
    overlay = _overlay(files, patched, work / "include", work / "new")
    for tf_path in overlay:
        checks[tf_path].b = SKIP
    alone, judged_by = _compile_plan(files, patched)
    targets = [(t, overlay[t]) for t in alone]
    if not targets:
        return
    try:
        from tflms.patch.compile_check import compile_check
    except ImportError as e:
        result.problems.append(f"b) not run: compile_check is unavailable ({e})")
        return
    paths = [p for _, p in targets]
    by_path = {p: t for t, p in targets}
    outcome: dict[str, list[str]] = {t: [] for t, _ in targets}
    label = {False: "no GOOGLE_CUDA", True: "GOOGLE_CUDA"}
    order = [(cuda, path) for cuda in (False, True) for path in paths]
    done: dict[tuple[bool, Path], CompileResult] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = {
            pool.submit(
                compile_check, work / "include", [path], cuda=cuda, own_include=work / "new"
            ): (cuda, path)
            for cuda, path in sorted(order, key=lambda item: _is_engine_file(item[1]))
        }
        for future in as_completed(pending):
            cuda, path = pending[future]
            try:
                done[cuda, path] = future.result()[0]
            except Exception as e:  # noqa: BLE001 - reported, verification goes on
                pool.shutdown(cancel_futures=True)
                result.problems.append(f"b) compile_check failed to run ({label[cuda]}): {e}")
                return
            tick(f"b) {label[cuda]}: {path.name}")
    for cuda, path in order:
        r = done[cuda, path]
        tf_path = by_path[r.path]
        fc = checks[tf_path]
        # A header the wheel (or this machine) lacks is a limit of what can be
        # proved here, not a defect of the patch: listed as not run, not failed.
        missing = r.missing_header
        outcome[tf_path].append(PASS if r.ok else SKIP if missing else FAIL)
        result.compile_summary.append(
            {"path": tf_path, "cuda": cuda, "ok": r.ok, "seconds": round(r.seconds, 1)}
        )
        if not r.ok:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr[:300])
            fc.notes.append(
                f"{label[cuda]}: wheel lacks header {missing}"
                if missing
                else f"{label[cuda]}: {first.strip()}"
            )
    for tf_path, states in outcome.items():
        if FAIL in states or not states:
            checks[tf_path].b = FAIL
        else:
            checks[tf_path].b = SKIP if SKIP in states else PASS
    for header, source in judged_by.items():
        if source in outcome:
            checks[header].b = checks[source].b
            checks[header].notes.append(
                f"compiled as the first include of {Path(source).name}, warnings counted"
            )


def _run_json(cmd: list[str], env: dict[str, str], timeout: int) -> dict[str, object]:
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[-1:])} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def check_python(
    files: list[FileDiff],
    checks: dict[str, FileCheck],
    wheel_tf: Path,
    work: Path,
    result: VerifyResult,
) -> Path | None:
    """c): the Python half in a patched copy of the wheel's package."""
    try:
        package = build_patched_package(wheel_tf, work / "python", files)
    except PyCopyError as e:
        result.problems.append(f"c) patched copy could not be built: {e}")
        return None
    result.proto_fields = package.proto_fields
    result.api_lines = package.api_lines
    env = subprocess_env(package.site)
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], repo])
    script = Path(__file__).with_name("python_half_check.py")
    try:
        out = _run_json([sys.executable, str(script)], env, timeout=300)
    except Exception as e:  # noqa: BLE001
        result.problems.append(f"c) Python checks did not run: {e}")
        return package.site
    result.python_checks = list(out["checks"])  # type: ignore[arg-type]
    goldens = out.get("goldens") or {}
    result.patched_goldens = {str(k): str(v) for k, v in dict(goldens).items()}  # type: ignore[call-overload]
    all_ok = all(c["ok"] for c in result.python_checks)
    tests = [fd.path for fd in files if fd.new_file and fd.path.endswith("_test.py")]
    for test in tests:
        path = package.site / test
        proc = subprocess.run(
            [sys.executable, str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        tail = [ln for ln in proc.stderr.splitlines() if ln.startswith(("Ran ", "OK", "FAILED"))]
        result.python_tests.append(
            {
                "path": test,
                "ok": proc.returncode == 0,
                "summary": " ".join(tail)[-300:],
                "stderr": "" if proc.returncode == 0 else proc.stderr[-3000:],
            }
        )
    tests_ok = all(t["ok"] for t in result.python_tests)
    for fd in files:
        fc = checks[fd.path]
        if fd.path in package.patched or fd.path == "tensorflow/core/protobuf/config.proto":
            if fd.path.endswith("_test.py"):
                ran = next((t for t in result.python_tests if t["path"] == fd.path), None)
                fc.c = PASS if ran and ran["ok"] else FAIL
            else:
                fc.c = PASS if all_ok and tests_ok else FAIL
    if "tensorflow/core/protobuf/config.proto" in checks:
        checks["tensorflow/core/protobuf/config.proto"].notes.append(
            "fields added to the wheel's config_pb2 descriptor: " + ", ".join(package.proto_fields)
        )
    return package.site


def render_goldens(site: Path | None) -> dict[str, str]:
    env = (
        subprocess_env(site)
        if site
        else {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), repo) if p)
    out = _run_json([sys.executable, "-m", "tflms.patch.goldens"], env, timeout=300)
    return {k: str(v) for k, v in out.items()}


def check_goldens(
    files: list[FileDiff], checks: dict[str, FileCheck], site: Path | None, result: VerifyResult
) -> None:
    """g): golden hunks against goldens regenerated before and after the patch."""
    golden_diffs = [fd for fd in files if fd.path.startswith(GOLDEN_DIR + "/")]
    if not golden_diffs:
        return
    if site is None:
        result.problems.append("g) not run: no patched Python copy")
        return
    try:
        base = render_goldens(None)
        after = result.patched_goldens or render_goldens(site)
    except Exception as e:  # noqa: BLE001
        result.problems.append(f"g) goldens could not be regenerated: {e}")
        return
    for fd in golden_diffs:
        fc = checks[fd.path]
        if fd.path not in base:
            fc.g = FAIL
            fc.notes.append("no regeneration rule for this golden (tflms/patch/goldens.py)")
            continue
        text, results = apply_hunks(base[fd.path], fd.hunks)
        fc.hunks = [
            HunkCheck(r.hunk.header(), r.hunk.origin, PASS if r.applied else FAIL, r.offset)
            for r in results
        ]
        same = text == after[fd.path]
        fc.g = PASS if all(r.applied for r in results) and same else FAIL
        if not same:
            fc.notes.append("patched golden differs from the one regenerated after the patch")


def golden_diff_text(base: dict[str, str], after: dict[str, str]) -> str:
    """The unified diff of regenerated goldens (to write the golden .diff)."""
    import difflib

    chunks = []
    for path in sorted(p for p in base if p.startswith(GOLDEN_DIR)):
        if base[path] == after.get(path):
            continue
        chunks += difflib.unified_diff(
            base[path].splitlines(keepends=True),
            after[path].splitlines(keepends=True),
            f"a/{path}",
            f"b/{path}",
            n=3,
        )
    return "".join(chunks)


def diff_notes(version: str, root: Path | None = None) -> dict[str, str]:
    """The leading '#' comment of each .diff the tag's patch uses, by origin."""
    from tflms.patch import repo_root
    from tflms.patch.generate import diff_files

    root = root or repo_root()
    notes: dict[str, str] = {}
    for diff in diff_files(version, root):
        comment = []
        for line in diff.read_text().splitlines():
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("#").strip())
        notes[diff.relative_to(root).as_posix()] = " ".join(c for c in comment if c)
    return notes


def run_verify(
    version: str,
    root: Path | None = None,
    work: Path | None = None,
    jobs: int = 1,
    compile_cpp: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> VerifyResult:
    report = progress or (lambda _msg, _done, _total: None)
    units = {"done": 0, "total": 3}

    def step(message: str, add_total: int = 0) -> None:
        units["total"] += add_total
        report(message, units["done"], units["total"])

    def tick(message: str) -> None:
        units["done"] += 1
        report(message, units["done"], units["total"])

    parts = collect(version, root)
    wheel_tf = find_wheel(version)
    result = VerifyResult(version, str(wheel_tf), [], stale_reason(version, root))
    checks = {fd.path: FileCheck(fd.path, fd.new_file, fd.added, fd.removed) for fd in parts.files}
    result.files = list(checks.values())
    result.diff_notes = diff_notes(version, root)
    result.wheel_version = installed_tf_version() or "?"
    from tflms.patch import repo_root, tf_layers

    base = root or repo_root()
    result.layers = [
        layer.relative_to(base).as_posix() + "/"
        for layer in tf_layers(version, base)
        if layer.is_dir() and any((layer / sub).exists() for sub in ("files", "diffs"))
    ]
    own_tmp = work is None
    work = Path(tempfile.mkdtemp(prefix="tflms-verify-")) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    try:
        step("a) hunks against the wheel")
        done = _timed(result, "a) hunks")
        patched = check_hunks(parts.files, checks, wheel_tf, work)
        done()
        tick("a) done")
        if compile_cpp:
            alone, _ = _compile_plan(parts.files, patched)
            step("b) compiling C++ against the patched headers", add_total=2 * len(alone))
            done = _timed(result, "b) compile")
            check_compile(parts.files, checks, patched, work, jobs, result, tick)
            done()
        else:
            for fc in result.files:
                if fc.path.endswith(CXX_SUFFIXES) and (fc.new_file or fc.path in patched):
                    fc.b = SKIP
            result.problems.append("b) skipped (--no-compile)")
        step("c) Python half in a patched copy")
        done = _timed(result, "c) python")
        site = check_python(parts.files, checks, wheel_tf, work, result)
        done()
        tick("c) done")
        step("g) API goldens")
        done = _timed(result, "g) goldens")
        check_goldens(parts.files, checks, site, result)
        done()
        tick("g) done")
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)
    return result
