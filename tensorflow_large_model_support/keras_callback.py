"""LMSKerasCallback: v1's Keras callback, now a switch for allocator LMS."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import tensorflow as tf

from tensorflow_large_model_support.parameters import Translation
from tensorflow_large_model_support.runtime import apply, prepare, v1_arguments
from tensorflow_large_model_support.statistics import StatsReporter

CALLBACK_ADVICE = (
    "Create LMSKerasCallback before building the model (building it runs TensorFlow "
    "operations), or call tf.config.experimental.set_lms_enabled(True) at the start of the "
    "program."
)


class LMSKerasCallback(tf.keras.callbacks.Callback):
    """Switches allocator LMS on for Keras training (v1: edited the graph in set_model).

    Takes every parameter of TFLMS v1's LMSKerasCallback, and of LMS, with its v1
    default; see LMS for what they mean now. The switch happens when the
    callback is created, because by the time fit() calls a callback the model's
    variables already live on the GPU. Created too late, it raises
    LMSTooLateError saying what to move. With `debug=True` it logs LMS
    statistics per epoch (and, with `debug_level=2`, per step).
    """

    def __init__(
        self,
        optimizer_scopes_override: Iterable[str] | None = None,
        *,
        graph: Any = None,
        optimizer_scopes: Iterable[str] = frozenset(),
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
        arguments = v1_arguments(locals())
        super().__init__()
        self.translation: Translation = prepare(arguments, "LMSKerasCallback")
        self.applied: dict[str, object] = apply(
            self.translation, "LMSKerasCallback", CALLBACK_ADVICE
        )
        self.stats: StatsReporter | None = None

    def set_model(self, model: Any) -> None:
        # fit() hands the callback its model before it builds the train function.
        # XLA allocates a cluster's buffers itself and LMS never moves them, and
        # Keras 3 compiles fit with XLA by default on a GPU: compile without it.
        super().set_model(model)
        if self.translation.enabled and getattr(model, "jit_compile", False):
            model.jit_compile = False
            logging.getLogger(__name__).warning(
                "LMSKerasCallback: compiling %s without XLA (jit_compile=False): Large "
                "Model Support cannot move the buffers of XLA clusters.",
                getattr(model, "name", "the model"),
            )

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if self.translation.debug:
            self.stats = StatsReporter("LMSKerasCallback")
            self.stats.start()

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.stats is not None and self.translation.debug_level >= 2:
            self.stats.report(f"batch {batch}", "step")

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.stats is not None:
            self.stats.report(f"epoch {epoch}", "epoch")

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self.stats is not None:
            self.stats.report("training", "run")
