"""`tflms patch apply`: applies the patch to a user's TensorFlow checkout.

The checkout must be a git work tree at the release tag (v<version>), with no
changes to tracked files and no git operation in progress. The patch is first
checked with `git apply --check`, then applied with `git am`, so the result is
one commit on top of the tag. If anything fails the tree is left exactly as
it was: `git am --abort` restores HEAD and the index, and the pre-check means
that is rarely needed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tflms.patch import check_version, patch_path
from tflms.patch.generate import AUTHOR


class PatchApplyError(RuntimeError):
    """The patch was not applied; the message says why and what to do."""


class PatchAlreadyApplied(PatchApplyError):
    """HEAD already is the patch commit on top of the tag."""


def _git(
    tree: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=tree, capture_output=True, text=True, check=False, env=env
    )


def _out(tree: Path, *args: str) -> str | None:
    proc = _git(tree, *args)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _patch_subject(patch: Path) -> str:
    for line in patch.read_text().splitlines():
        if line.startswith("Subject: "):
            return line[len("Subject: ") :].removeprefix("[PATCH] ").strip()
    raise PatchApplyError(f"{patch} has no Subject line; is it a git format-patch file?")


def _check_tree(tf_source: Path, tag: str, subject: str) -> None:
    if not tf_source.is_dir():
        raise PatchApplyError(f"{tf_source} is not a directory; give the TensorFlow checkout")
    top = _out(tf_source, "rev-parse", "--show-toplevel")
    if top is None:
        raise PatchApplyError(
            f"{tf_source} is not a git checkout; clone TensorFlow and check out {tag}: "
            f"git clone --branch {tag} https://github.com/tensorflow/tensorflow"
        )
    if Path(top).resolve() != tf_source.resolve():
        raise PatchApplyError(f"{tf_source} is inside the git tree {top}; give its top directory")
    git_dir = Path(_out(tf_source, "rev-parse", "--absolute-git-dir") or "")
    for busy in ("rebase-apply", "rebase-merge", "MERGE_HEAD", "CHERRY_PICK_HEAD"):
        if (git_dir / busy).exists():
            raise PatchApplyError(
                f"a git operation is in progress in {tf_source} ({busy}); "
                "finish or abort it (git am --abort, git rebase --abort, ...) first"
            )
    tag_commit = _out(tf_source, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}")
    if tag_commit is None:
        raise PatchApplyError(
            f"{tf_source} has no tag {tag}; fetch it (git fetch origin tag {tag}) "
            f"and check it out (git checkout {tag})"
        )
    head = _out(tf_source, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    if head != tag_commit:
        parent = _out(tf_source, "rev-parse", "--verify", "--quiet", "HEAD~1^{commit}")
        head_subject = _out(tf_source, "log", "-1", "--format=%s")
        if parent == tag_commit and head_subject == subject:
            raise PatchAlreadyApplied(
                f"{tf_source} already has the patch: HEAD ({head[:12] if head else '?'}) is "
                f"'{subject}' on top of {tag}; nothing to do"
            )
        described = _out(tf_source, "describe", "--tags", "--always", "HEAD") or head
        raise PatchApplyError(
            f"{tf_source} is at {described}, not at {tag}; the patch is for {tag} only: "
            f"git checkout {tag}"
        )
    status = _out(tf_source, "status", "--porcelain", "--untracked-files=no")
    if status:
        changed = status.splitlines()
        shown = "\n  ".join(changed[:10]) + ("\n  ..." if len(changed) > 10 else "")
        raise PatchApplyError(
            f"{tf_source} has uncommitted changes to tracked files:\n  {shown}\n"
            "commit or stash them (git stash) first, so the patch applies to pristine sources"
        )


def _identity_env(tf_source: Path) -> dict[str, str]:
    """git am needs a committer; fall back to the patch's author if none is set."""
    env = dict(os.environ)
    name, _, email = AUTHOR.partition(" <")
    if not _out(tf_source, "config", "user.name"):
        env.setdefault("GIT_COMMITTER_NAME", name)
    if not _out(tf_source, "config", "user.email"):
        env.setdefault("GIT_COMMITTER_EMAIL", email.rstrip(">"))
    return env


def apply_patch(tf_source: Path, tf_version: str, patch_file: Path | None = None) -> None:
    """Applies the LMS patch for `tf_version` to the checkout at `tf_source`.

    Raises PatchApplyError (PatchAlreadyApplied if it is there already); the
    tree is then unchanged.
    """
    check_version(tf_version)
    tf_source = Path(tf_source)
    patch = Path(patch_file) if patch_file else patch_path(tf_version)
    if not patch.is_file():
        raise PatchApplyError(
            f"{patch} not found; generate it with `tflms patch generate --tf-version {tf_version}`"
        )
    patch = patch.resolve()
    tag = f"v{tf_version}"
    _check_tree(tf_source, tag, _patch_subject(patch))
    untracked_collisions = []
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            path = line[len("+++ b/") :]
            if (tf_source / path).exists() and _out(tf_source, "ls-files", "--", path) == "":
                untracked_collisions.append(path)
    if untracked_collisions:
        raise PatchApplyError(
            "untracked files are in the way of files the patch adds: "
            + ", ".join(untracked_collisions[:5])
            + "; move them away first"
        )
    check = _git(tf_source, "apply", "--check", str(patch))
    if check.returncode != 0:
        raise PatchApplyError(
            f"the patch does not apply to {tf_source} (nothing was changed):\n"
            f"{check.stderr.strip()}"
        )
    head_before = _out(tf_source, "rev-parse", "HEAD")
    am = _git(tf_source, "am", "--quiet", str(patch), env=_identity_env(tf_source))
    if am.returncode != 0:
        _git(tf_source, "am", "--abort")
        head_after = _out(tf_source, "rev-parse", "HEAD")
        restored = "restored" if head_after == head_before else "NOT restored; check it"
        raise PatchApplyError(
            f"git am failed ({am.stderr.strip() or am.stdout.strip()}); "
            f"the tree was {restored} (HEAD {head_before})"
        )
