"""The `tflms build-wheel` and `tflms run` subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _add_build_wheel(sub)
    _add_run(sub)


def _add_build_wheel(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tflms.build.wheel import ML_BUILD_IMAGE, TF_REPO_URL

    p = sub.add_parser(
        "build-wheel",
        help="build a TensorFlow wheel carrying the LMS patch",
        description=(
            "Clone a TensorFlow tag (or use --tf-source), apply the LMS patch, build the pip "
            "wheel with bazel the way TensorFlow builds its release wheels, and label it "
            "+lms. Re-running resumes: finished stages whose inputs did not change are "
            "skipped. See docs/building.md."
        ),
    )
    p.add_argument("--tf-version", default="2.21.0", help="TensorFlow release (default 2.21.0)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--cuda",
        dest="variant",
        action="store_const",
        const="cuda",
        help="build the GPU wheel `tensorflow` (default)",
    )
    kind.add_argument(
        "--cpu",
        dest="variant",
        action="store_const",
        const="cpu",
        help="build the CPU-only wheel `tensorflow_cpu`",
    )
    p.set_defaults(variant="cuda")
    p.add_argument(
        "--docker",
        action="store_true",
        help="build inside TensorFlow's ml-build container instead of with bazelisk on this host",
    )
    p.add_argument("--docker-image", default=ML_BUILD_IMAGE, help="build image for --docker")
    p.add_argument("--tf-source", type=Path, help="use this TensorFlow checkout, do not clone")
    p.add_argument("--tf-repo", default=TF_REPO_URL, help="repository to clone the tag from")
    p.add_argument(
        "--output",
        type=Path,
        help="work and output directory (default ./tflms-wheel-<version>-<cuda|cpu>)",
    )
    p.add_argument("--jobs", type=int, default=0, help="bazel --jobs (default: bazel decides)")
    p.add_argument(
        "--python",
        dest="python_version",
        help="Python version of the wheel (default: the running interpreter's)",
    )
    p.add_argument("--label", default="lms", help="local version label (default lms)")
    p.add_argument("--cuda-version", help="HERMETIC_CUDA_VERSION (default: the tag's own)")
    p.add_argument("--cudnn-version", help="HERMETIC_CUDNN_VERSION (default: the tag's own)")
    p.add_argument(
        "--cuda-compute-capabilities",
        help="HERMETIC_CUDA_COMPUTE_CAPABILITIES, e.g. sm_80,sm_90,compute_90 (fewer build faster)",
    )
    p.add_argument(
        "--bazel-arg",
        dest="bazel_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for bazel build (repeatable)",
    )
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="build a --tf-source checkout that has uncommitted changes",
    )
    p.add_argument("--min-disk-gb", type=float, help="override the free-disk requirement (GiB)")
    p.add_argument("--min-mem-gb", type=float, help="override the memory requirement (GiB)")
    p.add_argument("--dry-run", action="store_true", help="print every command, run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    p.set_defaults(func=_build_wheel)


def _build_wheel(args: argparse.Namespace) -> int:
    from tflms.build.wheel import BuildOptions, build_wheel

    if args.jobs < 0:
        print("tflms build-wheel: --jobs must be 0 (bazel decides) or more", file=sys.stderr)
        return 2
    # Not under build/: `make clean` removes that, and with it hours of bazel work.
    output = args.output or Path(f"tflms-wheel-{args.tf_version}-{args.variant}")
    opts = BuildOptions(
        tf_version=args.tf_version,
        variant=args.variant,
        docker=args.docker,
        docker_image=args.docker_image,
        tf_source=args.tf_source.absolute() if args.tf_source else None,
        tf_repo_url=args.tf_repo,
        output=output,
        jobs=args.jobs,
        label=args.label,
        cuda_version=args.cuda_version,
        cudnn_version=args.cudnn_version,
        cuda_compute_capabilities=args.cuda_compute_capabilities,
        extra_bazel_args=list(args.bazel_args),
        min_disk_gib=args.min_disk_gb,
        min_mem_gib=args.min_mem_gb,
        allow_dirty=args.allow_dirty,
        dry_run=args.dry_run,
        show_progress=not args.no_progress,
    )
    if args.python_version:
        opts.python_version = args.python_version
    return build_wheel(opts)


def _add_run(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run",
        help="run a command pinned to the NUMA node of its GPU",
        description=(
            "Run COMMAND under `numactl --cpunodebind=N --membind=N`, N being the NUMA node of "
            "the visible GPU (from sysfs). One NUMA node: the command runs plainly. "
            "Example: tflms run --numa auto -- python train.py"
        ),
    )
    p.add_argument(
        "--numa",
        default="auto",
        help="auto (node of the visible GPU), none, or a node number (default auto)",
    )
    p.add_argument(
        "--gpu",
        help="which visible GPU decides the node: an index, or local-rank (one process per "
        "GPU under mpirun/horovodrun/srun)",
    )
    p.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    p.add_argument("--proc-root", type=Path, default=Path("/proc"), help=argparse.SUPPRESS)
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the decision")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tflms.build.numa import NumaError, exec_pinned, plan_numa

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "tflms run: give the command after --, e.g. tflms run -- python train.py",
            file=sys.stderr,
        )
        return 2
    try:
        plan = plan_numa(args.numa, args.gpu, sysfs_root=args.sysfs_root, proc_root=args.proc_root)
        if not args.quiet:
            print(f"tflms run: {plan.message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        exec_pinned(command, plan)
    except NumaError as exc:
        print(f"tflms run: {exc}", file=sys.stderr)
        return 127 if str(exc).startswith("cannot run") else 2
