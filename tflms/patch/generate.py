"""Composes the git-am patch for a TensorFlow tag from core/ and tf/.

The output is deterministic (fixed author, date and file order) so CI can
regenerate it and compare it byte for byte with the committed patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tflms.patch import (
    ENGINE_DIR,
    ENGINE_EXCLUDED_PREFIXES,
    check_version,
    checkout_patch_path,
    patch_path,
    repo_root,
    tf_layers,
)
from tflms.patch.unidiff import (
    DiffError,
    FileDiff,
    apply_hunks,
    merge_file_diffs,
    parse_diff,
    render_file_diff,
)

AUTHOR = "tflms <tflms@users.noreply.github.com>"
# A fixed date keeps regeneration byte-identical; it is the date of the format.
DATE = "Thu, 1 Jan 2026 00:00:00 +0000"
FROM_LINE = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"


@dataclass
class PatchParts:
    subject: str
    body: str
    files: list[FileDiff]  # sorted by path


def engine_files(root: Path) -> dict[str, Path]:
    """Maps TF paths to engine sources (core/) that go into the patch."""
    out: dict[str, Path] = {}
    for src in sorted((root / "core" / "include" / "tflms").glob("*.h")):
        out[f"{ENGINE_DIR}/include/tflms/{src.name}"] = src
    src_dir = root / "core" / "src"
    for src in sorted(src_dir.iterdir()) if src_dir.is_dir() else []:
        if src.suffix not in (".h", ".cc") or src.name.startswith(ENGINE_EXCLUDED_PREFIXES):
            continue
        out[f"{ENGINE_DIR}/src/{src.name}"] = src
    return out


def new_files(version: str, root: Path) -> dict[str, Path]:
    """TF path -> source of every new file, from the tag's layers (the first that has it)."""
    out: dict[str, Path] = {}
    for layer in reversed(tf_layers(version, root)):  # more specific layers overwrite
        base = layer / "files"
        if base.is_dir():
            for src in sorted(p for p in base.rglob("*") if p.is_file()):
                if "__pycache__" in src.parts or src.suffix == ".pyc":
                    continue
                out[src.relative_to(base).as_posix()] = src
    return dict(sorted(out.items()))


def diff_files(version: str, root: Path) -> list[Path]:
    """The tag's .diff files in name order, each from the first layer that has that name.

    A .diff without hunks (only its comment) removes the diff of that name from the layers
    below: it is left out.
    """
    by_name: dict[str, Path] = {}
    for layer in reversed(tf_layers(version, root)):
        diff_dir = layer / "diffs"
        for diff in sorted(diff_dir.glob("*.diff")) if diff_dir.is_dir() else []:
            by_name[diff.name] = diff
    chosen = [by_name[name] for name in sorted(by_name)]
    return [d for d in chosen if parse_diff(d.read_text(), origin=d.name)]


def commit_message_path(version: str, root: Path) -> Path:
    """The COMMIT_MESSAGE of the first layer that has one (tf/common/'s unless overridden)."""
    layers = tf_layers(version, root)
    for layer in layers:
        if (layer / "COMMIT_MESSAGE").is_file():
            return layer / "COMMIT_MESSAGE"
    return layers[-1] / "COMMIT_MESSAGE"


def read_commit_message(version: str, root: Path) -> tuple[str, str]:
    path = commit_message_path(version, root)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it holds the patch's subject and body")
    text = path.read_text()
    subject, _, body = text.partition("\n")
    if not subject.strip() or not body.startswith("\n"):
        raise ValueError(f"{path}: first line is the subject, then a blank line, then the body")
    return subject.strip(), body.strip("\n")


def _merged_diffs(version: str, root: Path) -> list[FileDiff]:
    parsed: list[FileDiff] = []
    for diff in diff_files(version, root):
        parsed += parse_diff(diff.read_text(), origin=diff.relative_to(root).as_posix())
    return merge_file_diffs(parsed)


def added_files(version: str, root: Path, changed: list[FileDiff] | None = None) -> dict[str, str]:
    """TF path -> content of every file the patch adds: the engine, then the new files.

    A tag's diff may patch a file that a lower layer adds (tf/common/files), so that a small
    API difference of an older tag stays a small diff instead of a copy of the file: its
    hunks are applied here, exactly (as `git apply`), and the patch adds the result. The
    engine (core/) is never patched per tag.
    """
    sources: dict[str, Path] = {}
    engine = engine_files(root)
    for tf_path, src in [*engine.items(), *new_files(version, root).items()]:
        if tf_path in sources:
            raise ValueError(f"{tf_path} comes from both {sources[tf_path]} and {src}")
        sources[tf_path] = src
    on_new = {fd.path: fd for fd in (changed or _merged_diffs(version, root))}
    out: dict[str, str] = {}
    for tf_path, src in sources.items():
        content = src.read_text()
        if content and not content.endswith("\n"):
            raise ValueError(f"{src} must end with a newline")
        fd = on_new.get(tf_path)
        if fd is not None:
            if tf_path in engine:
                raise DiffError(f"{tf_path} is the engine's ({src}): core/ is not patched per tag")
            content, results = apply_hunks(content, fd.hunks)
            failed = [r for r in results if not r.applied]
            if failed:
                raise DiffError(
                    f"{tf_path}: hunk {failed[0].hunk.header()} from {failed[0].hunk.origin} "
                    f"does not apply to {src}"
                )
        out[tf_path] = content
    return out


def collect(version: str, root: Path | None = None) -> PatchParts:
    check_version(version)
    root = root or repo_root()
    changed = _merged_diffs(version, root)
    added = added_files(version, root, changed)
    files = [fd for fd in changed if fd.path not in added]
    for tf_path, content in added.items():
        files.append(FileDiff(path=tf_path, new_file=True, content=content))
    files.sort(key=lambda f: f.path)
    subject, body = read_commit_message(version, root)
    return PatchParts(subject, body, files)


def _diffstat(files: list[FileDiff]) -> str:
    width = max(len(f.path) for f in files)
    most = max(f.added + f.removed for f in files) or 1
    bar_room = max(10, 72 - width - 10)
    lines = []
    for f in files:
        n = f.added + f.removed
        scale = min(1.0, bar_room / most)
        plus = round(f.added * scale) or (1 if f.added else 0)
        minus = round(f.removed * scale) or (1 if f.removed else 0)
        lines.append(f" {f.path.ljust(width)} | {str(n).rjust(5)} {'+' * plus}{'-' * minus}")
    total_add = sum(f.added for f in files)
    total_del = sum(f.removed for f in files)
    lines.append(
        f" {len(files)} files changed, {total_add} insertions(+), {total_del} deletions(-)"
    )
    created = [f" create mode 100644 {f.path}" for f in files if f.new_file]
    return "\n".join(lines + created)


def render(parts: PatchParts) -> str:
    header = [
        FROM_LINE,
        f"From: {AUTHOR}",
        f"Date: {DATE}",
        f"Subject: [PATCH] {parts.subject}",
        "",
        parts.body,
        "",
        f"Signed-off-by: {AUTHOR}",
        "---",
        _diffstat(parts.files),
        "",
    ]
    return "\n".join(header) + "\n" + "".join(render_file_diff(f) for f in parts.files)


def generate(version: str, root: Path | None = None) -> str:
    return render(collect(version, root))


def write_patch(version: str, root: Path | None = None, out: Path | None = None) -> Path:
    text = generate(version, root)
    dest = out or (patch_path(version, root) if root else checkout_patch_path(version))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest


def stale_reason(version: str, root: Path | None = None) -> str | None:
    """None when the committed patch equals a regeneration, else why not."""
    committed = patch_path(version, root)
    if not committed.is_file():
        return f"{committed} does not exist; run `tflms patch generate --tf-version {version}`"
    fresh = generate(version, root)
    if committed.read_text() != fresh:
        return (
            f"{committed} is stale: it differs from what core/ and the layers of "
            f"tf/v{version}/ (tf/common/ and any it inherits) generate; "
            f"run `tflms patch generate --tf-version {version}` (or `make patches`) and commit it"
        )
    return None
