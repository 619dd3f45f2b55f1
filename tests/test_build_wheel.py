"""`tflms build-wheel`: pre-flight checks, dry run, resume, failures and wheel labelling.

No network and no real bazel: the TensorFlow "remote" is a local git repository with a v2.21.0
tag, and `bazelisk` is a small script on PATH that writes the wheel bazel would write (and
fails on request), so every stage of the pipeline runs for real around it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import inspect
import io
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tflms.build import preflight
from tflms.build.preflight import HostFacts, Requirements, TreeFacts, run_checks
from tflms.build.runner import bazel_progress, first_error, git_progress
from tflms.build.wheel import BuildOptions, WheelBuilder, bazel_build_args, build_wheel
from tflms.build.wheel_label import WheelName, relabel_wheel, wheel_metadata_version

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
CP = "cp" + PY.replace(".", "")


# ---- helpers ----


def make_wheel(path: Path, name: str, version: str) -> Path:
    """A minimal valid wheel: one module, METADATA, WHEEL and a correct RECORD."""
    files = {
        f"{name}_pkg/__init__.py": b"VALUE = 42\n",
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA test wheel.\n"
        ).encode(),
        f"{name}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n"
        ),
    }
    rows = []
    for arc, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{arc},sha256={digest},{len(data)}")
    rows.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(rows) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for arc, data in files.items():
            zf.writestr(arc, data)
    return path


FAKE_BAZELISK = textwrap.dedent(
    """\
    #!{python}
    # Stands in for bazelisk: checks the patch is in the tree and writes the wheel bazel would.
    import base64, hashlib, os, pathlib, sys, zipfile
    from pathlib import Path

    {make_wheel}

    args = sys.argv[1:]
    env = dict(a.split("=", 1)[1].split("=", 1) for a in args if a.startswith("--repo_env="))
    with open({counter!r}, "a") as f:
        f.write(" ".join(args) + "\\n")
    if os.environ.get("FAKE_BAZEL_FAIL"):
        print("INFO: Analyzed target //tensorflow/tools/pip_package:wheel")
        print("[1,024 / 9,000] Compiling tensorflow/core/kernels/conv_ops.cc")
        print("ERROR: /src/tensorflow/core/BUILD:12:1: Compiling lms_allocator.cc failed")
        print("lms_allocator.cc:7:3: error: 'Foo' was not declared in this scope")
        sys.exit(1)
    if not pathlib.Path("tensorflow/lms_marker.txt").exists():
        print("ERROR: the LMS patch is not in the tree")
        sys.exit(1)
    for i in range(1, 5):
        print(f"[{{i * 2500:,}} / 10,000] Compiling file{{i}}.cc")
    suffix = ".dev0+selfbuilt"  # TensorFlow's default (snapshot) suffix
    if env.get("ML_WHEEL_TYPE") == "release":
        suffix = env.get("ML_WHEEL_VERSION_SUFFIX", "")
    py = "cp" + env["HERMETIC_PYTHON_VERSION"].replace(".", "")
    house = pathlib.Path("bazel-bin/tensorflow/tools/pip_package/wheel_house")
    name = env["WHEEL_NAME"]
    wheel = f"{{name}}-2.21.0{{suffix}}-{{py}}-{{py}}-linux_x86_64.whl"
    make_wheel(house / wheel, name, "2.21.0" + suffix)
    """
)


def make_wheel_source() -> str:
    return inspect.getsource(make_wheel)  # top-level, so it needs no re-indenting


def git(*args: str, cwd: Path) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "PATH": "/usr/bin:/bin",
        "HOME": str(cwd),
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def make_tf_remote(root: Path, suffix_rule: bool = True) -> Path:
    """A git repository shaped like TensorFlow 2.21.0 where the build reads it."""
    repo = root / "tf-remote"
    (repo / "tensorflow").mkdir(parents=True)
    (repo / "tensorflow" / "tf_version.bzl").write_text('TF_VERSION = "2.21.0"\n')
    rule = "python_wheel_version_suffix_repository(name = 'tf_wheel_version_suffix')\n"
    (repo / "WORKSPACE").write_text(rule if suffix_rule else "# no suffix rule\n")
    git("init", "-q", "-b", "master", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "TensorFlow 2.21.0", cwd=repo)
    git("tag", "v2.21.0", cwd=repo)
    return repo


def make_patch(root: Path) -> Path:
    patch = root / "tensorflow_v2.21.0_large_model_support.patch"
    patch.write_text(
        "diff --git a/tensorflow/lms_marker.txt b/tensorflow/lms_marker.txt\n"
        "new file mode 100644\n"
        "--- /dev/null\n"
        "+++ b/tensorflow/lms_marker.txt\n"
        "@@ -0,0 +1 @@\n"
        "+LMS\n"
    )
    return patch


class GitApplyBuilder(WheelBuilder):
    """The pipeline with `git apply` in place of the project's patch tool (tested on its own)."""

    def apply_patch(self, src: Path, tf_version: str) -> None:
        subprocess.run(["git", "apply", str(self.opts.patch)], cwd=src, check=True)


@pytest.fixture
def build_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    counter = tmp_path / "bazel-calls"
    counter.touch()
    script = bin_dir / "bazelisk"
    script.write_text(
        FAKE_BAZELISK.format(python=sys.executable, make_wheel=make_wheel_source(),
                             counter=str(counter))
    )  # fmt: skip
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return {"remote": make_tf_remote(tmp_path), "patch": make_patch(tmp_path),
            "counter": counter, "out": tmp_path / "out"}  # fmt: skip


def options(env: dict[str, Path], **kw: object) -> BuildOptions:
    base: dict[str, object] = {
        "variant": "cpu",
        "tf_repo_url": "file://" + str(env["remote"]),
        "output": env["out"],
        "patch_file": env["patch"],
        "min_disk_gib": 0.0,
        "min_mem_gib": 0.0,
        "show_progress": False,
    }
    base.update(kw)
    return BuildOptions(**base)  # type: ignore[arg-type]


def run(
    env: dict[str, Path], capsys: pytest.CaptureFixture[str], **kw: object
) -> tuple[int, str, str]:
    builder = GitApplyBuilder(options(env, **kw))
    try:
        builder.run()
        rc = 0
    except Exception as exc:  # noqa: BLE001 - the CLI turns these into messages
        print(str(exc), file=sys.stderr)
        rc = 1
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def bazel_calls(env: dict[str, Path]) -> int:
    return len(env["counter"].read_text().splitlines())


# ---- pre-flight checks (pure) ----


def good_facts(tmp_path: Path) -> HostFacts:
    return HostFacts(
        tools={"git": "/usr/bin/git", "bazelisk": "/usr/bin/bazelisk", "bazel": None,
               "docker": "/usr/bin/docker"},
        disk_free_bytes=500 * GIB,
        disk_path=tmp_path,
        mem_total_bytes=64 * GIB,
        python_version=(3, 11),
        remote_tags=frozenset({"v2.21.0"}),
    )  # fmt: skip


def good_req(tmp_path: Path, **kw: object) -> Requirements:
    patch = tmp_path / "p.patch"
    patch.write_text("x")
    base: dict[str, object] = {
        "tf_version": "2.21.0",
        "variant": "cuda",
        "docker": False,
        "jobs": 0,
        "tf_source_given": False,
        "patch_file": patch,
    }
    base.update(kw)
    return Requirements(**base)  # type: ignore[arg-type]


def messages(req: Requirements, facts: HostFacts) -> list[str]:
    return [p.message for p in run_checks(req, facts) if p.fatal]


def test_a_good_host_passes(tmp_path: Path) -> None:
    assert run_checks(good_req(tmp_path), good_facts(tmp_path)) == []
    results = preflight.check_results(good_req(tmp_path), good_facts(tmp_path))
    assert [(r.name, r.problems, r.summary.split(":")[0]) for r in results] == [
        ("tools", [], "ok"), ("python", [], "ok"), ("patch", [], "ok"), ("disk", [], "ok"),
        ("memory", [], "ok"), ("tag", [], "ok"), ("tree", [], "not needed"),
    ]  # fmt: skip
    assert results[0].summary == "ok: git at /usr/bin/git, bazelisk at /usr/bin/bazelisk"


def test_each_missing_tool_is_named_with_what_to_install(tmp_path: Path) -> None:
    facts = good_facts(tmp_path)
    facts.tools = {"git": None, "bazelisk": None, "bazel": None, "docker": None}
    msgs = messages(good_req(tmp_path), facts)
    assert any("git was not found" in m and "apt-get install git" in m for m in msgs)
    assert any("bazelisk" in m and "--docker" in m for m in msgs)
    docker = messages(good_req(tmp_path, docker=True), facts)
    assert any("docker was not found" in m and "drop --docker" in m for m in docker)
    facts.tools = {"git": "/g", "bazelisk": None, "bazel": None, "docker": "/d"}
    facts.docker_error = "Cannot connect to the Docker daemon"
    daemon = messages(good_req(tmp_path, docker=True), facts)
    assert daemon and "start the Docker daemon" in daemon[0]


def test_plain_bazel_is_a_warning_not_an_error(tmp_path: Path) -> None:
    facts = good_facts(tmp_path)
    facts.tools = {"git": "/g", "bazelisk": None, "bazel": "/usr/bin/bazel", "docker": None}
    problems = run_checks(good_req(tmp_path), facts)
    assert [(p.check, p.fatal) for p in problems] == [("bazelisk", False)]


def test_disk_memory_and_jobs_limits(tmp_path: Path) -> None:
    facts = good_facts(tmp_path)
    facts.disk_free_bytes = 10 * GIB
    msgs = messages(good_req(tmp_path), facts)
    assert len(msgs) == 1 and "10.0 GiB free" in msgs[0] and "needs 60 GiB" in msgs[0]
    assert messages(good_req(tmp_path, variant="cpu", min_disk_gib=5), facts) == []
    facts = good_facts(tmp_path)
    facts.mem_total_bytes = 8 * GIB
    assert "at least 16 GiB" in messages(good_req(tmp_path), facts)[0]
    facts.mem_total_bytes = 32 * GIB
    warn = run_checks(good_req(tmp_path, jobs=64), facts)
    assert [p.fatal for p in warn] == [False] and "--jobs 16" in warn[0].message


def test_python_patch_and_tag_checks(tmp_path: Path) -> None:
    facts = good_facts(tmp_path)
    facts.python_version = (3, 8)
    assert "running Python (3.8)" in messages(good_req(tmp_path), facts)[0]
    facts = good_facts(tmp_path)
    missing = good_req(tmp_path, patch_file=tmp_path / "nope.patch")
    assert "no LMS patch for TensorFlow 2.21.0" in messages(missing, facts)[0]
    assert "tflms has patches for these tags: none" in messages(missing, facts)[0]
    (tmp_path / "tensorflow_v2.21.0_large_model_support.patch").write_text("x")
    assert "for these tags: v2.21.0. Pass one" in messages(missing, facts)[0]
    assert "has no tag v2.99.0" in messages(good_req(tmp_path, tf_version="2.99.0"), facts)[0]
    facts.remote_tags, facts.remote_error = None, "Could not resolve host: github.com"
    assert "--tf-source DIR" in messages(good_req(tmp_path), facts)[0]


def test_tree_checks(tmp_path: Path) -> None:
    facts = good_facts(tmp_path)
    req = good_req(tmp_path, tf_source_given=True)
    facts.tree = TreeFacts(tmp_path / "tf", exists=False)
    assert "does not exist" in messages(req, facts)[0]
    facts.tree = TreeFacts(tmp_path, exists=True, is_git=False)
    assert "not a git checkout" in messages(req, facts)[0]
    facts.tree = TreeFacts(tmp_path, exists=True, is_git=True, dirty_files=["a.cc"],
                           tf_version="2.20.0")  # fmt: skip
    msgs = messages(req, facts)
    assert any("TensorFlow 2.20.0, not 2.21.0" in m for m in msgs)
    assert any("uncommitted changes (a.cc)" in m and "git stash" in m for m in msgs)
    assert messages(good_req(tmp_path, tf_source_given=True, allow_dirty=True), facts) == [
        m for m in msgs if "uncommitted" not in m
    ]


# ---- facts from the real environment ----


def test_facts_see_missing_git_through_path(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    req = good_req(tmp_path)
    facts = preflight.gather_facts(
        req, output_dir=tmp_path / "out", tf_repo_url="x", tf_source=None, query_remote=True,
        env={"PATH": str(tmp_path / "empty")},
    )  # fmt: skip
    assert facts.tools["git"] is None and facts.remote_tags is None
    assert any("git was not found" in m for m in messages(req, facts))
    assert facts.disk_free_bytes > 0 and facts.mem_total_bytes > GIB


def test_facts_list_remote_tags_and_dirty_trees(tmp_path: Path) -> None:
    remote = make_tf_remote(tmp_path)
    url = "file://" + str(remote)
    assert preflight.remote_tag_facts(url, "v2.21.0") == (frozenset({"v2.21.0"}), None)
    assert preflight.remote_tag_facts(url, "v9.9.9") == (frozenset(), None)
    tags, error = preflight.remote_tag_facts("file://" + str(tmp_path / "none"), "v2.21.0")
    assert tags is None and error
    (remote / "WORKSPACE").write_text("changed\n")
    tree = preflight.tree_facts(remote)
    assert tree.is_git and tree.dirty_files == ["WORKSPACE"] and tree.tf_version == "2.21.0"


# ---- progress and errors ----


def test_progress_parsers_and_first_error(tmp_path: Path) -> None:
    assert bazel_progress("[1,024 / 8,192] Compiling x.cc") == (1024.0, 8192.0)
    assert bazel_progress("INFO: Analyzed") is None
    assert git_progress("Receiving objects:  50% (5/10)") == (50.0, 300.0)
    assert git_progress("Resolving deltas: 100% (3/3)") == (200.0, 300.0)
    log = tmp_path / "build.log"
    log.write_text("INFO: ok\nWARNING: meh\nERROR: /a/BUILD:1:1: C++ failed\nx.cc:1: error: y\n")
    assert first_error(log, context=1) == "ERROR: /a/BUILD:1:1: C++ failed\nx.cc:1: error: y"
    log.write_text("all good\n")
    assert first_error(log) is None


# ---- wheel labels ----


def test_relabel_rewrites_name_metadata_and_record(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "demo-2.21.0.dev0+selfbuilt-py3-none-any.whl", "demo",
                     "2.21.0.dev0+selfbuilt")  # fmt: skip
    out = relabel_wheel(src, tmp_path / "dist", "lms")
    assert out.name == "demo-2.21.0.dev0+lms-py3-none-any.whl"
    assert wheel_metadata_version(out) == "2.21.0.dev0+lms"
    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
        assert "demo-2.21.0.dev0+lms.dist-info/METADATA" in names
        assert not any("selfbuilt" in n for n in names)
        record = zf.read("demo-2.21.0.dev0+lms.dist-info/RECORD").decode()
        for path, digest, size in csv.reader(io.StringIO(record)):
            if not digest:
                continue
            data = zf.read(path)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == "sha256=" + want and int(size) == len(data)
    # pip accepts it and records the labelled version.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(target), str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert (target / "demo-2.21.0.dev0+lms.dist-info" / "METADATA").is_file()
    with pytest.raises(ValueError, match="PEP 440"):
        relabel_wheel(src, tmp_path / "dist", "LMS-1")


def test_wheel_names_parse_with_and_without_build_tag() -> None:
    a = WheelName.parse("tensorflow-2.21.0+lms-cp311-cp311-manylinux_2_27_x86_64.whl")
    assert (a.name, a.version, a.build, a.local) == ("tensorflow", "2.21.0+lms", None, "lms")
    b = WheelName.parse("tensorflow-2.21.0-1-cp311-cp311-linux_x86_64.whl")
    assert b.build == "1" and b.filename == "tensorflow-2.21.0-1-cp311-cp311-linux_x86_64.whl"


# ---- bazel arguments ----


def test_bazel_arguments_follow_tensorflow_release_jobs() -> None:
    cuda_docker = bazel_build_args(BuildOptions(variant="cuda", docker=True, python_version="3.12"))
    assert cuda_docker[:3] == ["--repo_env=HERMETIC_PYTHON_VERSION=3.12",
                               "--config=release_gpu_linux", "--config=cuda_wheel"]  # fmt: skip
    assert "--repo_env=WHEEL_NAME=tensorflow" in cuda_docker
    assert "--repo_env=ML_WHEEL_VERSION_SUFFIX=+lms" in cuda_docker
    host_cpu = bazel_build_args(BuildOptions(variant="cpu", cuda_version="12.8.1"), False)
    assert "--repo_env=WHEEL_NAME=tensorflow_cpu" in host_cpu
    assert not any("cuda" in a.lower() for a in host_cpu)
    assert not any("ML_WHEEL" in a for a in host_cpu)
    host_cuda = bazel_build_args(BuildOptions(variant="cuda", cuda_version="12.8.1"))
    assert "--config=cuda" in host_cuda and "--repo_env=HERMETIC_CUDA_VERSION=12.8.1" in host_cuda


# ---- the pipeline ----


def test_dry_run_prints_every_command_and_runs_none(
    build_env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(build_env, capsys, dry_run=True)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.startswith("+ ")]
    src = str(build_env["out"].absolute() / "tensorflow")
    assert [line.split()[1:3] for line in lines] == [
        ["git", "ls-remote"], ["git", "clone"], ["tflms", "patch"], ["cd", src],
    ]  # fmt: skip
    assert "bazelisk build" in lines[-1] and "//tensorflow/tools/pip_package:wheel" in lines[-1]
    assert not build_env["out"].exists() and bazel_calls(build_env) == 0
    rc, out, _ = run(build_env, capsys, dry_run=True, docker=True, variant="cuda")
    docker = [line for line in out.splitlines() if line.startswith("+ docker")]
    assert docker[0].startswith("+ docker pull ") and "--config=release_gpu_linux" in docker[1]
    assert "--repo_env=WHEEL_NAME=tensorflow " in docker[1]


def test_build_resumes_and_redoes_only_what_changed(
    build_env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(build_env, capsys)
    assert rc == 0, err
    wheel = build_env["out"] / "dist" / f"tensorflow_cpu-2.21.0+lms-{CP}-{CP}-linux_x86_64.whl"
    assert wheel.is_file() and wheel_metadata_version(wheel) == "2.21.0+lms"
    assert f"pip install {wheel}" in out
    assert (build_env["out"] / "logs" / "build.log").read_text().count("Compiling") == 4
    assert bazel_calls(build_env) == 1

    rc, out, err = run(build_env, capsys)
    assert rc == 0, err
    assert out.count("already done") == 5 and bazel_calls(build_env) == 1

    rc, out, err = run(build_env, capsys, label="lms.v2")
    assert rc == 0, err
    assert "[clone] already done" in out and "[apply] already done" in out
    assert "[build] already done" not in out and bazel_calls(build_env) == 2
    assert (
        build_env["out"] / "dist" / f"tensorflow_cpu-2.21.0+lms.v2-{CP}-{CP}-linux_x86_64.whl"
    ).is_file()


def test_failed_build_points_at_the_log_and_first_error(
    build_env: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BAZEL_FAIL", "1")
    rc, _, err = run(build_env, capsys)
    assert rc == 1
    assert str(build_env["out"] / "logs" / "build.log") in err
    assert "ERROR: /src/tensorflow/core/BUILD:12:1: Compiling lms_allocator.cc failed" in err
    monkeypatch.delenv("FAKE_BAZEL_FAIL")
    rc, out, err = run(build_env, capsys)
    assert rc == 0, err
    assert "[clone] already done" in out and "[apply] already done" in out


def test_checkout_without_suffix_rule_is_relabelled_after_the_build(
    tmp_path: Path, build_env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build_env["remote"] = make_tf_remote(tmp_path / "old", suffix_rule=False)
    rc, out, err = run(build_env, capsys)
    assert rc == 0, err
    assert "added to the wheel after the build" in out
    (wheel,) = (build_env["out"] / "dist").glob("*.whl")
    assert wheel.name.startswith("tensorflow_cpu-2.21.0.dev0+lms-")
    assert wheel_metadata_version(wheel) == "2.21.0.dev0+lms"


def test_dirty_tf_source_stops_before_anything_runs(
    build_env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (build_env["remote"] / "WORKSPACE").write_text("local edit\n")
    rc, _, err = run(build_env, capsys, tf_source=build_env["remote"])
    assert rc == 1 and "uncommitted changes (WORKSPACE)" in err and "nothing was started" in err
    assert bazel_calls(build_env) == 0


def test_cli_reports_missing_tools_without_network(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tflms", "build-wheel", "--cpu", "--output", str(tmp_path / "o"),
         "--min-disk-gb", "0", "--min-mem-gb", "0"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": str(tmp_path / "empty"), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "pre-flight git: error: git was not found" in proc.stderr
    assert "pre-flight bazelisk: error:" in proc.stderr
    assert "nothing was started" in proc.stderr


def test_build_wheel_script_dry_run(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bazelisk").write_text("#!/bin/sh\nexit 0\n")  # never run by a dry run
    (bin_dir / "bazelisk").chmod(0o755)
    proc = subprocess.run(
        [str(REPO / "scripts" / "build_wheel.sh"), "--cpu", "--dry-run", "--no-progress",
         "--output", str(tmp_path / "o"), "--tf-repo", "file:///nonexistent",
         "--min-disk-gb", "0", "--min-mem-gb", "0"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "TFLMS_PYTHON": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "+ git clone --depth 1 --branch v2.21.0" in proc.stdout
    assert "--repo_env=WHEEL_NAME=tensorflow_cpu" in proc.stdout
    assert "pre-flight patch: ok: " in proc.stderr


def test_dry_run_fails_after_printing_every_check_and_command(
    build_env: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, _, err = run(build_env, capsys, dry_run=True)
    assert rc == 0, err
    checks = [line.split(":")[0] for line in err.splitlines() if line.startswith("pre-flight ")]
    names = ["tools", "python", "patch", "disk", "memory", "tag", "tree"]
    assert checks == [f"pre-flight {n}" for n in names]
    assert f"pre-flight patch: ok: {build_env['patch']}" in err

    # No bazelisk and a version without a patch: both are reported, every command is still
    # printed, and the run fails so that scripts can rely on the exit status.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    missing = build_env["out"] / "patches" / "tensorflow_v2.99.0_large_model_support.patch"
    rc, out, err = run(build_env, capsys, dry_run=True, tf_version="2.99.0", patch_file=missing)
    assert rc == 1
    assert "pre-flight bazelisk: a real run would stop here: neither bazelisk" in err
    assert "pre-flight patch: a real run would stop here: no LMS patch for TensorFlow 2.99.0" in err
    assert "pre-flight python: ok: " in err and "pre-flight tree: not needed" in err
    assert "dry run: 2 pre-flight check(s) would stop a real run (bazelisk, patch)" in err
    assert "+ git clone --depth 1 --branch v2.99.0" in out and "bazelisk build" in out
    assert not build_env["out"].exists() and bazel_calls(build_env) == 0


def test_cli_dry_run_names_the_tags_that_have_a_patch(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tflms", "build-wheel", "--tf-version", "2.99.0", "--cpu",
         "--dry-run", "--no-progress", "--output", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "no LMS patch for TensorFlow 2.99.0 (tag v2.99.0)" in proc.stderr
    assert "tflms has patches for these tags: v2.19.1, v2.20.0, v2.21.0." in proc.stderr
    assert "would stop a real run" in proc.stderr.splitlines()[-1]


def test_build_wheel_turns_apply_failures_into_a_message(
    build_env: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # The project's apply tool gets our fake tree: whether it is missing or refuses the tree,
    # the user sees one line naming the cause, not a traceback, and nothing is built.
    rc = build_wheel(options(build_env), out=io.StringIO())
    err = capsys.readouterr().err
    assert rc == 1
    assert "tflms build-wheel: " in err and "Traceback" not in err
    assert "did not apply" in err or "apply tool" in err
    assert bazel_calls(build_env) == 0


@pytest.mark.parametrize("version", ["2.19.1", "2.20.0"])
def test_cli_dry_run_finds_the_patch_of_an_older_tag(tmp_path: Path, version: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tflms", "build-wheel", "--tf-version", version, "--cpu",
         "--dry-run", "--no-progress", "--output", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    patch = REPO / "patches" / f"tensorflow_v{version}_large_model_support.patch"
    assert f"pre-flight patch: ok: {patch}" in proc.stderr.splitlines(), proc.stderr
    assert f"+ git clone --depth 1 --branch v{version}" in proc.stdout


def test_python_versions_follow_the_release() -> None:
    assert preflight.supported_python("2.19.1")[-1] == (3, 12)
    assert (3, 13) in preflight.supported_python("2.20.0")
    assert preflight.supported_python("2.21.0") == preflight.SUPPORTED_PYTHON
