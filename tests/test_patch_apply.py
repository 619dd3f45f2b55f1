"""`tflms patch apply` on temporary TensorFlow-like git checkouts.

The checkouts hold the wheel's copies of the Python files the patch changes,
and the patch is the real one restricted to those files and the new Python
files, so git am runs on real TensorFlow text.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tflms.patch.apply import PatchAlreadyApplied, PatchApplyError, apply_patch
from tflms.patch.generate import PatchParts, collect, render
from tflms.patch.wheel import find_wheel

VERSION = "2.21.0"
TAG = f"v{VERSION}"
CHANGED = ("tensorflow/python/eager/context.py", "tensorflow/python/framework/config.py")

pytestmark = pytest.mark.tf

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=tree, env=GIT_ENV, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def patch_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    parts = collect(VERSION)
    keep = [
        f
        for f in parts.files
        if f.path in CHANGED or (f.new_file and f.path.startswith("tensorflow/python/"))
    ]
    path = tmp_path_factory.mktemp("patch") / "lms.patch"
    path.write_text(render(PatchParts(parts.subject, parts.body, keep)))
    return path


def make_checkout(root: Path, tag: str = TAG) -> Path:
    wheel = find_wheel(VERSION)
    tree = root / "tensorflow"
    for rel in CHANGED:
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((wheel / rel.removeprefix("tensorflow/")).read_bytes())
    (tree / "README.md").write_text("TensorFlow\n")
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "commit", "-q", "-m", "TensorFlow 2.21.0")
    git(tree, "tag", tag)
    return tree


def snapshot(tree: Path) -> tuple[str, str, dict[str, bytes]]:
    files = {
        p.relative_to(tree).as_posix(): p.read_bytes()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and ".git" not in p.parts
    }
    return git(tree, "rev-parse", "HEAD"), git(tree, "status", "--porcelain"), files


def test_applies_as_one_commit_on_the_tag_then_reports_already_applied(
    tmp_path: Path, patch_file: Path
) -> None:
    tree = make_checkout(tmp_path)
    tag_commit = git(tree, "rev-parse", TAG)
    apply_patch(tree, VERSION, patch_file)
    assert git(tree, "rev-parse", "HEAD~1") == tag_commit
    assert git(tree, "log", "-1", "--format=%s").startswith("Add Large Model Support")
    assert git(tree, "status", "--porcelain") == ""
    assert "def set_lms_enabled(enable):" in (tree / CHANGED[1]).read_text()
    assert (tree / "tensorflow/python/lms/lms_stats_wrapper.cc").is_file()
    before = snapshot(tree)
    with pytest.raises(PatchAlreadyApplied, match="already has the patch"):
        apply_patch(tree, VERSION, patch_file)
    assert snapshot(tree) == before


def test_wrong_tag_is_refused(tmp_path: Path, patch_file: Path) -> None:
    tree = make_checkout(tmp_path, tag="v2.20.0")
    before = snapshot(tree)
    with pytest.raises(PatchApplyError, match="has no tag v2.21.0"):
        apply_patch(tree, VERSION, patch_file)
    git(tree, "tag", TAG)
    (tree / "README.md").write_text("TensorFlow, later\n")
    git(tree, "commit", "-q", "-am", "a later commit")
    before = snapshot(tree)
    with pytest.raises(PatchApplyError, match="not at v2.21.0.*git checkout v2.21.0"):
        apply_patch(tree, VERSION, patch_file)
    assert snapshot(tree) == before


def test_dirty_tree_is_refused(tmp_path: Path, patch_file: Path) -> None:
    tree = make_checkout(tmp_path)
    (tree / "README.md").write_text("local edit\n")
    before = snapshot(tree)
    with pytest.raises(PatchApplyError, match="(?s)uncommitted changes.*README.md"):
        apply_patch(tree, VERSION, patch_file)
    assert snapshot(tree) == before


def test_patch_that_would_half_apply_leaves_the_tree_unchanged(
    tmp_path: Path, patch_file: Path
) -> None:
    tree = make_checkout(tmp_path)
    # Move the tag to a commit where config.py differs where the patch touches
    # it: context.py would still apply, config.py would not.
    config = tree / CHANGED[1]
    text = config.read_text()
    anchor = "  context.context().set_memory_growth(device, enable)\n"
    assert anchor in text
    config.write_text(text.replace(anchor, "  context.context().set_memory_growth(dev, enable)\n"))
    git(tree, "commit", "-q", "-am", "diverge")
    git(tree, "tag", "-f", TAG)
    before = snapshot(tree)
    with pytest.raises(PatchApplyError, match="(?s)does not apply.*config.py"):
        apply_patch(tree, VERSION, patch_file)
    assert snapshot(tree) == before
    assert not (tree / "tensorflow/python/lms").exists()


def test_not_a_checkout_and_missing_patch(tmp_path: Path, patch_file: Path) -> None:
    with pytest.raises(PatchApplyError, match="not a git checkout"):
        apply_patch(tmp_path, VERSION, patch_file)
    with pytest.raises(PatchApplyError, match="not found"):
        apply_patch(tmp_path, VERSION, tmp_path / "missing.patch")
    with pytest.raises(ValueError, match="not supported"):
        apply_patch(tmp_path, "2.18.0", patch_file)


def test_git_am_failing_midway_is_rolled_back(tmp_path: Path, patch_file: Path) -> None:
    tree = make_checkout(tmp_path)
    # pre-applypatch runs after git am has changed the work tree and before it
    # commits: failing there is a real half-applied state that must be undone.
    hook = tree / ".git" / "hooks" / "pre-applypatch"
    hook.write_text("#!/bin/sh\nexit 1\n")
    hook.chmod(0o755)
    before = snapshot(tree)
    with pytest.raises(PatchApplyError, match="git am failed.*the tree was restored"):
        apply_patch(tree, VERSION, patch_file)
    assert snapshot(tree) == before
    assert not (tree / ".git" / "rebase-apply").exists()


def test_cli_reports_errors_and_success(tmp_path: Path, patch_file: Path) -> None:
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tflms", "patch", "apply", *args],
            capture_output=True,
            text=True,
            check=False,
            env=GIT_ENV,
        )

    bad = cli("--tf-source", str(tmp_path), "--patch", str(patch_file))
    assert bad.returncode == 1 and "error:" in bad.stderr and "not a git checkout" in bad.stderr
    tree = make_checkout(tmp_path)
    ok = cli("--tf-source", str(tree), "--patch", str(patch_file))
    assert ok.returncode == 0 and "applied Large Model Support" in ok.stdout, ok.stderr
    again = cli("--tf-source", str(tree), "--patch", str(patch_file))
    assert again.returncode == 0 and "already has the patch" in again.stdout
