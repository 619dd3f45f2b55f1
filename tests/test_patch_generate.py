"""The patch generator: determinism, format, engine verbatim, staleness."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tflms.patch import (
    ENGINE_DIR,
    NEWEST_VERSION,
    SUPPORTED_VERSIONS,
    patch_path,
    repo_root,
    tf_dir,
    tf_layers,
)
from tflms.patch.generate import (
    AUTHOR,
    DATE,
    collect,
    commit_message_path,
    diff_files,
    generate,
    new_files,
    stale_reason,
)
from tflms.patch.unidiff import DiffError, apply_hunks, merge_file_diffs, parse_diff

VERSION = "2.21.0"
ROOT = repo_root()


def test_generation_is_deterministic_and_git_am_shaped() -> None:
    first = generate(VERSION)
    assert first == generate(VERSION)
    head = first.split("\n---\n", 1)[0]
    assert head.startswith(
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
    )
    assert f"\nFrom: {AUTHOR}\n" in head and f"\nDate: {DATE}\n" in head
    assert "\nSubject: [PATCH] Add Large Model Support" in head
    assert head.rstrip().endswith(f"Signed-off-by: {AUTHOR}")
    # The body explains the change, not only names it.
    assert len(head.splitlines()) > 30 and "TF_GPU_HOST_MEM_LIMIT_IN_MB" in head


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_committed_patch_is_up_to_date(version: str) -> None:
    """`tflms patch check` for every supported tag (CI runs this; it is cheap)."""
    assert stale_reason(version) is None


def test_every_supported_tag_has_its_layer_provenance_and_patch() -> None:
    assert SUPPORTED_VERSIONS[-1] == NEWEST_VERSION == VERSION
    for version in SUPPORTED_VERSIONS:
        assert (tf_dir(version) / "PROVENANCE.md").is_file(), version
        assert patch_path(version).is_file(), version
    on_disk = {p.name for p in (ROOT / "tf").glob("v*") if p.is_dir()}
    assert on_disk == {f"v{v}" for v in SUPPORTED_VERSIONS}
    # The newest tag is tf/common/ alone: it overrides nothing.
    assert tf_layers(NEWEST_VERSION) == [tf_dir(NEWEST_VERSION), ROOT / "tf" / "common"]
    assert not (tf_dir(NEWEST_VERSION) / "files").exists()
    assert not (tf_dir(NEWEST_VERSION) / "diffs").exists()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_layers_precedence_inherits_and_removal(tmp_path: Path) -> None:
    """tf/v<tag>/ wins over what it INHERITS, which wins over tf/common/; empty diffs remove."""
    tf = tmp_path / "tf"
    _write(tf / "common" / "COMMIT_MESSAGE", "Subject\n\nBody\n")
    _write(tf / "common" / "files" / "a.h", "common a\n")
    _write(tf / "common" / "files" / "b.h", "common b\n")
    for name in ("10-x.diff", "20-y.diff", "30-z.diff"):
        _write(tf / "common" / "diffs" / name, DIFF_A)
    _write(tf / "v2.0.0" / "files" / "a.h", "2.0.0 a\n")
    _write(tf / "v2.0.0" / "diffs" / "20-y.diff", "# not in 2.0.0\n")
    _write(tf / "v1.0.0" / "INHERITS", "# comment\nv2.0.0\n")
    _write(tf / "v1.0.0" / "files" / "b.h", "1.0.0 b\n")
    _write(tf / "v1.0.0" / "diffs" / "30-z.diff", DIFF_B)
    _write(tf / "v1.0.0" / "COMMIT_MESSAGE", "Old\n\nBody\n")
    assert tf_layers("1.0.0", tmp_path) == [tf / "v1.0.0", tf / "v2.0.0", tf / "common"]
    files = new_files("1.0.0", tmp_path)
    assert files == {"a.h": tf / "v2.0.0" / "files" / "a.h", "b.h": tf / "v1.0.0" / "files" / "b.h"}
    assert diff_files("1.0.0", tmp_path) == [
        tf / "common/diffs/10-x.diff",
        tf / "v1.0.0/diffs/30-z.diff",
    ]
    assert diff_files("2.0.0", tmp_path) == [
        tf / "common/diffs/10-x.diff",
        tf / "common/diffs/30-z.diff",
    ]
    assert commit_message_path("1.0.0", tmp_path) == tf / "v1.0.0" / "COMMIT_MESSAGE"
    assert commit_message_path("2.0.0", tmp_path) == tf / "common" / "COMMIT_MESSAGE"
    _write(tf / "v2.0.0" / "INHERITS", "v1.0.0\n")
    with pytest.raises(ValueError, match="cycle"):
        tf_layers("1.0.0", tmp_path)


def test_older_tags_differ_from_the_newest_only_where_their_layers_say() -> None:
    """A tag's patch is the newest tag's with exactly its own layers' replacements."""
    newest = {f.path: f for f in collect(NEWEST_VERSION).files}
    for version in SUPPORTED_VERSIONS[:-1]:
        own = [layer for layer in tf_layers(version) if layer.name != "common"]
        overridden = {d.name for layer in own for d in (layer / "diffs").glob("*.diff")}
        overridden_paths = {
            fd.path
            for layer in own
            for d in (layer / "diffs").glob("*.diff")
            for fd in parse_diff(d.read_text(), d.name)
        }
        overridden_paths |= {
            p.relative_to(layer / "files").as_posix()
            for layer in own
            for p in (layer / "files").rglob("*")
            if p.is_file()
        }
        for f in collect(version).files:
            if f.path not in overridden_paths:
                assert f == newest[f.path], (version, f.path)
        assert overridden, version


def test_engine_is_included_verbatim_without_sim_and_cuda_backends() -> None:
    files = {f.path: f for f in collect(VERSION).files}
    engine_sources = sorted((ROOT / "core" / "include" / "tflms").glob("*.h"))
    engine_sources += [
        p
        for p in sorted((ROOT / "core" / "src").glob("*"))
        if p.suffix in (".h", ".cc") and not p.name.startswith(("sim_device", "cuda_device"))
    ]
    assert engine_sources
    for src in engine_sources:
        sub = "include/tflms" if src.parent.name == "tflms" else "src"
        entry = files[f"{ENGINE_DIR}/{sub}/{src.name}"]
        assert entry.new_file and entry.content == src.read_text()
    assert not [p for p in files if "/sim_device" in p or "/cuda_device" in p]


def test_new_files_apply_with_git_to_an_empty_tree(tmp_path: Path) -> None:
    """git itself accepts the rendered new-file sections and recreates them exactly."""
    text = generate(VERSION)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    new_only = [
        sect
        for sect in text.split("\ndiff --git ")[1:]
        if "\nnew file mode" in sect.split("@@", 1)[0]
    ]
    patch = tmp_path / "new.diff"
    patch.write_text(
        "".join("diff --git " + s + ("" if s.endswith("\n") else "\n") for s in new_only)
    )
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    for f in collect(VERSION).files:
        if f.new_file:
            assert (tmp_path / f.path).read_text() == f.content
    # The index lines carry the blob ids git computes.
    out = subprocess.run(
        ["git", "hash-object", f"{ENGINE_DIR}/include/tflms/engine.h"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert f"..{out[:12]}\n" in text


def _copy_layout(dest: Path) -> Path:
    for sub in ("core/include", "core/src", "tf", "patches"):
        shutil.copytree(ROOT / sub, dest / sub)
    return dest


def test_stale_patch_is_detected_and_check_command_fails(tmp_path: Path) -> None:
    root = _copy_layout(tmp_path)
    assert stale_reason(VERSION, root) is None
    header = root / "core" / "include" / "tflms" / "engine.h"
    header.write_text(header.read_text() + "// changed\n")
    reason = stale_reason(VERSION, root)
    assert reason and "stale" in reason and "tflms patch generate" in reason
    proc = subprocess.run(
        [sys.executable, "-m", "tflms", "patch", "check", "--tf-version", VERSION],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr  # the real repository is up to date


def test_missing_patch_is_reported(tmp_path: Path) -> None:
    root = _copy_layout(tmp_path)
    patch_path(VERSION, root).unlink()
    reason = stale_reason(VERSION, root)
    assert reason and "does not exist" in reason


DIFF_A = """--- a/f.txt
+++ b/f.txt
@@ -2,3 +2,4 @@
 two
+two and a half
 three
 four
"""
DIFF_B = """--- a/f.txt
+++ b/f.txt
@@ -7,3 +7,3 @@
 seven
-eight
+EIGHT
 nine
"""
BASE = "".join(f"{w}\n" for w in "one two three four five six seven eight nine ten".split())


def test_hunks_from_two_diffs_merge_with_recomputed_positions() -> None:
    merged = merge_file_diffs(parse_diff(DIFF_A, "a") + parse_diff(DIFF_B, "b"))
    assert len(merged) == 1
    hunks = merged[0].hunks
    assert [h.new_start for h in hunks] == [2, 8]
    text, results = apply_hunks(BASE, hunks)
    assert all(r.applied for r in results)
    assert text.splitlines()[2] == "two and a half" and "EIGHT" in text and "eight" not in text


def test_overlapping_hunks_and_bad_counts_are_errors() -> None:
    with pytest.raises(DiffError, match="overlap"):
        merge_file_diffs(
            parse_diff(DIFF_A, "a") + parse_diff(DIFF_A.replace("two and", "2 and"), "c")
        )
    with pytest.raises(DiffError, match="declares"):
        parse_diff(DIFF_A.replace("+2,4", "+2,5"), "bad")


def test_hunk_with_wrong_context_does_not_apply() -> None:
    hunks = parse_diff(DIFF_B.replace(" seven", " SEVEN"), "x")[0].hunks
    text, results = apply_hunks(BASE, hunks)
    assert not results[0].applied and text == BASE
