"""`tflms patch generate|apply|check` and `tflms verify`."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from tflms._data import PACKAGE_DIR, checkout_root
from tflms.patch import (
    NEWEST_VERSION,
    SUPPORTED_VERSIONS,
    NotACheckout,
    checkout_patch_path,
    patch_path,
)

DEFAULT_VERSION = NEWEST_VERSION
# Set in the verification that runs inside a tag's own environment (no second hop).
_IN_TAG_VENV = "TFLMS_VERIFY_IN_TAG_VENV"


def default_report(version: str, nightly: bool = False) -> Path:
    """docs/verification.md for the newest tag, docs/verification-v<version>.md for the others.

    The nightly report goes to .cache/ (it changes with every nightly; it is not committed).
    Installed (no checkout): the same names under the current directory.
    """
    checkout = checkout_root()
    if nightly:
        return (checkout or Path()) / ".cache" / "verification-nightly.md"
    name = "verification.md" if version == NEWEST_VERSION else f"verification-v{version}.md"
    return checkout / "docs" / name if checkout else Path(name)


def _verify_in_tag_venv(args: argparse.Namespace) -> int | None:
    """Runs this verification in the tag's own environment when this one has another TF.

    Returns the child's exit status, or None when this interpreter is the right one.
    """
    from tflms.patch.wheel import (
        ANY_TF_ENV,
        NIGHTLY,
        WheelError,
        ensure_tag_python,
        installed_tf_version,
    )

    if os.environ.get(_IN_TAG_VENV):
        return None
    if not args.nightly and installed_tf_version() == args.tf_version:
        return None
    target = NIGHTLY if args.nightly else args.tf_version
    try:
        python = ensure_tag_python(target, say=lambda m: print(m, file=sys.stderr))
    except (WheelError, OSError, subprocess.CalledProcessError) as e:
        print(f"tflms verify: {e}", file=sys.stderr)
        return 1
    # The child imports this tflms (not one installed there) through a directory that holds
    # only a link to the package, so nothing else of this environment shadows the tag's.
    link_dir = python.parent.parent / "tflms-path"
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "tflms"
    if link.is_symlink() and link.resolve() != PACKAGE_DIR:
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(PACKAGE_DIR)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(link_dir)
    env[_IN_TAG_VENV] = "1"
    if args.nightly:
        env[ANY_TF_ENV] = "1"
    cmd = [str(python), "-m", "tflms", "verify", "--tf-version", args.tf_version]
    cmd += ["--report", str(args.report), "--jobs", str(args.jobs), "--log", args.log]
    cmd += ["--no-compile"] * args.no_compile + (["--work", args.work] if args.work else [])
    cmd += ["--nightly"] * args.nightly
    print(f"verifying TensorFlow {args.tf_version} with {python}", file=sys.stderr)
    return subprocess.run(cmd, env=env, check=False).returncode


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

    if args.report is None:
        args.report = str(default_report(args.tf_version, args.nightly))
    delegated = _verify_in_tag_venv(args)
    if delegated is not None:
        return delegated
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
        help="verify the patch against the tag's own tensorflow-cpu wheel and write its report "
        "(a tag other than this environment's TensorFlow runs in ~/.cache/tflms/venvs/<version>)",
    )
    version_arg(ver)
    ver.add_argument(
        "--report",
        help="where to write the report (default, in a checkout: docs/verification.md for the "
        f"newest tag ({NEWEST_VERSION}), docs/verification-v<version>.md for the others; "
        "installed: the same names in the current directory)",
    )
    ver.add_argument(
        "--nightly",
        action="store_true",
        help="check the patch against the current tf-nightly-cpu wheel instead (early warning "
        "for the next release; report in .cache/verification-nightly.md)",
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
