"""`tflms build-wheel`: from a TensorFlow tag and our patch to an installable wheel.

Stages, each recorded in the resume file with the inputs that produced it:
    clone      git clone --depth 1 --branch v<version> (skipped with --tf-source)
    apply      the LMS patch, through tflms.patch.apply
    configure  read the checkout and settle the bazel arguments (written to configure.json)
    build      bazel build //tensorflow/tools/pip_package:wheel, with bazelisk on this host
               or inside TensorFlow's ml-build container (--docker)
    rename     copy the wheel to <output>/dist with the `+lms` local version label

The bazel arguments follow TensorFlow's own release jobs (ci/official): hermetic Python at the
running interpreter's version, WHEEL_NAME=tensorflow (CUDA) or tensorflow_cpu, the cuda_wheel
config so CUDA comes from NVIDIA's pip packages, and the wheel version suffix settings of the
python_wheel_version_suffix_repository rule (ML_WHEEL_TYPE, ML_WHEEL_VERSION_SUFFIX).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tflms import _data
from tflms.build import preflight
from tflms.build.runner import StepFailed, StepRunner, bazel_progress, git_progress
from tflms.build.state import BuildState, file_sha256
from tflms.build.wheel_label import WheelName, relabel_wheel, wheel_metadata_version

TF_REPO_URL = "https://github.com/tensorflow/tensorflow.git"
# TensorFlow's build container for 2.18 and later (ci/official/containers/ml_build).
ML_BUILD_IMAGE = "us-docker.pkg.dev/ml-oss-artifacts-published/ml-public-container/ml-build:latest"
WHEEL_TARGET = "//tensorflow/tools/pip_package:wheel"
WHEEL_HOUSE = Path("bazel-bin/tensorflow/tools/pip_package/wheel_house")
STAGES = ("clone", "apply", "configure", "build", "rename")

# Inside the container: where the checkout, the bazel cache and the wheels are mounted.
_C_SRC, _C_CACHE, _C_WHEELS = "/tflms/tensorflow", "/tflms/cache", "/tflms/wheels"

# Bazel flags that change what is printed, not what is built (kept out of the resume digest).
_UI_FLAGS = ("--curses=no", "--color=no", "--show_progress_rate_limit=10")


class BuildError(RuntimeError):
    """A build that cannot go on; the message says what to do."""


def default_patch_file(tf_version: str) -> Path:
    """The checkout's patches/ copy, or in an installed tflms the one the package carries."""
    return _data.patch_file(tf_version)


@dataclass
class BuildOptions:
    tf_version: str = "2.21.0"
    variant: str = "cuda"  # "cuda" or "cpu"
    docker: bool = False
    docker_image: str = ML_BUILD_IMAGE
    tf_source: Path | None = None
    tf_repo_url: str = TF_REPO_URL
    output: Path = Path("tflms-wheel")
    jobs: int = 0  # 0: bazel decides
    python_version: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    label: str = "lms"
    cuda_version: str | None = None
    cudnn_version: str | None = None
    cuda_compute_capabilities: str | None = None
    extra_bazel_args: list[str] = field(default_factory=list)
    min_disk_gib: float | None = None
    min_mem_gib: float | None = None
    allow_dirty: bool = False
    dry_run: bool = False
    show_progress: bool = True
    patch_file: Path | None = None  # None: the packaged patch for tf_version

    @property
    def tag(self) -> str:
        return "v" + self.tf_version

    @property
    def src(self) -> Path:
        return (self.tf_source or self.output / "tensorflow").absolute()

    @property
    def wheel_name(self) -> str:
        return "tensorflow" if self.variant == "cuda" else "tensorflow_cpu"

    @property
    def patch(self) -> Path:
        return self.patch_file or default_patch_file(self.tf_version)

    @property
    def bazel_tool(self) -> str:
        return "bazelisk" if shutil.which("bazelisk") or not shutil.which("bazel") else "bazel"


def bazel_build_args(opts: BuildOptions, suffix_supported: bool = True) -> list[str]:
    """The `bazel build` arguments (without the target), as TF's release jobs pass them."""
    args = [f"--repo_env=HERMETIC_PYTHON_VERSION={opts.python_version}"]
    if opts.docker:
        # The container carries the toolchain TF's release configs name.
        args.append(f"--config=release_{'gpu' if opts.variant == 'cuda' else 'cpu'}_linux")
    else:
        args.append("--config=avx_linux")  # the instruction set of TF's release wheels
    if opts.variant == "cuda":
        if not opts.docker:
            args.append("--config=cuda")
        # CUDA libraries come from NVIDIA's pip packages (tensorflow[and-cuda]), as released.
        args.append("--config=cuda_wheel")
        for env, value in (
            ("HERMETIC_CUDA_VERSION", opts.cuda_version),
            ("HERMETIC_CUDNN_VERSION", opts.cudnn_version),
            ("HERMETIC_CUDA_COMPUTE_CAPABILITIES", opts.cuda_compute_capabilities),
        ):
            if value:
                args.append(f"--repo_env={env}={value}")
    args.append(f"--repo_env=WHEEL_NAME={opts.wheel_name}")
    if suffix_supported:
        args += [
            "--repo_env=ML_WHEEL_TYPE=release",
            f"--repo_env=ML_WHEEL_VERSION_SUFFIX=+{opts.label}",
        ]
    args += list(opts.extra_bazel_args)
    return args


def supports_version_suffix(src: Path) -> bool:
    """Whether the checkout's workspace defines the wheel version suffix repository."""
    for name in ("WORKSPACE", "MODULE.bazel", "tensorflow/workspace0.bzl"):
        try:
            if "python_wheel_version_suffix_repository" in (src / name).read_text():
                return True
        except OSError:
            continue
    return False


def _git_head(src: Path) -> str:
    proc = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


class WheelBuilder:
    def __init__(self, opts: BuildOptions, out: TextIO | None = None) -> None:
        self.opts = opts
        self.out = out or sys.stdout
        self.output = opts.output.absolute()
        self.runner = StepRunner(
            self.output / "logs",
            dry_run=opts.dry_run,
            out=self.out,
            show_progress=opts.show_progress,
        )
        self.state = BuildState(self.output / "tflms-build-state.json", STAGES)

    # ---- pre-flight ----

    def requirements(self) -> preflight.Requirements:
        o = self.opts
        applied = self.state.stages.get("apply", {}).get("inputs", {})
        return preflight.Requirements(
            tf_version=o.tf_version,
            variant=o.variant,
            docker=o.docker,
            jobs=o.jobs,
            tf_source_given=o.tf_source is not None
            or self.state.is_done("clone", self._clone_inputs()),
            patch_file=o.patch,
            min_disk_gib=o.min_disk_gib,
            min_mem_gib=o.min_mem_gib,
            allow_dirty=o.allow_dirty,
            tree_already_patched=applied.get("tree") == str(o.src),
        )

    def preflight(self) -> list[preflight.Problem]:
        return [p for r in self.preflight_results() for p in r.problems]

    def preflight_results(self) -> list[preflight.CheckResult]:
        cloned = self.state.is_done("clone", self._clone_inputs())
        if cloned and not self.opts.src.is_dir() and not self.opts.dry_run:
            self.state.forget_from("clone")  # the user removed the clone: start again
            cloned = False
        req = self.requirements()
        facts = preflight.gather_facts(
            req,
            output_dir=self.output,
            tf_repo_url=self.opts.tf_repo_url,
            tf_source=self.opts.src if (self.opts.tf_source or cloned) else None,
            query_remote=not self.opts.dry_run,
        )
        if self.opts.dry_run and self.opts.tf_source is None and not cloned:
            argv = ["git", "ls-remote", "--tags", self.opts.tf_repo_url, f"refs/tags/{req.tag}"]
            self.runner.say("+ " + shlex.join(argv))
        return preflight.check_results(req, facts)

    # ---- the pipeline ----

    def run(self) -> Path | None:
        """Runs the pipeline; in a dry run prints it, and fails after it if a real run would."""
        results = self.preflight_results()
        for result in results:
            if not result.problems:
                print(f"pre-flight {result.name}: {result.summary}", file=sys.stderr)
            for p in result.problems:
                kind = "error" if p.fatal else "warning"
                if self.opts.dry_run and p.fatal:
                    kind = "a real run would stop here"
                print(f"pre-flight {p.check}: {kind}: {p.message}", file=sys.stderr)
        fatal = [p for r in results for p in r.problems if p.fatal]
        if fatal and not self.opts.dry_run:
            raise BuildError(f"{len(fatal)} pre-flight check(s) failed; nothing was started.")
        if not self.opts.dry_run:
            self.output.mkdir(parents=True, exist_ok=True)
        self.stage_clone()
        self.stage_apply()
        suffix_ok = self.stage_configure()
        built = self.stage_build(suffix_ok)
        if fatal:  # a dry run: every check and command is printed, and scripts see the failure
            failed = ", ".join(dict.fromkeys(p.check for p in fatal))
            raise BuildError(
                f"dry run: {len(fatal)} pre-flight check(s) would stop a real run ({failed})."
            )
        return self.stage_rename(built)

    def _skip(self, stage: str, inputs: dict[str, object]) -> bool:
        if self.state.is_done(stage, inputs):
            self.runner.note(f"[{stage}] already done with the same inputs: skipped")
            return True
        if not self.opts.dry_run:
            self.state.forget_from(stage)
        return False

    def _clone_inputs(self) -> dict[str, object]:
        return {"url": self.opts.tf_repo_url, "tag": self.opts.tag, "dest": str(self.opts.src)}

    def stage_clone(self) -> None:
        o = self.opts
        if o.tf_source is not None:
            return
        inputs = self._clone_inputs()
        if self._skip("clone", inputs):
            return
        if o.src.exists() and any(o.src.iterdir()) and not o.dry_run:
            raise BuildError(
                f"{o.src} exists but no finished clone is recorded for it: remove it "
                f"(rm -rf {shlex.quote(str(o.src))}) or pass --tf-source {o.src} to use it."
            )
        argv = ["git", "clone", "--depth", "1", "--branch", o.tag, "--progress", o.tf_repo_url]
        self.runner.run(
            "clone",
            [*argv, str(o.src)],
            progress=git_progress,
            description=f"cloning TensorFlow {o.tag}",
        )
        if not o.dry_run:
            self.state.mark_done("clone", inputs, {"commit": _git_head(o.src)})

    def _apply_inputs(self) -> dict[str, object]:
        o = self.opts
        patch_sha = file_sha256(o.patch) if o.patch.is_file() else "missing"
        base = self.state.outputs("apply").get("base_commit") or _git_head(o.src)
        return {"tree": str(o.src), "patch_sha256": patch_sha, "base_commit": base}

    def stage_apply(self) -> None:
        o = self.opts
        inputs = self._apply_inputs()
        if self._skip("apply", inputs):
            return
        if o.dry_run:
            argv = [
                "tflms",
                "patch",
                "apply",
                "--tf-source",
                str(o.src),
                "--tf-version",
                o.tf_version,
            ]
            self.runner.say("+ " + shlex.join(argv))
            return
        self.runner.say(f"[apply] applying {o.patch.name} to {o.src}")
        self.apply_patch(o.src, o.tf_version)
        self.state.mark_done("apply", inputs, {"base_commit": inputs["base_commit"]})

    def apply_patch(self, src: Path, tf_version: str) -> None:
        """Applies the LMS patch with the project's apply tool."""
        try:
            from tflms.patch.apply import PatchApplyError, apply_patch
        except ImportError as exc:
            raise BuildError(
                f"the patch apply tool (tflms.patch.apply) is not available: {exc}"
            ) from exc
        try:
            apply_patch(src, tf_version)
        except PatchApplyError as exc:
            raise BuildError(
                f"the LMS patch did not apply to {src}: {exc}\n"
                f"Start from a clean {self.opts.tag} checkout (git -C {src} reset --hard "
                f"{self.opts.tag} && git -C {src} clean -fd) and run again."
            ) from exc

    def stage_configure(self) -> bool:
        o = self.opts
        suffix_ok = True if o.dry_run else supports_version_suffix(o.src)
        args = bazel_build_args(o, suffix_ok)
        inputs = {"args": args, "docker": o.docker, "image": o.docker_image if o.docker else None}
        if o.dry_run:
            self.runner.note(f"configure: bazel arguments {shlex.join(args)}")
            return suffix_ok
        if self._skip("configure", inputs):
            return bool(self.state.outputs("configure").get("suffix_supported", True))
        found = preflight.read_tf_version(o.src)
        if found and found != o.tf_version:
            raise BuildError(f"{o.src} is TensorFlow {found}, not {o.tf_version}.")
        config = {
            "tf_version": o.tf_version,
            "variant": o.variant,
            "python": o.python_version,
            "wheel_name": o.wheel_name,
            "label": o.label,
            "suffix_supported": suffix_ok,
            "mode": "docker" if o.docker else "host",
            "image": o.docker_image if o.docker else None,
            "bazel_args": args,
            "target": WHEEL_TARGET,
        }
        (self.output / "configure.json").write_text(json.dumps(config, indent=2) + "\n")
        if not suffix_ok:
            self.runner.say(
                "[configure] this checkout has no wheel version suffix settings: the label "
                f"+{o.label} is added to the wheel after the build"
            )
        self.state.mark_done("configure", inputs, {"suffix_supported": suffix_ok})
        return suffix_ok

    def _bazel_command(self, args: list[str]) -> tuple[list[str], Path | None]:
        o = self.opts
        jobs = [f"--jobs={o.jobs}"] if o.jobs else []
        if not o.docker:
            return [o.bazel_tool, "build", *_UI_FLAGS, *jobs, *args, WHEEL_TARGET], o.src
        inner = [
            "bazel",
            f"--output_user_root={_C_CACHE}/bazel",
            "build",
            *_UI_FLAGS,
            *jobs,
            *args,
            WHEEL_TARGET,
        ]
        script = (
            f'mkdir -p "$HOME" && {shlex.join(inner)} && '
            f"cp {WHEEL_HOUSE.as_posix()}/*.whl {_C_WHEELS}/"
        )
        uid_gid = f"{os.getuid()}:{os.getgid()}" if hasattr(os, "getuid") else "0:0"
        argv = [
            "docker", "run", "--rm",
            # Our own uid: files in the checkout and cache stay the user's, and the hermetic
            # Python rules refuse to run as root.
            "--user", uid_gid,
            "-e", f"HOME={_C_CACHE}/home",
            "-e", "USER=tflms",
            "-v", f"{o.src}:{_C_SRC}",
            "-v", f"{self.output / 'bazel-cache'}:{_C_CACHE}",
            "-v", f"{self.output / 'bazel-wheels'}:{_C_WHEELS}",
            "-w", _C_SRC,
            o.docker_image,
            "bash", "-c", script,
        ]  # fmt: skip
        return argv, None

    def _find_built_wheel(self) -> Path:
        o = self.opts
        house = self.output / "bazel-wheels" if o.docker else o.src / WHEEL_HOUSE
        py = "cp" + o.python_version.replace(".", "")
        found = sorted(
            (p for p in house.glob(f"{o.wheel_name}-{o.tf_version}*-{py}-*.whl")),
            key=lambda p: p.stat().st_mtime,
        )
        if not found:
            raise BuildError(
                f"bazel finished but no {o.wheel_name}-{o.tf_version}*-{py}-*.whl is in {house}: "
                f"see {self.output / 'logs' / 'build.log'}."
            )
        return found[-1]

    def stage_build(self, suffix_ok: bool) -> Path | None:
        o = self.opts
        args = bazel_build_args(o, suffix_ok)
        inputs = {
            "args": args,
            "mode": "docker" if o.docker else "host",
            "image": o.docker_image if o.docker else None,
            "apply": self.state.stages.get("apply", {}).get("digest"),
        }
        if self._skip("build", inputs):
            wheel = Path(self.state.outputs("build").get("wheel", ""))
            if wheel.is_file() or o.dry_run:
                return wheel
            self.state.forget_from("build")
        argv, cwd = self._bazel_command(args)
        if o.docker:
            if not o.dry_run:
                for sub in ("bazel-cache", "bazel-wheels"):
                    (self.output / sub).mkdir(parents=True, exist_ok=True)
            self.runner.run(
                "pull", ["docker", "pull", o.docker_image], description="pulling the build image"
            )
        self.runner.run(
            "build",
            argv,
            cwd=cwd,
            progress=bazel_progress,
            description=f"bazel build of the {o.wheel_name} wheel (hours; bazel resumes if cut)",
        )
        if o.dry_run:
            return None
        wheel = self._find_built_wheel()
        self.state.mark_done("build", inputs, {"wheel": str(wheel)})
        return wheel

    def stage_rename(self, built: Path | None) -> Path | None:
        o = self.opts
        dist = self.output / "dist"
        if o.dry_run or built is None:
            self.runner.note(
                f"rename: copy the wheel to {dist} as {o.wheel_name}-{o.tf_version}+{o.label}-..."
            )
            return None
        inputs = {"wheel": str(built), "sha256": file_sha256(built), "label": o.label}
        if self._skip("rename", inputs):
            final = Path(self.state.outputs("rename").get("wheel", ""))
            if final.is_file():
                self._report(final)
                return final
            self.state.forget_from("rename")
        self.runner.say(f"[rename] {built.name} -> {dist}")
        final = relabel_wheel(built, dist, o.label)
        version = wheel_metadata_version(final)
        if not version.endswith("+" + o.label):
            raise BuildError(f"{final} says version {version}, expected a +{o.label} label.")
        info = {
            "wheel": final.name,
            "version": version,
            "tf_tag": o.tag,
            "tf_commit": self.state.outputs("clone").get("commit") or _git_head(o.src),
            "patch": o.patch.name,
            "patch_sha256": file_sha256(o.patch) if o.patch.is_file() else None,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "configure": json.loads((self.output / "configure.json").read_text())
            if (self.output / "configure.json").is_file()
            else None,
        }
        (dist / (final.name + ".json")).write_text(json.dumps(info, indent=2) + "\n")
        self.state.mark_done("rename", inputs, {"wheel": str(final)})
        self._report(final)
        return final

    def _report(self, wheel: Path) -> None:
        name = WheelName.parse(wheel.name)
        extra = "[and-cuda]" if self.opts.variant == "cuda" else ""
        target = shlex.quote(f"{wheel}{extra}")
        self.runner.say(
            f"\nWheel: {wheel}\n"
            f"Version {name.version}: TensorFlow {name.public_version} with Large Model Support.\n"
            "Install it into the environment you train in:\n"
            "  python -m pip uninstall -y tensorflow tensorflow-cpu tensorflow_cpu\n"
            f"  python -m pip install {target}\n"
            "Check it:\n"
            "  python -c 'import tensorflow as tf; print(tf.__version__); "
            "tf.config.experimental.set_lms_enabled(True)'"
        )


def build_wheel(opts: BuildOptions, out: TextIO | None = None) -> int:
    """Runs the pipeline; returns a process exit status and prints what went wrong."""
    builder = WheelBuilder(opts, out)
    try:
        builder.run()
    except (BuildError, StepFailed) as exc:
        print(f"tflms build-wheel: {exc}", file=sys.stderr)
        return 1
    return 0
