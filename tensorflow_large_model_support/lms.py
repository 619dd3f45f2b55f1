"""LMS: TFLMS v1's session-based entry point, now a switch for allocator LMS."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tensorflow_large_model_support.parameters import Translation
from tensorflow_large_model_support.runtime import apply, prepare, v1_arguments
from tensorflow_large_model_support.statistics import enable_debug_output, log

RUN_ADVICE = (
    "Call LMS(...).run() before the first tf.compat.v1.Session is created and before any eager "
    "operation runs, or give the Session tensorflow_large_model_support.lms_config(config)."
)


class LMS:
    """Switches allocator Large Model Support on for sessions (v1: edited the graph).

    Takes every parameter of TFLMS v1's LMS with its v1 default. `n_tensors=0`
    switches LMS off; a non-default `lb`/`ub` switches prefetch on with that lookahead
    (`lb=0`: off, on demand; docs/migration.md); `debug` logs what was set. Parameters
    that steered v1's graph rewrite have no effect: passing one gives one
    LMSParameterWarning that names it and says why (docs/migration.md).

    A session reads LMS from the ConfigProto it is given; one created without a
    ConfigProto (`tf.compat.v1.Session()`) uses what run() sets. With your own
    ConfigProto, pass `lms_config(config)` instead.

    Raises LMSUnavailableError at construction on a TensorFlow without the tflms
    patch (except with n_tensors=0: LMS off is what such a TensorFlow does).
    """

    def __init__(
        self,
        optimizer_scopes: Iterable[str] = frozenset(),
        graph: Any = None,
        *,
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
        self.translation: Translation = prepare(v1_arguments(locals()), "LMS")
        self.graph = graph
        # The settings run() applied, by tf.config.experimental setter name.
        self.applied: dict[str, object] = {}

    def run(self, graph: Any = None) -> None:
        """Switches LMS as configured. `graph` is accepted for v1 call sites and not needed.

        Raises LMSTooLateError when TensorFlow's runtime or a session already
        created the GPU allocators with the other setting.
        """
        if graph is not None:
            self.graph = graph
        self.applied = apply(self.translation, "LMS.run()", RUN_ADVICE)
        if self.translation.debug:
            enable_debug_output()
            settings = ", ".join(f"{k}({v!r})" for k, v in self.applied.items()) or "nothing"
            log.info(
                "LMS.run(): applied tf.config.experimental.%s. Sessions give no per-step "
                "statistics here; use LMSSessionRunHook(debug=True) for those.",
                settings,
            )
