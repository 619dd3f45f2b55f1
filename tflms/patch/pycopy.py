"""A patched copy of the wheel's `tensorflow` package, for running the Python half.

Copying the package (about 1.3 GB) would cost more than the check itself, so
the copy is a symlink farm: only directories on the way to a patched file are
real, everything else links to the wheel. Patched files are written as real
files. The result behaves like TensorFlow built with the patch, as far as
Python can tell, with two simulated build steps:
  * config_pb2.py gets the wheel's descriptor plus the fields of the
    config.proto hunk (see proto_ext.py), standing in for protoc;
  * the generated API modules (tensorflow/_api/...) get import lines for the
    new tf_export'ed symbols, standing in for the API generator.
Bytecode must not be written (PYTHONDONTWRITEBYTECODE), or __pycache__ links
would write into the wheel.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tflms.patch.proto_ext import (
    CONFIG_PB2,
    CONFIG_PROTO,
    added_fields,
    extend_descriptor,
    patch_pb2_source,
)
from tflms.patch.unidiff import FileDiff, apply_hunks


class PyCopyError(RuntimeError):
    pass


@dataclass
class PatchedPackage:
    site: Path  # put this first on sys.path
    patched: list[str] = field(default_factory=list)  # TF paths written
    api_lines: list[str] = field(default_factory=list)  # "<api file>: <import line>"
    proto_fields: list[str] = field(default_factory=list)


def _realize(site_tf: Path, wheel_tf: Path, rel_dir: Path) -> Path:
    """Makes site_tf/rel_dir a real directory of links into the wheel."""
    cur = site_tf
    src = wheel_tf
    for part in rel_dir.parts:
        cur = cur / part
        src = src / part
        if cur.is_symlink():
            cur.unlink()
            cur.mkdir()
            for entry in src.iterdir():
                (cur / entry.name).symlink_to(entry)
        elif not cur.exists():
            cur.mkdir()
    return cur


def _write(site_tf: Path, wheel_tf: Path, rel: str, text: str) -> None:
    rel_path = Path(rel)
    parent = _realize(site_tf, wheel_tf, rel_path.parent)
    target = parent / rel_path.name
    if target.is_symlink():
        target.unlink()
    target.write_text(text)


def _tf_rel(tf_path: str) -> str | None:
    """TF source path -> path inside the installed `tensorflow` package."""
    if tf_path.startswith("tensorflow/") and tf_path.endswith(".py"):
        return tf_path[len("tensorflow/") :]
    return None


@dataclass(frozen=True)
class Export:
    module: str  # tensorflow.python.framework.config
    symbol: str
    lineno: int
    v2: tuple[str, ...]
    v1: tuple[str, ...]


def tf_exports(module: str, source: str) -> list[Export]:
    """Static tf_export decorators of a module, as TF's API generator reads them."""
    out: list[Export] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.ClassDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "tf_export"):
                continue
            v2 = tuple(a.value for a in dec.args if isinstance(a, ast.Constant))
            v1 = v2
            for kw in dec.keywords:
                if kw.arg == "v1" and isinstance(kw.value, ast.List):
                    v1 = tuple(e.value for e in kw.value.elts if isinstance(e, ast.Constant))
            out.append(Export(module, node.name, node.lineno, v2, v1))
    return out


def _register_exports(site_tf: Path, wheel_tf: Path, exports: list[Export]) -> list[str]:
    added: list[str] = []
    for exp in exports:
        targets = [("_api/v2", n) for n in exp.v2]
        targets += [("_api/v2/compat/v2", n) for n in exp.v2]
        targets += [("_api/v2/compat/v1", n) for n in exp.v1]
        for root, dotted in targets:
            *ns, name = dotted.split(".")
            rel = "/".join([root, *ns, "__init__.py"])
            current_path = site_tf / rel
            if not current_path.exists():
                raise PyCopyError(f"API namespace {'.'.join(ns)} has no module {rel} in the wheel")
            text = current_path.read_text()
            if re.search(rf"import \w+ as {name}\b|import {name}\b", text):
                continue
            alias = "" if name == exp.symbol else f" as {name}"
            line = f"from {exp.module} import {exp.symbol}{alias} # line: {exp.lineno}"
            # The generated modules import a private `sys` last; add before it.
            if "\n\nimport sys as _sys" in text:
                text = text.replace("\n\nimport sys as _sys", f"\n{line}\n\nimport sys as _sys", 1)
            else:
                text = text.rstrip("\n") + f"\n{line}\n"
            _write(site_tf, wheel_tf, rel, text)
            added.append(f"{rel}: {line}")
    return added


def build_patched_package(wheel_tf: Path, dest: Path, file_diffs: list[FileDiff]) -> PatchedPackage:
    """Writes the patched copy under dest/site/tensorflow.

    Raises PyCopyError if a Python hunk does not apply: the copy would then not
    be what the patch produces.
    """
    site = dest / "site"
    site_tf = site / "tensorflow"
    if site.exists():
        shutil.rmtree(site)
    site_tf.mkdir(parents=True)
    for entry in wheel_tf.iterdir():
        (site_tf / entry.name).symlink_to(entry)
    result = PatchedPackage(site=site)
    exports: list[Export] = []
    for fd in file_diffs:
        if fd.path == CONFIG_PROTO and not fd.new_file:
            pb2 = wheel_tf / CONFIG_PB2
            source = pb2.read_text()
            from google.protobuf import descriptor_pb2  # noqa: F401  (fail early if missing)

            serialized = _serialized_from_pb2(source)
            fields = added_fields(fd, serialized)
            new_source = patch_pb2_source(source, extend_descriptor(serialized, fields))
            _write(site_tf, wheel_tf, CONFIG_PB2, new_source)
            result.proto_fields = [
                f"{f.message}.{f.name} = {f.number}"
                + (" (proto3 optional)" if f.proto3_optional else "")
                for f in fields
            ]
            continue
        rel = _tf_rel(fd.path)
        if rel is None:
            continue
        if fd.new_file:
            text = fd.content
        else:
            original = wheel_tf / rel
            if not original.is_file():
                raise PyCopyError(f"{fd.path}: the wheel has no {rel} to patch")
            text, results = apply_hunks(original.read_text(), fd.hunks)
            failed = [r.hunk.header() for r in results if not r.applied]
            if failed:
                raise PyCopyError(f"{fd.path}: hunks do not apply: {', '.join(failed)}")
        _write(site_tf, wheel_tf, rel, text)
        result.patched.append(fd.path)
        module = "tensorflow." + rel[: -len(".py")].replace("/", ".")
        # Only what the patch exports anew; the wheel's API has the rest.
        before = set()
        if not fd.new_file:
            before = {(e.symbol, e.v2, e.v1) for e in tf_exports(module, original.read_text())}
        exports += [e for e in tf_exports(module, text) if (e.symbol, e.v2, e.v1) not in before]
    result.api_lines = _register_exports(site_tf, wheel_tf, exports)
    return result


def _serialized_from_pb2(source: str) -> bytes:
    marker = "AddSerializedFile("
    start = source.index(marker) + len(marker)
    end = source.index(")\n", start)
    value = ast.literal_eval(source[start:end])
    if not isinstance(value, bytes):
        raise PyCopyError("config_pb2.py: descriptor literal is not bytes")
    return value


def subprocess_env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env
