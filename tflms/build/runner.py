"""Runs the long commands of a build: each writes a log file and shows a progress bar.

In dry-run mode the runner prints each command (with its directory and added environment)
instead of running it, so `--dry-run` shows every command a build would run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

# A parser turns one output line into (done, total) or None when the line says nothing.
ProgressParser = Callable[[str], "tuple[float, float] | None"]

_BAZEL_PROGRESS = re.compile(r"\[([\d,]+) / ([\d,]+)\]")
_GIT_PROGRESS = re.compile(r"(Receiving objects|Resolving deltas|Updating files):\s+(\d+)%")
_GIT_PHASES = {"Receiving objects": 0, "Resolving deltas": 1, "Updating files": 2}

# The lines that name the cause of a failure, in the tools a build runs.
_ERROR_LINE = re.compile(
    r"^(ERROR: |FAILED: |fatal: |error: )|: (fatal )?error: |^Traceback |No space left on device"
    r"|Killed signal terminated program|Cannot connect to the Docker daemon|^E: "
)


def bazel_progress(line: str) -> tuple[float, float] | None:
    match = _BAZEL_PROGRESS.search(line)
    if not match:
        return None
    done, total = (int(g.replace(",", "")) for g in match.groups())
    return float(done), float(max(total, 1))


def git_progress(line: str) -> tuple[float, float] | None:
    match = _GIT_PROGRESS.search(line)
    if not match:
        return None
    # Three phases, each a third of the bar, so the bar never runs backwards.
    phase = _GIT_PHASES[match.group(1)]
    return phase * 100 + float(match.group(2)), 300.0


def first_error(log: Path, context: int = 4) -> str | None:
    """The first line in `log` that names an error, with a few lines after it."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line):
            return "\n".join(s[:300] for s in lines[i : i + 1 + context])
    return None


class StepFailed(RuntimeError):
    def __init__(self, step: str, returncode: int, log: Path, error: str | None) -> None:
        self.step = step
        self.returncode = returncode
        self.log = log
        self.error = error
        where = f"\nfirst error in the log:\n{error}" if error else ""
        super().__init__(
            f"{step} failed (exit status {returncode}); full log: {log}{where}\n"
            "Fix the cause and run the same command again: finished stages are not redone."
        )


def format_command(
    argv: list[str], cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> str:
    parts = []
    if cwd is not None:
        parts.append(f"cd {shlex.quote(str(cwd))} &&")
    if env:
        parts.extend(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    parts.append(shlex.join(argv))
    return " ".join(parts)


class StepRunner:
    def __init__(
        self,
        log_dir: Path,
        *,
        dry_run: bool = False,
        out: TextIO | None = None,
        show_progress: bool = True,
    ) -> None:
        self.log_dir = log_dir
        self.dry_run = dry_run
        self.out = out or sys.stdout
        self.show_progress = show_progress

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def note(self, text: str) -> None:
        """A step done in Python (no command): shown as a comment in a dry run."""
        self.say(f"# {text}" if self.dry_run else text)

    def run(
        self,
        step: str,
        argv: list[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        progress: ProgressParser | None = None,
        description: str = "",
    ) -> Path:
        """Runs argv, logging to <log_dir>/<step>.log; raises StepFailed on failure."""
        log = self.log_dir / f"{step}.log"
        if self.dry_run:
            self.say("+ " + format_command(argv, cwd, env))
            return log
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"[{step}] {description or argv[0]} (log: {log})")
        full_env = {**os.environ, **(env or {})}
        started = time.monotonic()
        with log.open("w", encoding="utf-8") as logf:
            logf.write(f"# {format_command(argv, cwd, env)}\n")
            logf.flush()
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=full_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as exc:
                logf.write(f"error: could not start {argv[0]}: {exc}\n")
                raise StepFailed(step, 127, log, f"could not start {argv[0]}: {exc}") from exc
            rc = self._pump(proc, logf, progress, step)
            logf.write(f"# exit status {rc} after {time.monotonic() - started:.0f} s\n")
        if rc != 0:
            raise StepFailed(step, rc, log, first_error(log))
        return log

    def _pump(
        self,
        proc: subprocess.Popen[bytes],
        logf: TextIO,
        progress: ProgressParser | None,
        step: str,
    ) -> int:
        bar = None
        if progress is not None and self.show_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=100,
                desc=step,
                file=sys.stderr,
                mininterval=1.0,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
            )
        assert proc.stdout is not None
        pending = b""
        try:
            while True:
                chunk = proc.stdout.read1(65536)  # type: ignore[attr-defined]
                if not chunk:
                    break
                pending += chunk
                # git draws its progress with carriage returns: they end lines too.
                pieces = re.split(rb"[\r\n]", pending)
                pending = pieces.pop()
                for raw in pieces:
                    if raw:
                        self._line(raw.decode(errors="replace"), logf, progress, bar)
            if pending:
                self._line(pending.decode(errors="replace"), logf, progress, bar)
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        finally:
            if bar is not None:
                bar.close()

    @staticmethod
    def _line(line: str, logf: TextIO, progress: ProgressParser | None, bar: Any) -> None:
        logf.write(line + "\n")
        if progress is None or bar is None:
            return
        value = progress(line)
        if value is not None:
            done, total = value
            pct = 100.0 * done / total
            bar.n = min(100.0, pct)
            bar.refresh()
