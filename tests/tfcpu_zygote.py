"""Runs tests/tfcpu_cases.py programs in processes forked from one that imported TensorFlow.

Importing TensorFlow takes 6-7 s of the 7-20 s a case's process lives on the 2-core CI
machine, and the TensorFlow tests start a hundred or more such processes. A zygote
imports TensorFlow once, with nothing else done (no op run, no device made, no
tflms library loaded), and forks a child per case; the child takes the case's
environment and runs `tests.tfcpu_cases.main` as `python -m tests.tfcpu_cases` would.
What TensorFlow does at import is then done once; everything that tests depend on (the
devices, the allocator, the tflms library and its options, which it reads from the
environment when TensorFlow makes its devices) is made in the child, as in a fresh
process.

Variables TensorFlow may read at import (TF_CPP_MIN_LOG_LEVEL, TF_ENABLE_ONEDNN_OPTS, ...)
are the zygote's own: a zygote serves only calls whose environment agrees with it on every
variable but those read later, by tflms (FORK_SAFE_PREFIXES); `Zygotes` keeps one per
such environment. The protocol is one JSON line each way per case, on the zygote's stdin
and stdout: the request names the case, the environment and the files for the child's
stdout and stderr; the reply first gives the child's pid (so that a caller's timeout
can kill it), then its exit status.

A child ends as a fresh process would, as far as the case can tell: the exit handlers
registered in it run (autograph registers one per generated source file, which it removes;
the zygote's own handlers are not the child's to run), and the temporary directory is
looked up again from the child's environment.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Read only after TensorFlow's import: by tflms's library when it is loaded and when the
# device's allocator is made, and by the cases themselves; pytest's own bookkeeping,
# which names the running test (a zygote per test would import TensorFlow per test); and
# TMPDIR, which TensorFlow's Python reads only through `tempfile`, whose cached directory
# the child forgets.
FORK_SAFE_PREFIXES = (
    "TF_LMS_",
    "TFCPU_",
    "TFLMS_",
    "TF_GPU_HOST_MEM_LIMIT_IN_MB",
    "PYTEST_CURRENT_TEST",
    "TMPDIR",
)
# Zygotes kept alive at once (each holds an imported TensorFlow, 0.3-0.5 GB); the least
# recently used goes first.
MAX_ZYGOTES = 2


def _import_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of `env` a zygote's TensorFlow import may have read."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(FORK_SAFE_PREFIXES)))


def _child(request: dict, replies: int) -> None:
    """In the forked child: become the case's process, run it, never return."""
    code = 1
    atexit._clear()  # noqa: SLF001 - the zygote's handlers; the child runs only its own
    try:
        os.close(replies)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # looked up again, from TMPDIR as the case's process has it
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC)
        # The zygote's requests come on fd 0: replaced, as are its stdout and stderr.
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (devnull, out, err):
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  (fd 0 is /dev/null now)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = ["tests.tfcpu_cases", *request["argv"]]
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from tests.tfcpu_cases import main  # noqa: PLC0415

        main(request["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a fresh process's traceback would be
        traceback.print_exc()
        code = 1
    finally:
        try:
            # os._exit runs no exit handler: without this, every source file autograph
            # generated in the child stayed in the temporary directory.
            atexit._run_exitfuncs()  # noqa: SLF001
        except BaseException:  # noqa: BLE001 - reported as an interpreter at exit would
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - exiting anyway
                pass
        os._exit(code)


def serve() -> None:
    """The zygote's loop: imports TensorFlow, then forks a child per request line."""
    # Replies go on a descriptor of their own: whatever TensorFlow prints goes to stderr.
    replies_fd = os.dup(1)
    os.dup2(2, 1)
    replies = os.fdopen(replies_fd, "w")
    from tests.tfcpu_cases import environment_before_tensorflow  # noqa: PLC0415

    environment_before_tensorflow()
    import tensorflow  # noqa: F401, PLC0415  (the point of the zygote)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, replies_fd)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        replies.write(json.dumps({"rc": rc}) + "\n")
        replies.flush()


class Zygote:
    """One zygote process, started with `env`; runs one case at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.tfcpu_zygote"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self._pending = b""

    def _reply(self, deadline: float) -> dict:
        # Read from the descriptor with a buffer of our own: a buffered readline could take
        # the exit status too when a child exits at once, and the select for it would then
        # wait on an empty pipe until the deadline.
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the TensorFlow zygote exited ({self.proc.poll()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryDirectory(prefix="tfcpu-case-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch()
            err.touch()
            request = {
                "argv": argv,
                "env": env,
                "cwd": str(ROOT),
                "stdout": str(out),
                "stderr": str(err),
            }
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(deadline)["pid"]
            try:
                rc = self._reply(deadline)["rc"]
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # it may have just exited
                    os.kill(pid, signal.SIGKILL)
                self._reply(time.monotonic() + 60)
                stdout, stderr = out.read_text(), err.read_text()
                raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr) from None
            return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Zygotes:
    """A zygote per import environment, started when a case first needs it."""

    def __init__(self) -> None:
        self._by_env: dict[tuple[tuple[str, str], ...], Zygote] = {}

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        key = _import_environment(env)
        zygote = self._by_env.pop(key, None)
        if zygote is None or zygote.proc.poll() is not None:
            while len(self._by_env) >= MAX_ZYGOTES:
                oldest = next(iter(self._by_env))
                self._by_env.pop(oldest).close()
            zygote = Zygote(dict(key))
        self._by_env[key] = zygote  # the most recently used last
        return zygote.run(argv, env, timeout)

    def close(self) -> None:
        for zygote in self._by_env.values():
            zygote.close()
        self._by_env.clear()


if __name__ == "__main__":
    serve()
