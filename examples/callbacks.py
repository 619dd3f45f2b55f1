"""LMSStatsLogger: a Keras 3 callback that logs Large Model Support allocator statistics.

For every batch it writes one CSV row: the step's duration and the change, during that step, of
the GPU allocator counters that TensorFlow built with the tflms patch exposes as
``tf.experimental.get_<name>(gpu_id)``. On a TensorFlow without the patch (or without a GPU) it
says so once and still logs step durations, leaving the statistics columns empty.

At the end of training it writes aggregate figures (totals and per-step means after the warm-up
steps) to ``<csv name>.summary.csv``; with ``tensorboard_dir`` every figure also goes to
TensorBoard. Columns and units are documented in examples/README.md.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import keras

# CSV header, in order. Counter columns hold the change during the step, for GPU `gpu_id`.
COLUMNS: tuple[str, ...] = (
    "step type",
    "epoch",
    "step",
    "duration",  # seconds, wall clock from batch begin to batch end
    "allocations",
    "single reclaims",
    "full reclaims",
    "GiB reclaimed",  # GiB copied from GPU to host memory during the step
    "fragment reclaims",
    "defragmentations",
    "prefetch hits",
    "prefetch misses",
    "page-in stall",  # seconds the GPU waited for tensors being copied back
    # Allocations by the allocator step that served them (they add up to "allocations").
    "allocs from free",
    "allocs from new region",
    "allocs from single reclaim",
    "allocs from fragment reclaim",
    "allocs from full reclaim",
    "allocs from defrag",
)

# Column -> counter name: the patched TensorFlow's tf.experimental.get_<counter>(gpu_id).
COUNTERS: dict[str, str] = {
    "allocations": "num_allocs",
    "single reclaims": "num_single_reclaims",
    "full reclaims": "num_full_reclaims",
    "GiB reclaimed": "bytes_reclaimed",
    "fragment reclaims": "num_fragment_reclaims",
    "defragmentations": "num_defragmentations",
    "prefetch hits": "prefetch_hits",
    "prefetch misses": "prefetch_misses",
    "page-in stall": "page_in_stall_ns",
    "allocs from free": "num_allocs_from_free",
    "allocs from new region": "num_allocs_from_new_region",
    "allocs from single reclaim": "num_allocs_from_single_reclaim",
    "allocs from fragment reclaim": "num_allocs_from_fragment_reclaim",
    "allocs from full reclaim": "num_allocs_from_full_reclaim",
    "allocs from defrag": "num_allocs_from_defrag",
}

# Absolute figures (not deltas) reported in the summary when the TensorFlow has them.
GAUGES: tuple[str, ...] = ("peak_bytes_in_use", "peak_bytes_reclaimed", "bytes_limit")

_UNIT_SCALE = {"GiB reclaimed": 1.0 / 2**30, "page-in stall": 1e-9}

StatsReader = Callable[[], Mapping[str, int]]


class TensorFlowLMSStats:
    """Reads the patched TensorFlow's LMS counters for one GPU.

    With ``tf.experimental.get_lms_stats`` (the tflms patch) every counter comes from that one
    call, which reads them all under the allocator's lock, so a row is one consistent snapshot
    and has the counters without a function of their own (fragment reclaims, prefetch, stalls,
    allocation sources). Otherwise (TFLMS v2) each counter is read with its
    ``get_<name>(gpu_id)`` function, where one exists.

    ``available`` is False, with ``reason`` saying why, when the statistics cannot be read.

    Args:
        gpu_id: which GPU's allocator to read.
        experimental: the namespace holding the ``get_*`` functions; default
            ``tf.experimental``.
    """

    def __init__(self, gpu_id: int = 0, experimental: Any = None) -> None:
        import tensorflow as tf

        self.gpu_id = gpu_id
        namespace = tf.experimental if experimental is None else experimental
        self.all_stats: Callable[[int], Mapping[str, int]] | None = getattr(
            namespace, "get_lms_stats", None
        )
        self.functions: dict[str, Callable[[int], int]] = {}
        for name in (*COUNTERS.values(), *GAUGES):
            function = getattr(namespace, f"get_{name}", None)
            if function is not None:
                self.functions[name] = function
        self.reason = ""
        if self.all_stats is None and "num_allocs" not in self.functions:
            self.reason = (
                f"LMS statistics need TensorFlow built with the tflms patch; TensorFlow "
                f"{tf.__version__} has no tf.experimental.get_num_allocs"
            )
            return
        try:
            probe = self()["num_allocs"]
        except Exception as exc:  # the patched API raises when there is no such GPU
            self.reason = f"LMS statistics for GPU {gpu_id} are unavailable: {exc}"
            return
        if probe < 0:  # TFLMS returned -1 when there was no GPU
            self.reason = f"LMS statistics for GPU {gpu_id} are unavailable (no GPU)"

    @property
    def available(self) -> bool:
        return not self.reason

    def __call__(self) -> dict[str, int]:
        if self.all_stats is not None:
            return {str(k): int(v) for k, v in self.all_stats(self.gpu_id).items()}
        return {name: int(function(self.gpu_id)) for name, function in self.functions.items()}


class LMSStatsLogger(keras.callbacks.Callback):
    """Logs per-step LMS statistics to a CSV file (and optionally TensorBoard).

    Args:
        logfile: CSV file to write (its directory is created); overwritten if it exists.
        gpu_id: which GPU's allocator to read.
        warmup_steps: training steps per run left out of the summary's per-step means (the
            first steps build the graph and fill the allocator).
        tensorboard_dir: if set, also write every figure as a TensorBoard scalar there.
        stats: where counters come from; default: the patched TensorFlow's tf.experimental
            functions. Any callable returning {counter name: value} works (tests, other sources).
    """

    def __init__(
        self,
        logfile: str | os.PathLike[str],
        gpu_id: int = 0,
        warmup_steps: int = 0,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        stats: StatsReader | None = None,
    ) -> None:
        super().__init__()
        self.logfile = Path(logfile)
        self.summary_file = self.logfile.with_suffix(".summary.csv")
        self.warmup_steps = warmup_steps
        self.tensorboard_dir = Path(tensorboard_dir) if tensorboard_dir else None
        if stats is None:
            source = TensorFlowLMSStats(gpu_id)
            self.stats: StatsReader | None = source if source.available else None
            self.unavailable_reason = source.reason
        else:
            self.stats = stats
            self.unavailable_reason = ""
        self.rows: list[dict[str, Any]] = []
        self._epoch = 0
        self._global_step = 0
        self._train_steps = 0
        self._begin: dict[str, tuple[float, Mapping[str, int]]] = {}
        self._file: TextIO | None = None
        self._writer: Any = None
        self._tb_writer: Any = None
        self._warned = False
        self._started = False

    # ------------------------------------------------------------------ file handling
    def _open(self) -> None:
        if self._file is not None:
            return
        if self.stats is None and not self._warned:
            print(
                f"LMSStatsLogger: {self.unavailable_reason}. Logging step durations only.",
                file=sys.stderr,
            )
            self._warned = True
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        # A later evaluate()/predict() after fit() appends to the same log.
        mode = "a" if self._started else "w"
        self._file = open(self.logfile, mode, newline="")  # noqa: SIM115 (closed in _close)
        self._writer = csv.writer(self._file)
        if not self._started:
            self._writer.writerow(COLUMNS)
            self._started = True
        if self.tensorboard_dir is not None and self._tb_writer is None:
            if importlib.util.find_spec("tensorboard") is None:
                # tf.summary.scalar needs the tensorboard package, which tensorflow-cpu lacks.
                print(
                    "LMSStatsLogger: TensorBoard logging needs the tensorboard package "
                    "(pip install tensorboard); writing the CSV only.",
                    file=sys.stderr,
                )
                self.tensorboard_dir = None
            else:
                import tensorflow as tf

                self._tb_writer = tf.summary.create_file_writer(str(self.tensorboard_dir))

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Close the CSV file (fit() does this itself at the end of training)."""
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb_writer is not None:
            self._tb_writer.flush()

    # ------------------------------------------------------------------ per step
    def _read(self) -> Mapping[str, int]:
        return self.stats() if self.stats is not None else {}

    def _step_begin(self, kind: str) -> None:
        self._open()
        self._begin[kind] = (time.perf_counter(), self._read())

    def _step_end(self, kind: str, step: int) -> None:
        if kind not in self._begin:
            return
        started, before = self._begin.pop(kind)
        after = self._read()
        duration = time.perf_counter() - started
        row: dict[str, Any] = {
            "step type": kind,
            "epoch": self._epoch,
            "step": step,
            "duration": duration,
        }
        for column, counter in COUNTERS.items():
            if counter in after and counter in before:
                delta = after[counter] - before[counter]
                row[column] = delta * _UNIT_SCALE.get(column, 1)
            else:
                row[column] = None
        self.rows.append(row)
        assert self._writer is not None
        self._writer.writerow(["" if row[c] is None else row[c] for c in COLUMNS])
        self._global_step += 1
        if self._tb_writer is not None:
            import tensorflow as tf

            with self._tb_writer.as_default(step=self._global_step):
                for column in COLUMNS[3:]:
                    if row[column] is not None:
                        tf.summary.scalar(f"lms_{kind}/{column}", row[column])

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._step_begin("train")

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._step_end("train", batch)
        self._train_steps += 1

    def on_test_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._step_begin("test")

    def on_test_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._step_end("test", batch)

    def on_predict_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._step_begin("predict")

    def on_predict_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._step_end("predict", batch)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self.write_summary()
        self._close()

    def on_test_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self._flush()

    def on_predict_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self._flush()

    # ------------------------------------------------------------------ aggregates
    def summary(self) -> dict[str, dict[str, float]]:
        """Totals and per-step means of the training steps after the warm-up steps."""
        train = [r for r in self.rows if r["step type"] == "train"][self.warmup_steps :]
        result: dict[str, dict[str, float]] = {}
        for column in COLUMNS[3:]:
            values = [r[column] for r in train if r[column] is not None]
            if values:
                result[column] = {
                    "total": float(sum(values)),
                    "mean per step": float(sum(values)) / len(values),
                    "steps": float(len(values)),
                }
        if self.stats is not None:
            now = self._read()
            for gauge in GAUGES:
                if gauge in now:
                    result[gauge] = {"total": float(now[gauge]), "mean per step": 0.0, "steps": 0.0}
        return result

    def write_summary(self) -> None:
        figures = self.summary()
        self.summary_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.summary_file, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(("statistic", "total", "mean per step", "steps"))
            for name, values in figures.items():
                writer.writerow((name, values["total"], values["mean per step"], values["steps"]))
        if self._tb_writer is not None:
            import tensorflow as tf

            with self._tb_writer.as_default(step=self._global_step):
                for name, values in figures.items():
                    tf.summary.scalar(f"lms_summary/{name}", values["total"])
