"""Unified diffs: parse, merge per file, render in git's format, apply exactly.

The patch is composed from hand-written diffs, so everything here is strict: a
hunk whose line counts disagree with its body is an error, and applying never
uses fuzz (a hunk applies only where its context matches exactly, as git does).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")


class DiffError(ValueError):
    """A diff that cannot be parsed or does not apply."""


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[str]  # each starts with ' ', '-' or '+', no trailing newline
    section: str = ""  # text after the second @@ (a function name, for readers)
    origin: str = ""  # which .diff file it came from

    @property
    def old_lines(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[0] in " -"]

    @property
    def new_lines(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[0] in " +"]

    def header(self) -> str:
        def rng(start: int, length: int) -> str:
            return f"{start}" if length == 1 else f"{start},{length}"

        tail = f" {self.section.strip()}" if self.section.strip() else ""
        old = rng(self.old_start, self.old_len)
        new = rng(self.new_start, self.new_len)
        return f"@@ -{old} +{new} @@{tail}"

    @property
    def added(self) -> int:
        return sum(1 for ln in self.lines if ln[0] == "+")

    @property
    def removed(self) -> int:
        return sum(1 for ln in self.lines if ln[0] == "-")


@dataclass
class FileDiff:
    path: str  # path inside the TensorFlow tree, without a/ or b/
    hunks: list[Hunk] = field(default_factory=list)
    new_file: bool = False
    content: str = ""  # full text, for new files

    @property
    def added(self) -> int:
        if self.new_file:
            return len(self.content.splitlines())
        return sum(h.added for h in self.hunks)

    @property
    def removed(self) -> int:
        return 0 if self.new_file else sum(h.removed for h in self.hunks)


def _strip_prefix(path: str, prefix: str) -> str:
    path = path.split("\t", 1)[0].strip()
    if not path.startswith(prefix):
        raise DiffError(f"expected a path starting with {prefix!r}, got {path!r}")
    return path[len(prefix) :]


def parse_diff(text: str, origin: str = "") -> list[FileDiff]:
    """Parses a unified diff of existing files (a/ and b/ paths, no renames)."""
    files: list[FileDiff] = []
    lines = text.splitlines()
    i = 0
    current: FileDiff | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise DiffError(f"{origin}:{i + 1}: '---' line without '+++' line")
            old = _strip_prefix(line[4:], "a/")
            new = _strip_prefix(lines[i + 1][4:], "b/")
            if old != new:
                raise DiffError(f"{origin}:{i + 1}: renames are not supported ({old} -> {new})")
            current = FileDiff(path=new)
            files.append(current)
            i += 2
            continue
        match = _HUNK_RE.match(line)
        if match:
            if current is None:
                raise DiffError(f"{origin}:{i + 1}: hunk before any file header")
            old_start, old_len = int(match[1]), int(match[2] if match[2] is not None else 1)
            new_start, new_len = int(match[3]), int(match[4] if match[4] is not None else 1)
            body: list[str] = []
            seen_old = seen_new = 0
            i += 1
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                ln = lines[i]
                if ln == "":
                    ln = " "  # editors strip the space of an empty context line
                if ln.startswith("\\"):
                    raise DiffError(f"{origin}:{i + 1}: files must end with a newline")
                kind = ln[0]
                if kind not in " +-":
                    raise DiffError(f"{origin}:{i + 1}: unexpected line in hunk: {ln!r}")
                seen_old += kind in " -"
                seen_new += kind in " +"
                body.append(ln)
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise DiffError(
                    f"{origin}: hunk {line!r} declares -{old_len} +{new_len} lines "
                    f"but has -{seen_old} +{seen_new}"
                )
            current.hunks.append(
                Hunk(old_start, old_len, new_start, new_len, body, match[5], origin)
            )
            continue
        if line.startswith(("diff ", "index ", "#")) or not line.strip():
            i += 1  # headers git adds, comments and blank lines between files
            continue
        raise DiffError(f"{origin}:{i + 1}: unexpected line outside a hunk: {line!r}")
    return files


def merge_file_diffs(diffs: list[FileDiff]) -> list[FileDiff]:
    """Combines hunks on the same file from several .diff files.

    Each .diff is written against pristine TensorFlow, so hunks keep their old
    line numbers; new line numbers are recomputed from the hunks before them.
    """
    by_path: dict[str, list[Hunk]] = {}
    for d in diffs:
        by_path.setdefault(d.path, []).extend(d.hunks)
    merged: list[FileDiff] = []
    for path, hunks in by_path.items():
        hunks = sorted(hunks, key=lambda h: h.old_start)
        delta = 0
        prev_end = 0
        out: list[Hunk] = []
        for h in hunks:
            if h.old_start <= prev_end and prev_end:
                raise DiffError(
                    f"{path}: hunks from {h.origin} overlap an earlier hunk "
                    f"(old line {h.old_start} <= {prev_end}); merge them into one diff"
                )
            prev_end = h.old_start + max(h.old_len, 1) - 1
            new_start = h.old_start + delta if h.old_len else h.old_start + delta + 1
            out.append(
                Hunk(h.old_start, h.old_len, new_start, h.new_len, h.lines, h.section, h.origin)
            )
            delta += h.new_len - h.old_len
        merged.append(FileDiff(path=path, hunks=out))
    return merged


def git_blob_id(content: bytes) -> str:
    """The object id git gives a file with this content (for `index` lines)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def render_file_diff(fd: FileDiff) -> str:
    out = [f"diff --git a/{fd.path} b/{fd.path}"]
    if fd.new_file:
        data = fd.content.encode()
        out.append("new file mode 100644")
        out.append(f"index {'0' * 7}..{git_blob_id(data)[:12]}")
        body = fd.content.splitlines()
        if body:
            out += ["--- /dev/null", f"+++ b/{fd.path}"]
            out.append(f"@@ -0,0 +1{'' if len(body) == 1 else f',{len(body)}'} @@")
            out += ["+" + ln for ln in body]
    else:
        out += [f"--- a/{fd.path}", f"+++ b/{fd.path}"]
        for h in fd.hunks:
            out.append(h.header())
            out += h.lines
    return "\n".join(out) + "\n"


@dataclass
class HunkResult:
    hunk: Hunk
    applied: bool
    offset: int = 0  # lines away from the stated position
    message: str = ""


def apply_hunks(text: str, hunks: list[Hunk]) -> tuple[str, list[HunkResult]]:
    """Applies hunks with exact context (offsets allowed, no fuzz), like git apply."""
    src = text.splitlines()
    results: list[HunkResult] = []
    out: list[str] = []
    pos = 0  # next unconsumed source line (0-based)
    for h in hunks:
        old = h.old_lines
        want = max(h.old_start - 1, 0) if h.old_len else h.old_start
        found = -1
        for dist in range(0, len(src) + 1):
            for cand in (want - dist, want + dist) if dist else (want,):
                if cand < pos or cand + len(old) > len(src):
                    continue
                if src[cand : cand + len(old)] == old:
                    found = cand
                    break
            if found >= 0:
                break
        if found < 0:
            results.append(HunkResult(h, False, message="context does not match"))
            continue
        out += src[pos:found]
        out += h.new_lines
        pos = found + len(old)
        results.append(HunkResult(h, True, offset=found - want))
    out += src[pos:]
    return "\n".join(out) + ("\n" if out else ""), results
