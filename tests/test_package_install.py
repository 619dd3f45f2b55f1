"""tflms installed from its own sdist and wheel, used from outside the checkout.

The sdist is built from a copy of the working tree, the wheel from the unpacked sdist (so the
sdist is known to hold everything the wheel needs), and the wheel goes into a fresh virtual
environment that sees neither the checkout nor this environment's packages. There the CLI
must find the patch and its sources that the package carries (tflms/_data.py): build-wheel's
dry run, `patch check`, `patch generate` and `patch apply` on a small TensorFlow-shaped git
tree made from the patch's own hunks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tflms.build.preflight import SUPPORTED_PYTHON
from tflms.patch import ENGINE_DIR, SUPPORTED_VERSIONS
from tflms.patch.generate import stale_reason
from tflms.patch.unidiff import parse_diff

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parents[1]
VERSION = "2.21.0"
TAG = f"v{VERSION}"
PATCH = f"patches/tensorflow_v{VERSION}_large_model_support.patch"
# Top-level paths of the checkout that a source distribution never holds.
NOT_COPIED = {".git", ".venv", "build", "dist", "out", ".cache", ".pytest_cache", ".ruff_cache",
              ".hypothesis"}  # fmt: skip


@dataclass
class Installed:
    src: Path  # the copy of the working tree the sdist was built from
    sdist: Path
    wheel: Path
    venv: Path
    site: Path  # the fresh environment's site-packages
    work: Path  # where the CLI runs: outside the checkout
    bin: Path  # PATH for the CLI: git only

    def tflms(self, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {"PATH": path or str(self.bin), "HOME": str(self.work), "LC_ALL": "C.UTF-8"}
        return subprocess.run(
            [str(self.venv / "bin" / "tflms"), *args],
            cwd=self.work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


def _copy_ignore(directory: str, names: list[str]) -> set[str]:
    drop = set(shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "*.o", "*.pyc")(
        directory, names))  # fmt: skip
    if Path(directory).resolve() == REPO:
        drop |= {n for n in names if n in NOT_COPIED or n.startswith("tflms-wheel-")}
    return drop


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    pytest.importorskip("pybind11")
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    root = tmp_path_factory.mktemp("package")
    src, dist = root / "src", root / "dist"
    shutil.copytree(REPO, src, ignore=_copy_ignore)
    # The sdist through the PEP 517 hook, as `python -m build --sdist --no-isolation` calls it.
    hook = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    name = _run([sys.executable, "-c", hook, str(dist)], cwd=src).strip().splitlines()[-1]
    sdist = dist / name
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+
            tar.extractall(root / "unpacked", filter="data")
        else:
            tar.extractall(root / "unpacked")
    (unpacked,) = (root / "unpacked").iterdir()
    # The wheel from the sdist: compiles the engine extension (about a minute on two cores).
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(unpacked)],
        cwd=root, timeout=900,
    )  # fmt: skip
    (wheel,) = dist.glob("tflms-*.whl")
    # A fresh environment without pip or this environment's packages; this pip installs into
    # it. The commands used below need none of tflms's dependencies, so none is installed.
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    _run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-deps", "--no-index", "-q", str(wheel)],
        cwd=root,
    )  # fmt: skip
    (site,) = (venv / "lib").glob("python3*/site-packages")
    work, bin_dir = root / "elsewhere", root / "bin"
    work.mkdir()
    bin_dir.mkdir()
    os.symlink(git, bin_dir / "git")
    yield Installed(src, sdist, wheel, venv, site, work, bin_dir)


def test_sdist_and_wheel_carry_the_patch_and_its_sources(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    with zipfile.ZipFile(installed.wheel) as zf:
        in_wheel = set(zf.namelist())
    for rel in (PATCH, "tf/common/COMMIT_MESSAGE", "core/include/tflms/engine.h",
                "core/src/engine.cc"):  # fmt: skip
        assert rel in in_sdist
        assert f"tflms/data/{rel}" in in_wheel
    diffs = {p.relative_to(installed.src).as_posix() for p in installed.src.glob("tf/*/diffs/*")}
    assert diffs and {f"tflms/data/{d}" for d in diffs} <= in_wheel
    for version in SUPPORTED_VERSIONS:  # every tag's patch and its own layer
        for rel in (f"patches/tensorflow_v{version}_large_model_support.patch",
                    f"tf/v{version}/PROVENANCE.md"):  # fmt: skip
            assert rel in in_sdist and f"tflms/data/{rel}" in in_wheel, rel
    assert "tflms/data/tf/v2.19.1/INHERITS" in in_wheel
    assert "tflms/build/wheel.py" in in_wheel and "tflms/_data.py" in in_wheel
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in in_wheel)


def test_installed_copy_reads_its_own_data(installed: Installed) -> None:
    code = "import tflms._data as d; print(d.__file__); print(d.checkout_root())"
    proc = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c", code],
        cwd=installed.work, env={"PATH": str(installed.bin)}, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    where, checkout = proc.stdout.splitlines()
    assert Path(where).is_relative_to(installed.site) and checkout == "None"
    shipped = installed.site / "tflms" / "data" / PATCH
    assert shipped.read_bytes() == (installed.src / PATCH).read_bytes()


def test_dry_run_finds_the_shipped_patch_and_fails_only_for_bazel(installed: Installed) -> None:
    limits = ["--min-disk-gb", "0", "--min-mem-gb", "0", "--no-progress", "--cpu"]
    proc = installed.tflms("build-wheel", "--tf-version", VERSION, "--dry-run", *limits)
    shipped = installed.site / "tflms" / "data" / PATCH
    lines = proc.stderr.splitlines()
    assert f"pre-flight patch: ok: {shipped}" in lines, proc.stderr
    stopped = sorted({ln.split(":")[0].split()[1] for ln in lines if "would stop here" in ln})
    python_ok = sys.version_info[:2] in SUPPORTED_PYTHON
    assert stopped == (["bazelisk"] if python_ok else ["bazelisk", "python"]), proc.stderr
    assert proc.returncode == 1
    assert f"+ git clone --depth 1 --branch {TAG}" in proc.stdout
    assert "would stop a real run (bazelisk" in lines[-1]

    # With a bazelisk on PATH every check passes (a dry run never runs it) and the exit is 0.
    (installed.work / "tools").mkdir(exist_ok=True)
    bazelisk = installed.work / "tools" / "bazelisk"
    bazelisk.write_text("#!/bin/sh\nexit 3\n")
    bazelisk.chmod(0o755)
    path = f"{installed.work / 'tools'}:{installed.bin}"
    proc = installed.tflms("build-wheel", "--tf-version", VERSION, "--dry-run", *limits, path=path)
    assert proc.returncode == (0 if python_ok else 1), proc.stderr
    assert "bazelisk build" in proc.stdout

    # An unknown version: the patch check stops it and names the tags that have a patch.
    proc = installed.tflms("build-wheel", "--tf-version", "2.99.0", "--dry-run", *limits, path=path)
    assert proc.returncode == 1
    assert "pre-flight patch: a real run would stop here: no LMS patch for TensorFlow 2.99.0" in (
        proc.stderr
    )
    tags = ", ".join(f"v{v}" for v in SUPPORTED_VERSIONS)
    assert f"tflms has patches for these tags: {tags}." in proc.stderr

    # Every older tag finds its own shipped patch too.
    for version in SUPPORTED_VERSIONS[:-1]:
        proc = installed.tflms("build-wheel", "--tf-version", version, "--dry-run", *limits)
        shipped = installed.site / "tflms" / "data" / "patches"
        shipped = shipped / f"tensorflow_v{version}_large_model_support.patch"
        assert f"pre-flight patch: ok: {shipped}" in proc.stderr.splitlines(), proc.stderr


def test_patch_check_and_generate_use_the_shipped_sources(installed: Installed) -> None:
    # The shipped patch and sources are those of the tree the sdist was built from, which
    # someone may be editing: the installed CLI must judge them as the checkout's code does.
    try:
        reason = stale_reason(VERSION, installed.src)
        verdict = "fresh" if reason is None else "stale"
    except ValueError:  # DiffError and friends: a diff being edited does not parse
        verdict = "broken"
    proc = installed.tflms("patch", "check", "--tf-version", VERSION)
    if verdict == "fresh":
        assert proc.returncode == 0 and "is up to date" in proc.stdout, proc.stderr
        for version in SUPPORTED_VERSIONS[:-1]:  # the shipped layers make every tag's patch
            if stale_reason(version, installed.src) is None:
                proc = installed.tflms("patch", "check", "--tf-version", version)
                assert proc.returncode == 0 and "is up to date" in proc.stdout, proc.stderr
    else:
        assert proc.returncode != 0
        assert verdict == "broken" or "is stale" in proc.stderr, proc.stderr

    proc = installed.tflms("patch", "generate", "--tf-version", VERSION)
    assert proc.returncode == 1 and "pass --output FILE" in proc.stderr
    proc = installed.tflms("patch", "generate", "--tf-version", VERSION, "--output", "lms.patch")
    if verdict == "broken":
        assert proc.returncode != 0
        return
    assert proc.returncode == 0, proc.stderr
    generated = (installed.work / "lms.patch").read_text()
    shipped = (installed.site / "tflms" / "data" / PATCH).read_text()
    assert (generated == shipped) == (verdict == "fresh")


def _make_tree(patch: Path, tree: Path) -> None:
    """A git tree at TAG holding, for each file the patch changes, the lines its hunks expect.

    Each hunk's old lines are placed at the hunk's own line number with filler in between and
    nothing after the last hunk, so `git apply` finds every hunk where the hunk says it is.
    """
    text = patch.read_text()
    sections = re.split(r"^(?=diff --git )", text, flags=re.M)[1:]
    changed = "".join(s for s in sections if "\n--- a/" in s)
    for fd in parse_diff(changed, origin=patch.name):
        lines: list[str] = []
        for hunk in fd.hunks:
            start = max(hunk.old_start, 1) if hunk.old_len else hunk.old_start + 1
            assert len(lines) < start, f"{fd.path}: overlapping hunks"
            lines += [f"filler {n}" for n in range(len(lines) + 1, start)]
            lines += hunk.old_lines
        dest = tree / fd.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("\n".join(lines) + "\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tree),
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "TF"], ["tag", TAG]):
        subprocess.run(["git", *argv], cwd=tree, env=env, check=True, capture_output=True)


def test_patch_apply_uses_the_shipped_patch(installed: Installed) -> None:
    tree = installed.work / "tensorflow"
    _make_tree(installed.site / "tflms" / "data" / PATCH, tree)

    def git(*args: str) -> str:
        return _run(["git", *args], cwd=tree).strip()

    tag_commit = git("rev-parse", TAG)
    proc = installed.tflms("patch", "apply", "--tf-source", str(tree), "--tf-version", VERSION)
    assert proc.returncode == 0, proc.stderr
    assert f"applied Large Model Support to {tree}" in proc.stdout
    assert git("rev-parse", "HEAD~1") == tag_commit
    assert git("log", "-1", "--format=%s").startswith("Add Large Model Support")
    assert git("status", "--porcelain") == ""
    assert (tree / ENGINE_DIR / "src" / "engine.cc").is_file()
    proc = installed.tflms("patch", "apply", "--tf-source", str(tree), "--tf-version", VERSION)
    assert proc.returncode == 0 and "already has the patch" in proc.stdout


def test_installed_copy_verifies_the_newest_patch_against_the_wheel(installed: Installed) -> None:
    # The checks that need TensorFlow (Python half, API goldens): TensorFlow is
    # borrowed from this environment through a path entry, the tflms that runs is
    # the installed one. Compiles are left to `make verify` (minutes).
    tf = pytest.importorskip("tensorflow")
    borrowed = installed.site / "borrowed_tensorflow.pth"
    borrowed.write_text(str(Path(tf.__file__).resolve().parents[1]) + "\n")
    try:
        env = {"PATH": str(installed.bin), "HOME": str(installed.work), "LC_ALL": "C.UTF-8"}
        proc = subprocess.run(
            [str(installed.venv / "bin" / "tflms"), "verify", "--tf-version", VERSION,
             "--no-compile"],
            cwd=installed.work, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        borrowed.unlink()
    out = proc.stdout + proc.stderr
    assert "failing: 0" in out, out[-3000:]
    passed = re.search(r"python checks: (\d+)/(\d+)", out)
    assert passed and passed[1] == passed[2] and int(passed[1]) >= 12, out[-3000:]
    assert str(installed.site) in _run(
        [str(installed.venv / "bin" / "python"), "-c", "import tflms; print(tflms.__file__)"],
        cwd=installed.work,
    )
