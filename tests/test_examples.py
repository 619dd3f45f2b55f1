"""Tests of examples/: ManyModel.py end to end on the CPU and the LMSStatsLogger callback."""

from __future__ import annotations

import csv
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def import_example(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_manymodel_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    many = import_example("ManyModel")
    with pytest.raises(SystemExit) as exc:
        many.parse_args(["--model", "AlexNet"])
    assert exc.value.code == 2
    assert "unknown --model 'AlexNet'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        many.parse_args(["--no-lms", "--defrag"])
    assert "--defrag needs LMS" in capsys.readouterr().err
    args = many.parse_args(["--model", "resnet152", "--no-lms", "--lms_stats"])
    assert args.model == "ResNet152" and args.lms is False and args.stats is True


@pytest.mark.tf
def test_manymodel_trains_on_cpu_without_the_patch(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "ManyModel.py"),
            "--model",
            "MobileNetV2",
            "--image_size",
            "32",
            "--batch_size",
            "2",
            "--steps",
            "2",
            "--stats",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "has no Large Model Support" in result.stdout
    assert "LMS off" in result.stdout
    assert "statistics need TensorFlow built with the tflms patch" in result.stderr
    callbacks = import_example("callbacks")
    rows = read_csv(out / "MobileNetV2_lms_stats.csv")
    assert tuple(rows[0]) == callbacks.COLUMNS
    assert [row[:3] for row in rows[1:]] == [["train", "0", "0"], ["train", "0", "1"]]
    for row in rows[1:]:
        assert float(row[3]) > 0  # duration
        assert row[4:] == [""] * (len(callbacks.COLUMNS) - 4)  # no statistics on stock TF
    summary = read_csv(out / "MobileNetV2_lms_stats.summary.csv")
    assert summary[0] == ["statistic", "total", "mean per step", "steps"]
    # the default warm-up leaves one of the two steps in the aggregate
    assert summary[1][0] == "duration" and summary[1][3] == "1.0"


class CountingStats:
    """A counter source that behaves like an allocator doing fixed work per read."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> dict[str, int]:
        self.reads += 1
        n = self.reads
        return {
            "num_allocs": 10 * n,
            "num_single_reclaims": n,
            "num_full_reclaims": 0,
            "bytes_reclaimed": n * 2**29,  # half a GiB per read
            "page_in_stall_ns": n * 1_000_000,
            "peak_bytes_in_use": 12345,
        }


@pytest.fixture()
def tiny_model() -> Iterator[object]:
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.rand(12, 4).astype("float32")
    y = np.random.randint(0, 3, size=(12,))
    yield model, x, y


@pytest.mark.tf
def test_stats_logger_writes_step_deltas(tiny_model: tuple, tmp_path: Path) -> None:
    callbacks = import_example("callbacks")
    model, x, y = tiny_model
    source = CountingStats()
    logger = callbacks.LMSStatsLogger(tmp_path / "stats.csv", warmup_steps=2, stats=source)
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[logger], verbose=0)
    model.evaluate(x, y, batch_size=6, callbacks=[logger], verbose=0)
    logger.close()
    rows = read_csv(tmp_path / "stats.csv")
    header, body = tuple(rows[0]), rows[1:]
    assert header == callbacks.COLUMNS
    col = {name: i for i, name in enumerate(header)}
    train = [r for r in body if r[col["step type"]] == "train"]
    test = [r for r in body if r[col["step type"]] == "test"]
    assert [(r[col["epoch"]], r[col["step"]]) for r in train] == [
        ("0", "0"), ("0", "1"), ("0", "2"), ("1", "0"), ("1", "1"), ("1", "2"),
    ]  # fmt: skip
    assert [r[col["step"]] for r in test] == ["0", "1"], "evaluate() appends after fit()"
    for row in train + test:
        # each step reads the counters twice: begin and end
        assert row[col["allocations"]] == "10"
        assert row[col["single reclaims"]] == "1"
        assert row[col["full reclaims"]] == "0"
        assert float(row[col["GiB reclaimed"]]) == 0.5
        assert float(row[col["page-in stall"]]) == pytest.approx(1e-3)
        assert row[col["prefetch hits"]] == ""  # counter this source does not have
        assert float(row[col["duration"]]) > 0
    summary = logger.summary()
    assert summary["allocations"] == {"total": 40.0, "mean per step": 10.0, "steps": 4.0}
    assert summary["peak_bytes_in_use"]["total"] == 12345
    written = read_csv(tmp_path / "stats.summary.csv")
    assert ["allocations", "40.0", "10.0", "4.0"] in written


class PatchedExperimental:
    """The statistics functions of tf.experimental in a TensorFlow built with the tflms patch,
    as the reader sees them: get_lms_stats returns every counter, and get_num_allocs and
    friends read one each. Counts the calls so the test can tell which were used."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.snapshot = 0

    def get_lms_stats(self, gpu_id: int = 0) -> dict[str, int]:
        assert gpu_id == 1
        self.calls.append("get_lms_stats")
        self.snapshot += 1
        n = self.snapshot
        return {
            "num_allocs": 6 * n,
            "num_single_reclaims": n,
            "num_fragment_reclaims": 2 * n,
            "bytes_reclaimed": n * 2**30,
            "prefetch_hits": 3 * n,
            "page_in_stall_ns": 0,
            "num_allocs_from_free": 3 * n,
            "num_allocs_from_new_region": 0,
            "num_allocs_from_single_reclaim": n,
            "num_allocs_from_fragment_reclaim": 2 * n,
            "num_allocs_from_full_reclaim": 0,
            "num_allocs_from_defrag": 0,
        }

    def get_num_allocs(self, gpu_id: int = 0) -> int:
        self.calls.append("get_num_allocs")
        return 0


@pytest.mark.tf
def test_stats_source_reads_every_counter_with_one_get_lms_stats_call(
    tiny_model: tuple, tmp_path: Path
) -> None:
    callbacks = import_example("callbacks")
    api = PatchedExperimental()
    source = callbacks.TensorFlowLMSStats(1, experimental=api)
    assert source.available, source.reason
    assert api.calls == ["get_lms_stats"]  # the availability probe
    api.calls.clear()
    model, x, y = tiny_model
    logger = callbacks.LMSStatsLogger(tmp_path / "stats.csv", stats=source)
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[logger], verbose=0)
    logger.close()
    assert set(api.calls) == {"get_lms_stats"}
    # One call at the begin and one at the end of each of the 3 steps, one for the summary.
    assert len(api.calls) == 7, api.calls
    rows = read_csv(tmp_path / "stats.csv")
    col = {name: i for i, name in enumerate(rows[0])}
    for row in rows[1:]:
        assert row[col["allocations"]] == "6"
        assert row[col["fragment reclaims"]] == "2"
        assert row[col["prefetch hits"]] == "3"
        assert float(row[col["GiB reclaimed"]]) == 1.0
        assert row[col["allocs from free"]] == "3"
        assert row[col["allocs from single reclaim"]] == "1"
        assert row[col["allocs from fragment reclaim"]] == "2"
        assert row[col["allocs from defrag"]] == "0"
        assert row[col["full reclaims"]] == ""  # not in this snapshot


@pytest.mark.tf
def test_stats_source_explains_stock_tensorflow() -> None:
    callbacks = import_example("callbacks")
    source = callbacks.TensorFlowLMSStats(0)
    assert not source.available
    assert "tflms patch" in source.reason and "get_num_allocs" in source.reason


@pytest.mark.tf
def test_stats_logger_writes_tensorboard_scalars(tiny_model: tuple, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard logging needs the tensorboard package")
    import tensorflow as tf

    callbacks = import_example("callbacks")
    model, x, y = tiny_model
    logger = callbacks.LMSStatsLogger(
        tmp_path / "s.csv", tensorboard_dir=tmp_path / "tb", stats=CountingStats()
    )
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[logger], verbose=0)
    tags: dict[str, list[float]] = {}
    for events in (tmp_path / "tb").iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                number = (
                    tf.make_ndarray(value.tensor)
                    if value.HasField("tensor")
                    else value.simple_value
                )
                tags.setdefault(value.tag, []).append(float(number))
    assert tags["lms_train/allocations"] == [10.0, 10.0, 10.0]
    assert tags["lms_summary/allocations"] == [30.0]
    assert len(tags["lms_train/duration"]) == 3
