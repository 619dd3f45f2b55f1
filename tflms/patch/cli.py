"""`tflms patch generate|apply|check` and `tflms verify`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tflms._data import checkout_root
from tflms.patch import SUPPORTED_VERSIONS, NotACheckout, checkout_patch_path, patch_path

DEFAULT_VERSION = SUPPORTED_VERSIONS[-1]


def _generate(args: argparse.Namespace) -> int:
    from tflms.patch.generate import generate

    try:
        dest = Path(args.output) if args.output else checkout_patch_path(args.tf_version)
    except NotACheckout as e:
        print(f"tflms patch generate: {e}", file=sys.stderr)
        return 1
    text = generate(args.tf_version)
    if args.output and dest.exists() and not args.force:
        print(f"{dest} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    print(f"wrote {dest} ({len(text.splitlines())} lines)")
    return 0


def _check(args: argparse.Namespace) -> int:
    from tflms.patch.generate import stale_reason

    reason = stale_reason(args.tf_version)
    if reason:
        print(reason, file=sys.stderr)
        return 1
    print(f"{patch_path(args.tf_version)} is up to date")
    return 0


def _apply(args: argparse.Namespace) -> int:
    from tflms.patch.apply import PatchAlreadyApplied, PatchApplyError, apply_patch

    try:
        apply_patch(Path(args.tf_source), args.tf_version, Path(args.patch) if args.patch else None)
    except PatchAlreadyApplied as e:
        print(str(e))
        return 0
    except PatchApplyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"applied Large Model Support to {args.tf_source} (one commit on v{args.tf_version})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tflms.patch.report import write_report
    from tflms.patch.verify import run_verify

    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
        filename=args.log,
        filemode="w",
    )
    with tqdm(total=3, desc="verify", unit="step", file=sys.stderr) as bar:

        def progress(message: str, done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.set_postfix_str(message[:60])

        result = run_verify(
            args.tf_version,
            work=Path(args.work) if args.work else None,
            jobs=args.jobs,
            compile_cpp=not args.no_compile,
            progress=progress,
        )
    dest = write_report(result, Path(args.report))
    failed = [f.path for f in result.files if f.failed]
    print(f"wrote {dest}")
    print(
        f"{len(result.files)} files; failing: {len(failed)}; "
        f"python checks: {sum(bool(c['ok']) for c in result.python_checks)}"
        f"/{len(result.python_checks)}; problems: {len(result.problems)}"
    )
    for path in failed:
        print(f"  FAIL {path}", file=sys.stderr)
    for problem in result.problems:
        print(f"  {problem}", file=sys.stderr)
    if result.stale:
        print(f"  {result.stale}", file=sys.stderr)
    return 0 if result.ok else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    patch = sub.add_parser("patch", help="generate, check or apply the TensorFlow patch")
    patch_sub = patch.add_subparsers(dest="patch_command", metavar="ACTION", required=True)

    def version_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--tf-version",
            default=DEFAULT_VERSION,
            choices=SUPPORTED_VERSIONS,
            help=f"TensorFlow release (default {DEFAULT_VERSION})",
        )

    gen = patch_sub.add_parser("generate", help="compose the patch from core/ and tf/")
    version_arg(gen)
    gen.add_argument(
        "--output",
        help="write here instead of patches/ (needs --force to overwrite an existing file)",
    )
    gen.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    gen.set_defaults(func=_generate)

    chk = patch_sub.add_parser("check", help="fail if the committed patch is stale")
    version_arg(chk)
    chk.set_defaults(func=_check)

    app = patch_sub.add_parser("apply", help="apply the patch to a TensorFlow checkout")
    version_arg(app)
    app.add_argument(
        "--tf-source",
        required=True,
        help="TensorFlow git checkout at the release tag, with no local changes",
    )
    app.add_argument("--patch", help="patch file (default: the one tflms carries)")
    app.set_defaults(func=_apply)

    # In a checkout the report and the log go where they always have; installed, under the
    # current directory (never into site-packages).
    checkout = checkout_root()
    ver = sub.add_parser(
        "verify",
        help="verify the patch against the tensorflow-cpu wheel and write docs/verification.md",
    )
    version_arg(ver)
    ver.add_argument(
        "--report",
        default=str(checkout / "docs" / "verification.md") if checkout else "verification.md",
        help="where to write the report (default docs/verification.md in a checkout, "
        "./verification.md otherwise)",
    )
    ver.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2)")
    ver.add_argument("--no-compile", action="store_true", help="skip b) (C++ compiles)")
    ver.add_argument("--work", help="keep intermediate files in this directory")
    ver.add_argument(
        "--log",
        default=str((checkout or Path()) / ".cache" / "tflms-verify.log"),
        help="log file (default .cache/tflms-verify.log)",
    )
    ver.set_defaults(func=_verify)
