"""`tflms simulate --tune-lookahead` (tflms/planner/lookahead.py): the real engine replays
paging on demand and prefetch at each lookahead, and the lookahead it recommends is the one
that beat paging on demand, or none."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tflms.planner.lookahead import (
    DEFAULT_LOOKAHEAD,
    Run,
    format_tuning,
    parse_lookaheads,
    recommend,
    tune_lookahead,
)
from tflms.planner.machines import get_pairing
from tflms.planner.simulate import Machine
from tflms.planner.steadiness import Series


@pytest.mark.tf
def test_unet3d_at_400_on_the_a100_40_is_told_a_shorter_lookahead(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.test_planner import _fresh_trace

    # Here the default lookahead (its look-ahead reaches several tensors of 8-16 GB) made
    # prefetch slower than paging on demand, and 32 uses faster. Since a concat's inputs are
    # gathered before the pins, every lookahead beats paging on demand (11.07 s), and 32
    # (7.67 s) still beats the default (128: 9.96 s; 64: 9.10 s, 256: 10.18 s).
    trace = _fresh_trace(tmp_path_factory, "UNet3D", 1, 400)
    # The card's whole 40 GiB for TensorFlow, where this was found.
    machine = Machine.from_pairing(get_pairing("dgx-a100-40gb")).with_card_memory()
    t = tune_lookahead(trace, machine, [32, DEFAULT_LOOKAHEAD])
    od, short, default = (r.series for r in t.runs)
    assert [r.lookahead for r in t.runs] == [None, 32, DEFAULT_LOOKAHEAD]
    assert od.fits and short.fits and default.fits
    assert len(short.steps) == 30 and short.first == 11 and od.first == 2
    od_mean, short_mean, default_mean = od.mean(), short.mean(), default.mean()
    assert od_mean and short_mean and default_mean
    assert od_mean > default_mean > short_mean
    assert t.recommended == 32
    text = format_tuning(t)
    assert "set_lms_prefetch_lookahead(32)" in text
    assert f"lookahead {DEFAULT_LOOKAHEAD} (default)" in text
    assert t.to_json()["recommended_lookahead"] == 32


def _run(lookahead: int | None, mean: float | None, wanted: int = 30) -> Run:
    # A steady series of that mean, or one that ran out of memory in its third step.
    steps = [mean] * wanted if mean is not None else [1.0, 1.0]
    return Run(lookahead, Series(steps, wanted, 11 if lookahead else 2, "" if mean else "op"))


def test_prefetch_stays_off_unless_a_lookahead_beats_on_demand_by_the_margin() -> None:
    # 0.995 is within steadiness.MARGIN (1%) of on demand: not a win.
    assert recommend([_run(None, 1.0, 6), _run(64, 0.995), _run(256, 1.2)]) is None
    assert recommend([_run(None, 1.0, 6), _run(64, 0.9), _run(256, 0.8)]) == 256
    # Out of memory is never recommended, however fast its steps before were.
    assert recommend([_run(None, 1.0, 6), _run(64, None), _run(128, 0.95)]) == 128
    # Equal means: the default, else the shorter lookahead.
    d = DEFAULT_LOOKAHEAD
    assert recommend([_run(None, 1.0, 6), _run(d // 2, 0.9), _run(d, 0.9)]) == d
    assert recommend([_run(None, 1.0, 6), _run(32, 0.9), _run(64, 0.9)]) == 32
    # On demand out of memory: the fastest prefetch that fits.
    assert recommend([_run(None, None, 6), _run(64, 3.0), _run(128, 2.0)]) == 128
    text = format_tuning_of([_run(None, 1.0, 6), _run(64, None), _run(128, 1.2)])
    assert "Recommendation: prefetch off" in text and "out of memory in step 3 (op)" in text


def format_tuning_of(runs: list[Run]) -> str:
    from tflms.planner.lookahead import Tuning

    return format_tuning(Tuning(runs, recommend(runs)))


@pytest.mark.parametrize("bad", ["", "64,x", "0,128", "-1"])
def test_bad_lookaheads_say_what_to_give(bad: str) -> None:
    with pytest.raises(ValueError, match="--lookaheads"):
        parse_lookaheads(bad)
    assert parse_lookaheads("256,64, 64") == [64, 256]


def _simulate(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tflms", "simulate", "--model", "ResNet50", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_cli_refuses_bad_lookaheads_before_replaying_anything() -> None:
    r = _simulate("--tune-lookahead", "--lookaheads", "64,abc")
    assert r.returncode != 0
    assert "comma-separated whole numbers" in r.stderr
    r = _simulate("--tune-lookahead", "--fixed-addresses")
    assert r.returncode != 0
    assert "drop --fixed-addresses" in r.stderr


def test_the_planner_replays_the_engines_own_default_lookahead() -> None:
    # The planner's constant is kept light to import; the engine's default is the one users
    # get (EngineOptions in core/include/tflms/engine.h), so the two must not drift apart.
    import dataclasses
    import inspect

    from tflms.engine import DEFAULT_PREFETCH_LOOKAHEAD, Engine
    from tflms.planner import replay
    from tflms.planner.replay import EngineConfig
    from tflms.planner.simulate import Machine

    # Read from EngineOptions{}; lookahead.py's is replay.py's, not a copy.
    assert DEFAULT_LOOKAHEAD == replay.DEFAULT_LOOKAHEAD == DEFAULT_PREFETCH_LOOKAHEAD
    for cls in (EngineConfig, Machine):
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        assert fields["prefetch_lookahead"] == DEFAULT_PREFETCH_LOOKAHEAD
    signature = inspect.signature(Engine.__init__)
    assert signature.parameters["prefetch_lookahead"].default == DEFAULT_PREFETCH_LOOKAHEAD
