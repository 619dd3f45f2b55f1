"""`tflms verify` against the real tensorflow-cpu 2.21.0 wheel (a, c, g; b is slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tflms.patch.generate import collect
from tflms.patch.proto_ext import CONFIG_PROTO, ProtoExtError, added_fields, extend_descriptor
from tflms.patch.report import render_report
from tflms.patch.unidiff import FileDiff, Hunk
from tflms.patch.verify import (
    FAIL,
    NA,
    PASS,
    FileCheck,
    VerifyResult,
    check_compile,
    check_hunks,
    run_verify,
)
from tflms.patch.wheel import find_wheel

VERSION = "2.21.0"
pytestmark = pytest.mark.tf


def _config_descriptor() -> bytes:
    import ast

    source = (find_wheel(VERSION) / "core/protobuf/config_pb2.py").read_text()
    start = source.index("AddSerializedFile(") + len("AddSerializedFile(")
    return ast.literal_eval(source[start : source.index(")\n", start)])


def _pool_with_dependencies(fdp: object) -> object:
    """A fresh descriptor pool holding every file `fdp` imports, transitively (from the
    wheel's own compiled modules, which importing its config_pb2 loads)."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from tensorflow.core.protobuf import config_pb2  # noqa: F401  (loads the imports)

    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        found = descriptor_pool.Default().FindFileByName(name)
        dep = descriptor_pb2.FileDescriptorProto()
        found.CopyToProto(dep)
        for sub in dep.dependency:
            add(sub)
        pool.Add(dep)
        added.add(name)

    for name in fdp.dependency:  # type: ignore[attr-defined]
        add(name)
    return pool


def test_config_proto_hunk_adds_five_free_fields_to_gpu_options_experimental() -> None:
    proto = next(f for f in collect(VERSION).files if f.path == CONFIG_PROTO)
    fields = added_fields(proto, _config_descriptor())
    assert [(f.message, f.name, f.number, f.type_name) for f in fields] == [
        ("tensorflow.GPUOptions.Experimental", "lms_enabled", 20, "TYPE_BOOL"),
        ("tensorflow.GPUOptions.Experimental", "lms_defrag_enabled", 21, "TYPE_BOOL"),
        ("tensorflow.GPUOptions.Experimental", "lms_limit_bytes", 22, "TYPE_INT64"),
        ("tensorflow.GPUOptions.Experimental", "lms_prefetch_enabled", 23, "TYPE_BOOL"),
        ("tensorflow.GPUOptions.Experimental", "lms_prefetch_lookahead", 24, "TYPE_INT32"),
    ]
    # Only the prefetch switch is declared `optional` (presence: unset means LMS's default).
    assert [f.name for f in fields if f.proto3_optional] == ["lms_prefetch_enabled"]
    extended = extend_descriptor(_config_descriptor(), fields)
    assert len(extended) > len(_config_descriptor())
    # As protoc records proto3 `optional`: a synthetic oneof of its own, and presence at run
    # time, so that an explicit False and an unset field differ.
    from google.protobuf import descriptor_pb2, message_factory

    fdp = descriptor_pb2.FileDescriptorProto.FromString(extended)
    gpu = next(m for m in fdp.message_type if m.name == "GPUOptions")
    exp = next(m for m in gpu.nested_type if m.name == "Experimental")
    by_name = {f.name: f for f in exp.field}
    assert by_name["lms_prefetch_enabled"].proto3_optional
    assert exp.oneof_decl[by_name["lms_prefetch_enabled"].oneof_index].name == (
        "_lms_prefetch_enabled"
    )
    assert not by_name["lms_enabled"].proto3_optional
    assert not by_name["lms_enabled"].HasField("oneof_index")
    pool: Any = _pool_with_dependencies(fdp)
    pool.AddSerializedFile(extended)
    cls = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tensorflow.GPUOptions.Experimental")
    )
    msg = cls()
    assert not msg.HasField("lms_prefetch_enabled")
    msg.lms_prefetch_enabled = False
    assert msg.HasField("lms_prefetch_enabled")
    assert msg.SerializeToString() == b"\xb8\x01\x00"
    clash = [type(fields[0])(fields[0].message, "lms_enabled", 19, "TYPE_BOOL")]
    with pytest.raises(ProtoExtError, match="clashes with existing field stream_merge_options"):
        extend_descriptor(_config_descriptor(), clash)


def test_hunks_apply_to_the_wheel_and_a_broken_one_is_caught(tmp_path: Path) -> None:
    files = collect(VERSION).files
    checks = {f.path: FileCheck(f.path, f.new_file, f.added, f.removed) for f in files}
    patched = check_hunks(files, checks, find_wheel(VERSION), tmp_path)
    config = checks["tensorflow/python/framework/config.py"]
    assert config.a == PASS and all(h.status == PASS for h in config.hunks)
    assert "def set_lms_enabled(enable):" in patched["tensorflow/python/framework/config.py"]
    assert checks["tensorflow/python/BUILD"].a == NA  # not in the wheel
    # A hunk whose context is not in the wheel's file fails, and says so.
    bad = FileDiff(
        "tensorflow/python/eager/context.py",
        [Hunk(10, 1, 10, 2, [" this line is not in context.py", "+added"], origin="t")],
    )
    bad_checks = {bad.path: FileCheck(bad.path, False, 1, 0)}
    check_hunks([bad], bad_checks, find_wheel(VERSION), tmp_path)
    assert bad_checks[bad.path].a == FAIL
    assert bad_checks[bad.path].hunks[0].status == FAIL


def test_verify_python_half_and_goldens_and_report(tmp_path: Path) -> None:
    result = run_verify(VERSION, work=tmp_path, compile_cpp=False)
    failing = {c["name"]: c["detail"] for c in result.python_checks if not c["ok"]}
    assert not failing, failing
    assert len(result.python_checks) >= 9
    assert result.python_tests and all(t["ok"] for t in result.python_tests), result.python_tests
    by_path = {f.path: f for f in result.files}
    assert by_path["tensorflow/python/framework/config.py"].c == PASS
    assert by_path["tensorflow/core/protobuf/config.proto"].c == PASS
    goldens = [f for f in result.files if f.path.startswith("tensorflow/tools/api/golden/")]
    assert len(goldens) == 6 and all(f.g == PASS for f in goldens)
    assert result.problems == ["b) skipped (--no-compile)"]
    report = render_report(result)
    assert "## Not checked here" in report
    not_checked = report.split("## Not checked here", 1)[1].split("## ", 1)[0]
    assert "`tensorflow/python/BUILD`" in not_checked
    assert "`tensorflow/python/framework/config.py`" not in not_checked
    assert "| `tensorflow/python/framework/config.py` | changed |" in report


@pytest.mark.parametrize("jobs", [1, 2])
def test_compiles_of_both_configurations_share_one_pool_and_report_in_order(
    tmp_path: Path, jobs: int
) -> None:
    # Real compiles (g++ with the wheel's flags) of three small files from one pool for
    # both configurations, engine files last: the report still lists them by
    # configuration, then file, and a file that fails under one configuration only is a
    # failure named by that configuration.
    gpu = "tensorflow/core/common_runtime/gpu"
    adapter = "int A() { return 2; }\n#if GOOGLE_CUDA\nint B() { return no_such_name; }\n#endif\n"
    header = (
        "#ifndef LMS_ADAPTER_H_\n#define LMS_ADAPTER_H_\ninline int C() { return 3; }\n#endif\n"
    )
    files = [
        FileDiff(
            f"{gpu}/lms/core/src/engine_part.cc", new_file=True, content="int E() { return 1; }\n"
        ),
        FileDiff(f"{gpu}/lms_adapter.cc", new_file=True, content=adapter),
        FileDiff(f"{gpu}/lms_adapter.h", new_file=True, content=header),
    ]
    checks = {f.path: FileCheck(f.path, True, f.added, 0) for f in files}
    result = VerifyResult(version=VERSION, wheel="", files=list(checks.values()), stale=None)
    ticks: list[str] = []
    check_compile(files, checks, {}, tmp_path, jobs, result, ticks.append)
    assert not result.problems
    assert [(c["path"], c["cuda"]) for c in result.compile_summary] == [
        (f.path, cuda) for cuda in (False, True) for f in files
    ]
    assert [c["ok"] for c in result.compile_summary] == [True, True, True, True, False, True]
    assert checks[files[0].path].b == PASS and checks[files[2].path].b == PASS
    failed = checks[files[1].path]
    assert failed.b == FAIL
    assert len(failed.notes) == 1 and failed.notes[0].startswith("GOOGLE_CUDA: "), failed.notes
    assert "no_such_name" in failed.notes[0]
    assert sorted(ticks) == sorted(
        f"b) {label}: {Path(f.path).name}"
        for label in ("no GOOGLE_CUDA", "GOOGLE_CUDA")
        for f in files
    )
    if jobs == 1:  # one compile at a time: they end in the order the pool was given them
        assert ticks == [
            f"b) {label}: {name}"
            for label, name in [
                ("no GOOGLE_CUDA", "lms_adapter.cc"),
                ("no GOOGLE_CUDA", "lms_adapter.h"),
                ("GOOGLE_CUDA", "lms_adapter.cc"),
                ("GOOGLE_CUDA", "lms_adapter.h"),
                ("no GOOGLE_CUDA", "engine_part.cc"),
                ("GOOGLE_CUDA", "engine_part.cc"),
            ]
        ]


def test_a_header_its_own_source_includes_first_is_judged_by_that_compile(
    tmp_path: Path,
) -> None:
    # Real compiles. A new header whose new .cc includes it first is not compiled alone:
    # the .cc's compiles judge it, its warnings included (the patch's new files are on
    # -I, not -isystem), in both configurations. A header its .cc includes after
    # something else, or under an #if, is still compiled alone: it may not be
    # self-contained, or not compiled in both configurations.
    gpu = "tensorflow/core/common_runtime/gpu"

    def guarded(name: str, body: str) -> str:
        return f"#ifndef {name}_H_\n#define {name}_H_\n{body}#endif\n"

    files = [
        FileDiff(
            f"{gpu}/lms_warns.h",
            new_file=True,
            content=guarded("WARNS", "inline int W() { int unused = 1; return 0; }\n"),
        ),
        FileDiff(
            f"{gpu}/lms_warns.cc",
            new_file=True,
            content=f'#include "{gpu}/lms_warns.h"\nint P() {{ return W(); }}\n',
        ),
        FileDiff(f"{gpu}/lms_clean.h", new_file=True, content=guarded("CLEAN", "int C();\n")),
        FileDiff(
            f"{gpu}/lms_clean.cc",
            new_file=True,
            content='#include "lms_clean.h"\nint C() { return 3; }\n',
        ),
        FileDiff(f"{gpu}/lms_cuda.h", new_file=True, content=guarded("CUDA", "int G();\n")),
        FileDiff(
            f"{gpu}/lms_cuda.cc",
            new_file=True,
            content='#if GOOGLE_CUDA\n#include "lms_cuda.h"\n#endif\nint G() { return 5; }\n',
        ),
        FileDiff(f"{gpu}/lms_late.h", new_file=True, content=guarded("LATE", "int L();\n")),
        FileDiff(
            f"{gpu}/lms_late.cc",
            new_file=True,
            content=f'#include <cstddef>\n#include "{gpu}/lms_late.h"\nint L() {{ return 4; }}\n',
        ),
    ]
    checks = {f.path: FileCheck(f.path, True, f.added, 0) for f in files}
    result = VerifyResult(version=VERSION, wheel="", files=list(checks.values()), stale=None)
    check_compile(files, checks, {}, tmp_path, 2, result)
    assert not result.problems
    compiled = {Path(str(c["path"])).name for c in result.compile_summary}
    assert compiled == {
        "lms_warns.cc", "lms_clean.cc", "lms_cuda.cc", "lms_cuda.h", "lms_late.cc", "lms_late.h"
    }  # fmt: skip
    assert len(result.compile_summary) == 12  # each in both configurations
    warns_cc, warns_h = checks[f"{gpu}/lms_warns.cc"], checks[f"{gpu}/lms_warns.h"]
    assert warns_cc.b == FAIL and all("unused" in note for note in warns_cc.notes), warns_cc
    assert warns_h.b == FAIL
    assert warns_h.notes == ["compiled as the first include of lms_warns.cc, warnings counted"]
    assert checks[f"{gpu}/lms_clean.h"].b == PASS and checks[f"{gpu}/lms_clean.cc"].b == PASS
    assert checks[f"{gpu}/lms_late.h"].b == PASS and checks[f"{gpu}/lms_late.h"].notes == []


@pytest.mark.slow
def test_full_verify_including_compiles(tmp_path: Path) -> None:
    result = run_verify(VERSION, work=tmp_path, jobs=2)
    failing = [(f.path, f.notes) for f in result.files if f.failed]
    assert not failing, failing
    assert result.ok, result.problems


def test_reports_per_tag_and_delegation_only_for_another_tensorflow() -> None:
    import argparse

    from tflms.patch import SUPPORTED_VERSIONS
    from tflms.patch.cli import _verify_in_tag_venv, default_report

    assert default_report(VERSION).as_posix().endswith("docs/verification.md")
    for version in SUPPORTED_VERSIONS[:-1]:
        assert default_report(version).name == f"verification-v{version}.md"
    assert default_report(VERSION, nightly=True).name == "verification-nightly.md"
    # This environment has the newest tag's wheel: it verifies in process.
    args = argparse.Namespace(tf_version=VERSION, nightly=False)
    assert _verify_in_tag_venv(args) is None


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.20.0", "2.19.1"])
def test_older_tag_verifies_in_its_own_environment(tmp_path: Path, version: str) -> None:
    """a), c) and g) against the tag's own wheel (its venv must exist: make verify-all)."""
    import subprocess
    import sys

    from tflms.patch.wheel import tag_python

    if not tag_python(version).is_file():
        pytest.skip(f"no environment for {version}; `make verify-all` creates it")
    report = tmp_path / "report.md"
    proc = subprocess.run(
        [sys.executable, "-m", "tflms", "verify", "--tf-version", version, "--no-compile",
         "--report", str(report), "--log", str(tmp_path / "log")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert f"verifying TensorFlow {version} with {tag_python(version)}" in proc.stderr
    text = report.read_text()
    assert f"for TensorFlow {version} against the official" in text
    assert "; failing: 0" in text and "| **FAIL** |" not in text, text  # Overall: b) not run
    assert proc.returncode == 1  # only because b) was skipped
    assert "b) skipped (--no-compile)" in proc.stderr
