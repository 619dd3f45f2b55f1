"""API goldens (tensorflow/tools/api/golden) regenerated from a live TensorFlow.

TensorFlow's api_compatibility_test compares the public API with .pbtxt
goldens and fails when a new symbol has none; the patch must update them. The
wheel does not ship the goldens, so they are regenerated here, from the
unpatched wheel (what v2.21.0's goldens say) and from the patched copy (what
they must say after the patch), with the rules of TensorFlow's
python_object_to_proto_visitor for the parts these files use: modules (members
sorted by name, `member` entries before `member_method` entries, argspecs in
the getargspec-style format) and protocol buffer messages (the descriptor in
text format). The golden hunks of the patch must turn the first into the
second.

Run as a script (`python -m tflms.patch.goldens`) it prints a JSON object
{golden path: text}; it imports whatever `tensorflow` is first on sys.path.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

GOLDEN_DIR = "tensorflow/tools/api/golden"

# (golden file, API path, how to reach the object from `tf`)
GOLDENS = (
    (
        "v1/tensorflow.config.experimental.pbtxt",
        "tensorflow.config.experimental",
        "compat.v1.config.experimental",
    ),
    ("v1/tensorflow.experimental.pbtxt", "tensorflow.experimental", "compat.v1.experimental"),
    ("v1/tensorflow.-g-p-u-options.pbtxt", "tensorflow.GPUOptions", "compat.v1.GPUOptions"),
    (
        "v1/tensorflow.-g-p-u-options.-experimental.pbtxt",
        "tensorflow.GPUOptions.Experimental",
        "compat.v1.GPUOptions.Experimental",
    ),
    (
        "v2/tensorflow.config.experimental.pbtxt",
        "tensorflow.config.experimental",
        "config.experimental",
    ),
    ("v2/tensorflow.experimental.pbtxt", "tensorflow.experimental", "experimental"),
)

_BUILTIN_TYPES = {
    "type",
    "module",
    "dict",
    "list",
    "tuple",
    "str",
    "int",
    "float",
    "bool",
    "NoneType",
    "function",
    "property",
    "frozenset",
    "set",
    "object",
}


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")


def _mtype(obj: Any) -> str:
    text = str(type(obj))
    inner = text[len("<class '") : -2] if text.startswith("<class '") else ""
    if inner in _BUILTIN_TYPES:
        return f"<type '{inner}'>"
    return text


def argspec(fn: Any) -> str:
    from tensorflow.python.util import tf_inspect

    spec = tf_inspect.getfullargspec(fn)
    out = f"args={spec.args}, varargs={spec.varargs}, keywords={spec.varkw}, "
    if spec.defaults:
        defaults = []
        for val in spec.defaults:
            text = str(val)
            defaults.append(f"{text.split(' at ')[0]} instance>" if " at 0x" in text else text)
        out += f"defaults={defaults}, "
    else:
        out += "defaults=None"
    return out


def module_golden(path: str, module: Any) -> str:
    members: list[tuple[str, str]] = []
    methods: list[tuple[str, str]] = []
    for name in sorted(dir(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        if (
            inspect.isfunction(obj)
            or inspect.isbuiltin(obj)
            or (callable(obj) and not inspect.isclass(obj) and hasattr(obj, "__wrapped__"))
        ):
            methods.append((name, argspec(obj)))
        else:
            members.append((name, _mtype(obj)))
    lines = [f'path: "{path}"', "tf_module {"]
    for name, mtype in members:
        lines += ["  member {", f'    name: "{name}"', f'    mtype: "{_escape(mtype)}"', "  }"]
    for name, spec in methods:
        lines += [
            "  member_method {",
            f'    name: "{name}"',
            f'    argspec: "{_escape(spec)}"',
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def proto_golden(path: str, message_cls: Any) -> str:
    from google.protobuf import descriptor_pb2, text_format

    proto = descriptor_pb2.DescriptorProto()
    message_cls.DESCRIPTOR.CopyToProto(proto)
    body = text_format.MessageToString(proto)
    inner = "".join(f"    {ln}\n" if ln else "\n" for ln in body.splitlines())
    return f'path: "{path}"\ntf_proto {{\n  descriptor {{\n{inner}  }}\n}}\n'


def render_all() -> dict[str, str]:
    import tensorflow as tf

    out: dict[str, str] = {}
    for golden, api_path, attr in GOLDENS:
        obj: Any = tf
        for part in attr.split("."):
            obj = getattr(obj, part)
        if inspect.isclass(obj) and hasattr(obj, "DESCRIPTOR"):
            out[f"{GOLDEN_DIR}/{golden}"] = proto_golden(api_path, obj)
        else:
            out[f"{GOLDEN_DIR}/{golden}"] = module_golden(api_path, obj)
    out["__tensorflow_file__"] = tf.__file__
    return out


if __name__ == "__main__":
    json.dump(render_all(), sys.stdout)
