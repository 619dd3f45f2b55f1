"""Extends the wheel's compiled config.proto with the fields the patch adds.

The tensorflow-cpu wheel ships config_pb2.py (a serialized FileDescriptorProto)
but not config.proto, so the patched Python package cannot be regenerated with
protoc from the patched .proto. Instead the fields are read from the patch's
config.proto hunk and added to the wheel's own descriptor, and only the
descriptor bytes in config_pb2.py are replaced: the rest of the generated
module stays exactly what protoc 6.31.1 produced for the wheel. Field numbers
and names are checked against the descriptor so a clash fails loudly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tflms.patch.unidiff import FileDiff

CONFIG_PROTO = "tensorflow/core/protobuf/config.proto"
CONFIG_PB2 = "core/protobuf/config_pb2.py"  # relative to the tensorflow package

_SCALARS = {
    "bool": "TYPE_BOOL",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "float": "TYPE_FLOAT",
    "double": "TYPE_DOUBLE",
    "string": "TYPE_STRING",
}
_FIELD_RE = re.compile(r"^\s*(optional\s+)?(\w+)\s+(\w+)\s*=\s*(\d+)\s*;")


class ProtoExtError(ValueError):
    pass


@dataclass(frozen=True)
class AddedField:
    message: str  # full name, e.g. tensorflow.GPUOptions.Experimental
    name: str
    number: int
    type_name: str  # TYPE_BOOL, ...
    # Declared `optional` in proto3: the field has presence, which protoc
    # records as proto3_optional plus a synthetic oneof of its own.
    proto3_optional: bool = False


def _field_decls(lines: list[str]) -> list[tuple[str, str, int, bool]]:
    """(type, name, number, declared optional) of each field declaration."""
    out = []
    for ln in lines:
        m = _FIELD_RE.match(ln.split("//", 1)[0])
        if m:
            out.append((m[2], m[3], int(m[4]), m[1] is not None))
    return out


def _messages(fdp: object) -> dict[str, object]:
    """Full name -> DescriptorProto for every message of a FileDescriptorProto."""
    found: dict[str, object] = {}

    def walk(prefix: str, msgs: object) -> None:
        for m in msgs:  # type: ignore[attr-defined]
            name = f"{prefix}.{m.name}"
            found[name] = m
            walk(name, m.nested_type)

    walk(fdp.package, fdp.message_type)  # type: ignore[attr-defined]
    return found


def added_fields(fd: FileDiff, serialized: bytes) -> list[AddedField]:
    """The scalar fields a config.proto diff adds, with their messages.

    Each hunk's message is found from its context: the message of the wheel's
    descriptor that declares the same field names with the same numbers.
    """
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    messages = _messages(fdp)
    out: list[AddedField] = []
    for hunk in fd.hunks:
        context = [ln[1:] for ln in hunk.lines if ln[0] == " "]
        added = [ln[1:] for ln in hunk.lines if ln[0] == "+"]
        if any(ln[0] == "-" for ln in hunk.lines):
            raise ProtoExtError(f"{CONFIG_PROTO}: hunks may only add lines")
        anchors = _field_decls(context)
        if not anchors:
            raise ProtoExtError(
                f"{CONFIG_PROTO}: hunk {hunk.header()} has no field declaration in its "
                "context, so its message cannot be identified"
            )
        owners = [
            full
            for full, msg in messages.items()
            if all(
                any(f.name == name and f.number == num for f in msg.field)  # type: ignore[attr-defined]
                for _, name, num, _ in anchors
            )
        ]
        if len(owners) != 1:
            raise ProtoExtError(
                f"{CONFIG_PROTO}: context of {hunk.header()} matches {len(owners)} messages"
            )
        for ftype, name, num, optional in _field_decls(added):
            if ftype not in _SCALARS:
                raise ProtoExtError(f"{CONFIG_PROTO}: only scalar fields supported, got {ftype}")
            out.append(AddedField(owners[0], name, num, _SCALARS[ftype], optional))
    return out


def extend_descriptor(serialized: bytes, fields: list[AddedField]) -> bytes:
    """Returns the FileDescriptorProto with `fields` added, serialized."""
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    messages = _messages(fdp)
    for f in fields:
        msg = messages[f.message]
        for existing in msg.field:  # type: ignore[attr-defined]
            if existing.number == f.number or existing.name == f.name:
                raise ProtoExtError(
                    f"{f.message}.{f.name} = {f.number} clashes with existing field "
                    f"{existing.name} = {existing.number}"
                )
        for rng in msg.reserved_range:  # type: ignore[attr-defined]
            if rng.start <= f.number < rng.end:
                raise ProtoExtError(f"{f.message}: field number {f.number} is reserved")
        if f.name in msg.reserved_name:  # type: ignore[attr-defined]
            raise ProtoExtError(f"{f.message}: field name {f.name} is reserved")
        new = msg.field.add()  # type: ignore[attr-defined]
        new.name = f.name
        new.number = f.number
        new.label = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
        new.type = descriptor_pb2.FieldDescriptorProto.Type.Value(f.type_name)
        if f.proto3_optional:
            # What protoc emits for `optional` in proto3: a synthetic oneof
            # named after the field, declared after every real oneof (new ones
            # go last, so that holds), with the field as its only member.
            oneof_name = "_" + f.name
            if any(o.name == oneof_name for o in msg.oneof_decl):  # type: ignore[attr-defined]
                raise ProtoExtError(f"{f.message}: a oneof is already named {oneof_name}")
            msg.oneof_decl.add().name = oneof_name  # type: ignore[attr-defined]
            new.oneof_index = len(msg.oneof_decl) - 1  # type: ignore[attr-defined]
            new.proto3_optional = True
    return fdp.SerializeToString()


def patch_pb2_source(source: str, new_serialized: bytes) -> str:
    """Replaces the serialized descriptor literal in a generated *_pb2.py."""
    marker = "AddSerializedFile("
    start = source.find(marker)
    if start < 0 or source.count(marker) != 1:
        raise ProtoExtError("config_pb2.py: expected exactly one AddSerializedFile(...) call")
    lit_start = start + len(marker)
    lit_end = source.index(")\n", lit_start)
    return source[:lit_start] + repr(new_serialized) + source[lit_end:]
