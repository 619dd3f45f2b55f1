"""The `tflms` command line: one subcommand per job, each in its own module.

Subcommand modules expose ``add_parsers(subparsers)`` and set ``func`` on the
parsers they add. They must not import TensorFlow or matplotlib at module level,
so `tflms --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "tflms.planner.cli",  # demo, simulate, results
    "tflms.trace.cli",  # trace
    "tflms.patch.cli",  # patch generate/apply, verify
    "tflms.build.cli",  # build-wheel, run
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tflms",
        description="Large Model Support for TensorFlow: patch, verify, build, plan.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part of the package is not built yet
            raise
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
