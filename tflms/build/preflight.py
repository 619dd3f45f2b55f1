"""Pre-flight checks for `tflms build-wheel`, run before anything long starts.

The checks are pure functions over a `HostFacts` record, so tests can drive every failure with
real temporary directories and PATH settings; `gather_facts` collects the facts from the real
machine. Every failed check is one `Problem` whose message says what to install or free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3

# Estimated needs of a TensorFlow wheel build (source, bazel output base, downloaded hermetic
# CUDA/cuDNN/Python, the wheel), generous so a build does not die near its end. Not measured on
# our own machines, which cannot build TensorFlow; docs/building.md says so.
DISK_GIB = {"cuda": 60, "cpu": 35}
MEMORY_GIB = 16
MEMORY_GIB_PER_JOB = 2

# Python versions TensorFlow 2.21's hermetic Python rules provide wheels for.
SUPPORTED_PYTHON = ((3, 10), (3, 11), (3, 12), (3, 13))
# The same for older releases, by major.minor: the cp tags of their tensorflow-cpu wheels on
# PyPI (2.19: cp39 to cp312; 2.20: cp39 to cp313). A release not listed gets SUPPORTED_PYTHON.
SUPPORTED_PYTHON_BY_RELEASE = {
    "2.19": ((3, 9), (3, 10), (3, 11), (3, 12)),
    "2.20": ((3, 9), (3, 10), (3, 11), (3, 12), (3, 13)),
}


def supported_python(tf_version: str) -> tuple[tuple[int, int], ...]:
    """The Python versions TensorFlow `tf_version` builds wheels for."""
    release = ".".join(tf_version.split(".")[:2])
    return SUPPORTED_PYTHON_BY_RELEASE.get(release, SUPPORTED_PYTHON)


@dataclass(frozen=True)
class Problem:
    check: str
    message: str
    fatal: bool = True


@dataclass
class TreeFacts:
    """What we know about a TensorFlow checkout given with --tf-source."""

    path: Path
    exists: bool
    is_git: bool = False
    dirty_files: list[str] = field(default_factory=list)
    tf_version: str | None = None  # TF_VERSION read from tensorflow/tf_version.bzl


@dataclass
class HostFacts:
    tools: Mapping[str, str | None]  # tool name -> resolved path (None when missing)
    disk_free_bytes: int
    disk_path: Path
    mem_total_bytes: int
    python_version: tuple[int, int]
    docker_error: str | None = None  # why `docker info` failed; None when it worked/not asked
    remote_tags: frozenset[str] | None = None  # tags found at the remote; None = not queried
    remote_error: str | None = None  # why the remote could not be queried
    tree: TreeFacts | None = None


@dataclass
class Requirements:
    tf_version: str
    variant: str  # "cuda" or "cpu"
    docker: bool
    jobs: int
    tf_source_given: bool
    patch_file: Path
    min_disk_gib: float | None = None  # None: DISK_GIB[variant]
    min_mem_gib: float | None = None  # None: MEMORY_GIB
    allow_dirty: bool = False
    tree_already_patched: bool = False  # the resume file says our apply stage ran on it

    @property
    def tag(self) -> str:
        return "v" + self.tf_version

    @property
    def disk_gib(self) -> float:
        return DISK_GIB[self.variant] if self.min_disk_gib is None else self.min_disk_gib

    @property
    def mem_gib(self) -> float:
        return MEMORY_GIB if self.min_mem_gib is None else self.min_mem_gib


def check_tools(req: Requirements, facts: HostFacts) -> list[Problem]:
    problems = []
    if not facts.tools.get("git"):
        problems.append(
            Problem(
                "git",
                "git was not found on PATH: install it (apt-get install git, dnf install git) "
                "and run again.",
            )
        )
    if req.docker:
        if not facts.tools.get("docker"):
            problems.append(
                Problem(
                    "docker",
                    "--docker was given but docker was not found on PATH: install Docker "
                    "(https://docs.docker.com/engine/install/) or drop --docker to build with "
                    "bazelisk on this host.",
                )
            )
        elif facts.docker_error:
            problems.append(
                Problem(
                    "docker",
                    "docker is installed but `docker info` failed "
                    f"({facts.docker_error.strip()}): start the Docker daemon, or add your user "
                    "to the docker group (sudo usermod -aG docker $USER, then log in again).",
                )
            )
    elif not (facts.tools.get("bazelisk") or facts.tools.get("bazel")):
        problems.append(
            Problem(
                "bazelisk",
                "neither bazelisk nor bazel was found on PATH: install bazelisk "
                "(https://github.com/bazelbuild/bazelisk/releases, saved as `bazelisk` on PATH, "
                "or `npm install -g @bazel/bazelisk`), or pass --docker to build inside "
                "TensorFlow's build container.",
            )
        )
    elif not facts.tools.get("bazelisk"):
        problems.append(
            Problem(
                "bazelisk",
                "bazelisk was not found, using `bazel` instead: it must be the exact version "
                "named in the checkout's .bazelversion, or the build will stop at once.",
                fatal=False,
            )
        )
    return problems


def check_disk(req: Requirements, facts: HostFacts) -> list[Problem]:
    need = req.disk_gib * GIB
    if facts.disk_free_bytes >= need:
        return []
    return [
        Problem(
            "disk",
            f"{facts.disk_free_bytes / GIB:.1f} GiB free at {facts.disk_path}, a {req.variant} "
            f"build needs {req.disk_gib:g} GiB (source, bazel cache, hermetic toolchains): free "
            "space there or pass --output DIR on a larger disk.",
        )
    ]


def check_memory(req: Requirements, facts: HostFacts) -> list[Problem]:
    total = facts.mem_total_bytes / GIB
    if total < req.mem_gib:
        return [
            Problem(
                "memory",
                f"{total:.1f} GiB of memory, a TensorFlow build needs at least {req.mem_gib:g} "
                "GiB: build on a larger host (swap makes bazel crawl).",
            )
        ]
    want = req.jobs * MEMORY_GIB_PER_JOB
    if req.jobs and want > total:
        fit = max(1, int(total // MEMORY_GIB_PER_JOB))
        return [
            Problem(
                "memory",
                f"--jobs {req.jobs} wants about {want} GiB ({MEMORY_GIB_PER_JOB} GiB per compile "
                f"job) but the host has {total:.1f} GiB: pass --jobs {fit} or fewer, or the "
                "compiler may be killed for lack of memory.",
                fatal=False,
            )
        ]
    return []


def check_python(req: Requirements, facts: HostFacts) -> list[Problem]:
    supported = supported_python(req.tf_version)
    if facts.python_version in supported:
        return []
    have = ".".join(map(str, facts.python_version))
    ok = ", ".join(".".join(map(str, v)) for v in supported)
    return [
        Problem(
            "python",
            f"the wheel is built for the running Python ({have}), and TensorFlow "
            f"{req.tf_version} builds for {ok}: run tflms with one of those interpreters.",
        )
    ]


def patched_tags(patch_dir: Path) -> list[str]:
    """The TensorFlow tags that have an LMS patch in `patch_dir` (v2.21.0, ...)."""
    tags = []
    for p in sorted(patch_dir.glob("tensorflow_v*_large_model_support.patch")):
        tags.append(p.name.removeprefix("tensorflow_").removesuffix("_large_model_support.patch"))
    return tags


def check_patch(req: Requirements, facts: HostFacts) -> list[Problem]:
    if req.patch_file.is_file():
        return []
    tags = patched_tags(req.patch_file.parent)
    have = ", ".join(tags) if tags else "none"
    return [
        Problem(
            "patch",
            f"no LMS patch for TensorFlow {req.tf_version} (tag {req.tag}) at {req.patch_file}; "
            f"tflms has patches for these tags: {have}. Pass one of them to --tf-version, or "
            f"generate the patch in a tflms checkout with `tflms patch generate --tf-version "
            f"{req.tf_version}`.",
        )
    ]


def check_tag(req: Requirements, facts: HostFacts) -> list[Problem]:
    if req.tf_source_given:
        return []
    if facts.remote_error:
        return [
            Problem(
                "tag",
                f"could not list TensorFlow's tags ({facts.remote_error.strip()}): check the "
                "network or proxy, or clone TensorFlow yourself and pass --tf-source DIR.",
            )
        ]
    if facts.remote_tags is not None and req.tag not in facts.remote_tags:
        return [
            Problem(
                "tag",
                f"TensorFlow has no tag {req.tag}: pass a released version to --tf-version "
                "(e.g. 2.21.0).",
            )
        ]
    return []


def check_tree(req: Requirements, facts: HostFacts) -> list[Problem]:
    tree = facts.tree
    if tree is None:
        return []
    if not tree.exists:
        return [Problem("tree", f"--tf-source {tree.path} does not exist: give a checkout.")]
    if not tree.is_git:
        return [
            Problem(
                "tree",
                f"{tree.path} is not a git checkout: clone TensorFlow with git "
                f"(git clone --branch {req.tag} https://github.com/tensorflow/tensorflow.git) "
                "so the patch can be applied and checked.",
            )
        ]
    problems = []
    if tree.tf_version and tree.tf_version != req.tf_version:
        problems.append(
            Problem(
                "tree",
                f"{tree.path} is TensorFlow {tree.tf_version}, not {req.tf_version}: check out "
                f"{req.tag} there (git -C {tree.path} checkout {req.tag}) or pass "
                f"--tf-version {tree.tf_version}.",
            )
        )
    if tree.dirty_files and not (req.tree_already_patched or req.allow_dirty):
        shown = ", ".join(tree.dirty_files[:5])
        more = f" and {len(tree.dirty_files) - 5} more" if len(tree.dirty_files) > 5 else ""
        problems.append(
            Problem(
                "tree",
                f"{tree.path} has uncommitted changes ({shown}{more}): commit or stash them "
                "(git stash), or pass --allow-dirty if they are meant to be built with the patch.",
            )
        )
    return problems


CHECKS: tuple[Callable[[Requirements, HostFacts], list[Problem]], ...] = (
    check_tools,
    check_python,
    check_patch,
    check_disk,
    check_memory,
    check_tag,
    check_tree,
)


def run_checks(req: Requirements, facts: HostFacts) -> list[Problem]:
    problems: list[Problem] = []
    for check in CHECKS:
        problems.extend(check(req, facts))
    return problems


# ---- every check's outcome, for the report printed before a run or in a dry run ----


@dataclass(frozen=True)
class CheckResult:
    name: str  # tools, python, patch, disk, memory, tag, tree
    problems: list[Problem]
    summary: str  # what was found, "ok: ..." or "not checked: ..."; shown when no problem


def _tools_summary(req: Requirements, facts: HostFacts) -> str:
    names = (
        ("git", "docker")
        if req.docker
        else ("git", "bazelisk" if facts.tools.get("bazelisk") else "bazel")
    )
    return "ok: " + ", ".join(f"{n} at {facts.tools.get(n)}" for n in names)


def _tag_summary(req: Requirements, facts: HostFacts) -> str:
    if req.tf_source_given:
        return "not needed: the TensorFlow checkout is given or already cloned"
    if facts.remote_tags is None:
        if not facts.tools.get("git"):
            return "not checked: TensorFlow's tags cannot be listed without git"
        return "not checked: TensorFlow's tags were not listed (a dry run does not query them)"
    return f"ok: {req.tag} exists at the TensorFlow repository"


def _tree_summary(req: Requirements, facts: HostFacts) -> str:
    tree = facts.tree
    if tree is None:
        return f"not needed: {req.tag} is cloned fresh"
    version = f" of TensorFlow {tree.tf_version}" if tree.tf_version else ""
    changes = " (its changes are accepted: --allow-dirty, or our patch)" if tree.dirty_files else ""
    return f"ok: {tree.path} is a git checkout{version}{changes}"


_SUMMARIES: tuple[tuple[str, Callable[[Requirements, HostFacts], str]], ...] = (
    ("tools", _tools_summary),
    ("python", lambda req, facts: "ok: Python " + ".".join(map(str, facts.python_version))),
    ("patch", lambda req, facts: f"ok: {req.patch_file}"),
    (
        "disk",
        lambda req, facts: (
            f"ok: {facts.disk_free_bytes / GIB:.1f} GiB free at "
            f"{facts.disk_path}, {req.disk_gib:g} GiB needed"
        ),
    ),
    (
        "memory",
        lambda req, facts: f"ok: {facts.mem_total_bytes / GIB:.1f} GiB, {req.mem_gib:g} GiB needed",
    ),
    ("tag", _tag_summary),
    ("tree", _tree_summary),
)


def check_results(req: Requirements, facts: HostFacts) -> list[CheckResult]:
    """Every check in CHECKS' order, with its problems or, when it has none, what it found."""
    results = []
    for check, (name, summary) in zip(CHECKS, _SUMMARIES, strict=True):
        problems = check(req, facts)
        results.append(CheckResult(name, problems, "" if problems else summary(req, facts)))
    return results


# ---- gathering facts from the real machine ----


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def read_mem_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_tf_version(tf_source: Path) -> str | None:
    """TF_VERSION as the checkout's tensorflow/tf_version.bzl states it (2.18 and later)."""
    bzl = tf_source / "tensorflow" / "tf_version.bzl"
    try:
        for line in bzl.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("TF_VERSION") and "=" in stripped:
                return stripped.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        return None
    return None


def _git(args: list[str], env: Mapping[str, str] | None, timeout: float) -> tuple[int, str]:
    git = shutil.which("git", path=(env or os.environ).get("PATH"))
    if not git:
        return 127, "git not found"
    try:
        proc = subprocess.run(
            [git, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
        )
    except subprocess.TimeoutExpired:
        return 124, f"git {args[0]} timed out after {timeout:g} s"
    return proc.returncode, proc.stdout if proc.returncode == 0 else proc.stderr


def tree_facts(tf_source: Path, env: Mapping[str, str] | None = None) -> TreeFacts:
    tree = TreeFacts(path=tf_source, exists=tf_source.is_dir())
    if not tree.exists:
        return tree
    rc, out = _git(["-C", str(tf_source), "rev-parse", "--is-inside-work-tree"], env, 30)
    tree.is_git = rc == 0 and out.strip() == "true"
    if tree.is_git:
        rc, out = _git(["-C", str(tf_source), "status", "--porcelain"], env, 120)
        if rc == 0:
            tree.dirty_files = [line[3:] for line in out.splitlines() if line.strip()]
    tree.tf_version = read_tf_version(tf_source)
    return tree


def remote_tag_facts(
    repo_url: str, tag: str, env: Mapping[str, str] | None = None
) -> tuple[frozenset[str] | None, str | None]:
    rc, out = _git(["ls-remote", "--tags", repo_url, f"refs/tags/{tag}"], env, 60)
    if rc != 0:
        return None, out or f"git ls-remote exited with {rc}"
    tags = frozenset(
        line.split("refs/tags/", 1)[1].removesuffix("^{}")
        for line in out.splitlines()
        if "refs/tags/" in line
    )
    return tags, None


def gather_facts(
    req: Requirements,
    *,
    output_dir: Path,
    tf_repo_url: str,
    tf_source: Path | None,
    query_remote: bool,
    env: Mapping[str, str] | None = None,
) -> HostFacts:
    """Collects the facts the checks need from this machine (and the remote, if asked)."""
    path = (env or os.environ).get("PATH", "")
    tools = {name: shutil.which(name, path=path) for name in ("git", "bazelisk", "bazel", "docker")}
    disk_path = _existing_parent(output_dir)
    facts = HostFacts(
        tools=tools,
        disk_free_bytes=shutil.disk_usage(disk_path).free,
        disk_path=disk_path,
        mem_total_bytes=read_mem_total(),
        python_version=(sys.version_info.major, sys.version_info.minor),
    )
    if req.docker and tools["docker"]:
        try:
            proc = subprocess.run(
                [tools["docker"], "info", "--format", "{{.ServerVersion}}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                facts.docker_error = lines[-1] if lines else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            facts.docker_error = "docker info timed out"
    if tf_source is not None:
        facts.tree = tree_facts(tf_source, env)
    elif query_remote and tools["git"]:
        facts.remote_tags, facts.remote_error = remote_tag_facts(tf_repo_url, req.tag, env)
    return facts
