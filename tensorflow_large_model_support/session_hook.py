"""LMSSessionRunHook: v1's hook for MonitoredSession / Estimator training."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from tensorflow_large_model_support.parameters import Translation
from tensorflow_large_model_support.runtime import apply, prepare, v1_arguments
from tensorflow_large_model_support.statistics import StatsReporter

HOOK_ADVICE = (
    "Create the MonitoredTrainingSession (or Estimator) with this hook before any eager "
    "operation or other Session runs, or give it tensorflow_large_model_support.lms_config("
    "config) as its session config."
)


class LMSSessionRunHook(tf.compat.v1.train.SessionRunHook):
    """Switches allocator LMS on when the monitored session begins (v1: edited the graph).

    Takes every parameter of TFLMS v1's LMSSessionRunHook with its v1 default;
    see LMS for what they mean now. begin() runs before the session is created,
    which is before its first use of the GPU. With `debug=True` it logs LMS
    statistics at the end (and, with `debug_level=2`, after every step).

    A session given a ConfigProto reads LMS from it: pass
    `lms_config(config)` as MonitoredTrainingSession's (or RunConfig's) config.
    """

    def __init__(
        self,
        optimizer_scopes: Iterable[str] = frozenset(),
        *,
        graph: Any = None,
        starting_scope: str | None = None,
        starting_op_names: Iterable[str] | None = None,
        excl_scopes: Iterable[str] = frozenset(),
        incl_scopes: Iterable[str] = frozenset(),
        excl_types: Iterable[str] = frozenset(),
        incl_types: Iterable[str] = frozenset(),
        n_tensors: int = -1,
        lb: int = 1,
        ub: int = 10000,
        fuse_swapins: bool = False,
        ctrld_strategy: str = "chain_rule",
        swap_branches: bool = False,
        branch_threshold: int = 0,
        debug: bool = False,
        debug_level: int = 1,
        cpu_device: str = "/cpu:0",
    ) -> None:
        self.translation: Translation = prepare(v1_arguments(locals()), "LMSSessionRunHook")
        self.applied: dict[str, object] = {}
        self.stats: StatsReporter | None = None
        self.steps = 0

    def begin(self) -> None:
        self.applied = apply(self.translation, "LMSSessionRunHook.begin()", HOOK_ADVICE)
        if self.translation.debug:
            self.stats = StatsReporter("LMSSessionRunHook")

    def after_create_session(self, session: Any, coord: Any) -> None:
        if self.stats is not None:
            self.stats.start()

    def after_run(self, run_context: Any, run_values: Any) -> None:
        self.steps += 1
        if self.stats is not None and self.translation.debug_level >= 2:
            self.stats.report(f"step {self.steps}", "step")

    def end(self, session: Any) -> None:
        if self.stats is not None:
            self.stats.report(f"after {self.steps} steps", "run")
