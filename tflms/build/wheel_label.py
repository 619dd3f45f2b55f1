"""Local version labels on wheels: `tensorflow-2.21.0+lms` says the wheel carries LMS.

TensorFlow 2.21 can stamp the label itself (ML_WHEEL_TYPE=release with ML_WHEEL_VERSION_SUFFIX),
and the build asks it to. `relabel_wheel` is the fallback for a checkout that ignores those
settings: it rewrites the wheel's file name, its .dist-info directory, the Version field of
METADATA and the RECORD, so pip sees the same version the file name shows.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

_LOCAL = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")


class WheelLabelError(ValueError):
    pass


@dataclass(frozen=True)
class WheelName:
    name: str
    version: str
    build: str | None
    tags: str  # python-abi-platform

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        if not filename.endswith(".whl"):
            raise WheelLabelError(f"{filename} is not a wheel file name")
        parts = filename[: -len(".whl")].split("-")
        if len(parts) == 5:  # name-version-python-abi-platform
            return cls(parts[0], parts[1], None, "-".join(parts[2:]))
        if len(parts) == 6:  # with a build tag after the version
            return cls(parts[0], parts[1], parts[2], "-".join(parts[3:]))
        raise WheelLabelError(f"{filename} is not a valid wheel file name")

    @property
    def public_version(self) -> str:
        return self.version.split("+", 1)[0]

    @property
    def local(self) -> str | None:
        return self.version.split("+", 1)[1] if "+" in self.version else None

    def with_version(self, version: str) -> WheelName:
        return WheelName(self.name, version, self.build, self.tags)

    @property
    def filename(self) -> str:
        build = f"-{self.build}" if self.build else ""
        return f"{self.name}-{self.version}{build}-{self.tags}.whl"


def labelled_version(version: str, label: str) -> str:
    """`version` with its local label replaced by `label` (2.21.0.dev0+selfbuilt -> +lms)."""
    if not _LOCAL.match(label):
        raise WheelLabelError(
            f"local version label {label!r} must be lower-case letters and digits, "
            "in dot-separated parts (PEP 440)"
        )
    return version.split("+", 1)[0] + "+" + label


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def wheel_metadata_version(path: Path) -> str:
    """The Version field of a wheel's METADATA."""
    wheel = WheelName.parse(path.name)
    with zipfile.ZipFile(path) as zf:
        meta = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        if not meta:
            raise WheelLabelError(f"{path} has no .dist-info/METADATA")
        text = zf.read(meta[0]).decode("utf-8", errors="replace")
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise WheelLabelError(f"{path}: METADATA of {wheel.name} has no Version field")


def relabel_wheel(src: Path, dest_dir: Path, label: str) -> Path:
    """Writes a copy of `src` into `dest_dir` whose version carries `+label`; returns it.

    A wheel that already has the label in its name and METADATA is copied unchanged.
    """
    old = WheelName.parse(src.name)
    new = old.with_version(labelled_version(old.version, label))
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / new.filename
    if new.version == old.version and wheel_metadata_version(src) == new.version:
        if src.resolve() != dest.resolve():
            shutil.copy2(src, dest)
        return dest

    old_prefixes = (f"{old.name}-{old.version}.dist-info/", f"{old.name}-{old.version}.data/")
    new_prefixes = (f"{new.name}-{new.version}.dist-info/", f"{new.name}-{new.version}.data/")

    def rename(member: str) -> str:
        for o, n in zip(old_prefixes, new_prefixes, strict=True):
            if member.startswith(o):
                return n + member[len(o) :]
        return member

    record_name = new_prefixes[0] + "RECORD"
    tmp = dest.with_name(dest.name + ".partial")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        names = zin.namelist()
        old_meta = old_prefixes[0] + "METADATA"
        if old_meta not in names:
            raise WheelLabelError(f"{src} has no {old_meta}")
        new_meta = _relabel_metadata(zin.read(old_meta), new.version)
        rows: list[list[str]] = []
        for info in zin.infolist():
            target = rename(info.filename)
            if target == record_name:
                continue  # written last, from the rows collected here
            data = new_meta if info.filename == old_meta else zin.read(info)
            out_info = zipfile.ZipInfo(target, date_time=info.date_time)
            out_info.external_attr = info.external_attr
            out_info.compress_type = info.compress_type
            zout.writestr(out_info, data)
            if not target.endswith("/"):
                rows.append([target, _record_hash(data), str(len(data))])
        rows.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zout.writestr(record_name, buf.getvalue())
    os.replace(tmp, dest)
    return dest


def _relabel_metadata(raw: bytes, version: str) -> bytes:
    lines = raw.decode("utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            break  # the headers end at the first empty line
        if line.startswith("Version:"):
            lines[i] = f"Version: {version}"
            return "\n".join(lines).encode("utf-8")
    raise WheelLabelError("METADATA has no Version field")
