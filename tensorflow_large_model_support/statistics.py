"""What `debug=True` does now: logs the LMS allocator's statistics.

v1's debug mode printed what the graph rewrite did. With allocator LMS the
interesting facts are counters (reclaims, bytes moved, prefetch hits), read
from the patched TensorFlow's tf.experimental.get_lms_stats(gpu_id). They are
logged as changes since the previous report, for every visible GPU.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

LOGGER_NAME = "tensorflow_large_model_support"
log = logging.getLogger(LOGGER_NAME)


def enable_debug_output() -> None:
    """Makes INFO messages visible when the program configured no logging.

    v1 logged through tf.logging at INFO, which users switched on with its
    verbosity; here debug=True is the switch.
    """
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


Snapshot = dict[int, dict[str, int]]


class StatsUnavailable(Exception):
    """Why no statistics can be read (no GPU, TensorFlow without the patch, ...)."""


def read_tensorflow_stats() -> Snapshot:
    """Every LMS counter of every visible GPU, from the patched TensorFlow."""
    import tensorflow as tf

    experimental: Any = tf.experimental
    get_stats = getattr(experimental, "get_lms_stats", None)
    if get_stats is None:
        raise StatsUnavailable(
            f"TensorFlow {tf.__version__} has no tf.experimental.get_lms_stats "
            f"(it was built without the tflms patch)"
        )
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise StatsUnavailable("no GPU is visible to TensorFlow")
    snapshot: Snapshot = {}
    for gpu_id in range(len(gpus)):
        try:
            snapshot[gpu_id] = {str(k): int(v) for k, v in get_stats(gpu_id).items()}
        except Exception as e:  # noqa: BLE001 - any failure means: nothing to report
            raise StatsUnavailable(f"GPU {gpu_id}: {e}") from e
    return snapshot


class StatsReporter:
    """Reads LMS counters of every GPU and logs what changed.

    When they cannot be read (no GPU, TensorFlow without the patch, GPU not used
    yet) it logs the reason once and stays quiet after that.
    """

    def __init__(self, caller: str, source: Callable[[], Snapshot] | None = None) -> None:
        """`source` returns {gpu_id: {counter: value}} or raises StatsUnavailable.

        The default reads the patched TensorFlow's tf.experimental.get_lms_stats.
        """
        self.caller = caller
        self.unavailable = ""
        self._source = source or read_tensorflow_stats
        self._baselines: dict[str, Snapshot | None] = {}
        enable_debug_output()

    def read(self) -> Snapshot | None:
        if self.unavailable:
            return None
        try:
            return self._source()
        except StatsUnavailable as e:
            self.unavailable = str(e)
            log.warning("%s: LMS statistics are not available: %s", self.caller, e)
            return None

    def start(self) -> None:
        """Takes the baseline of every scope ("run", "epoch", "step")."""
        now = self.read()
        self._baselines = {scope: now for scope in ("run", "epoch", "step")}

    def report(self, label: str, scope: str) -> dict[int, dict[str, int]]:
        """Logs and returns the counters that changed since the baseline of `scope`.

        "epoch" and "step" baselines move to now; "run" stays at start().
        """
        now = self.read()
        if now is None:
            return {}
        base = self._baselines.get(scope) or {}
        if scope != "run":
            self._baselines[scope] = now
        changes: dict[int, dict[str, int]] = {}
        for gpu_id, counters in now.items():
            before = base.get(gpu_id, {})
            changed = {k: v - before.get(k, 0) for k, v in counters.items() if v != before.get(k)}
            changes[gpu_id] = changed
            text = ", ".join(f"{k}={v:+d}" for k, v in sorted(changed.items())) or "no change"
            log.info("%s %s, GPU %d: %s", self.caller, label, gpu_id, text)
        return changes
