"""With LMS off the engine must allocate exactly like TensorFlow's own tsl::BFCAllocator.

Each case replays one deterministic trace, in lock step, through TensorFlow's
BFC allocator from the tensorflow-cpu wheel's libtensorflow_framework and the
engine over the sim device with LMS off, at a memory limit that makes
allocations fail part-way, and checks that both fail at the same allocations,
hold the same bytes after every step, hand out the same chunk offsets, and end
with the same peak, largest allocation and reserved bytes. The harness binary
is compiled once and cached under build/bench/ by source hash.

TensorFlow reports the bytes it holds in regions as AllocatorStats.pool_bytes
(its bytes_reserved field stays 0 in 2.21); the engine reports them as
bytes_reserved, so that is what the two are compared on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30

pytestmark = pytest.mark.tf


def _load_builder() -> ModuleType:
    return load_bench("harness_build.py", "tflms_bench_harness_build")


@pytest.fixture(scope="module")
def harness() -> tuple[Path, dict[str, str]]:
    builder = _load_builder()
    try:
        binary = builder.build_harness(unity=True)
    except builder.BuildError as err:
        pytest.fail(f"could not build the parity harness: {err}")
    return binary, builder.harness_env()


# (id, harness arguments). Limits sit well below each trace's peak so the
# replay runs out of memory part-way and keeps going past the failures.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("training-growth", {"trace": "training", "steps": 2, "limit": 1536 * MiB}),
    ("training-no-growth", {"trace": "training", "steps": 2, "limit": 1536 * MiB, "growth": 0}),
    ("random-growth", {"trace": "random", "allocs": 60000, "limit": 64 * MiB}),
    ("random-no-growth", {"trace": "random", "allocs": 60000, "limit": 64 * MiB, "growth": 0}),
    ("large-sizes", {"trace": "large", "allocs": 4000, "limit": 3 * GiB}),
    (
        "fragmentation-fraction",
        {"trace": "random", "allocs": 40000, "limit": 64 * MiB, "fraction": 0.01},
    ),
    (
        # The device holds less than the limit: growing fails and both back
        # off in 10% steps.
        "device-refuses",
        {"trace": "training", "steps": 2, "limit": 2 * GiB, "capacity": 1200 * MiB},
    ),
]


def _run_parity(
    harness: tuple[Path, dict[str, str]], params: dict[str, Any], livelock_ok: bool = False
) -> dict[str, Any]:
    """Runs one parity replay; exit status 3 means an allocator would have spun forever."""
    binary, env = harness
    cmd = [str(binary), "parity", *(f"{k}={v}" for k, v in params.items())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    ok = proc.returncode == 0 or (livelock_ok and proc.returncode == 3)
    assert ok, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-500:]}{proc.stderr[-3000:]}"
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _assert_parity(r: dict[str, Any], params: dict[str, Any]) -> None:
    tf, eng = r["tf"], r["engine"]

    # The case must exercise running out of memory, not at the start.
    assert tf["num_ooms"] > 0, "limit too high: TensorFlow never ran out of memory"
    assert 0 < tf["oom_allocs"][0] < r["allocs"]

    assert eng["oom_allocs"] == tf["oom_allocs"], "different allocations failed"
    assert eng["num_ooms"] == tf["num_ooms"]
    assert r["first_outcome_diff"] == -1
    assert r["first_in_use_diff"] == -1, (
        f"bytes in use differ first after op {r['first_in_use_diff']}"
    )
    assert r["first_offset_diff"] == -1, (
        f"chunk placement differs first at op {r['first_offset_diff']}: {r['first_offset_detail']}"
    )
    assert r["first_reserved_diff"] == -1, (
        f"reserved bytes differ first after op {r['first_reserved_diff']}"
    )
    assert eng["num_allocs"] == tf["num_allocs"]
    assert eng["peak_bytes_in_use"] == tf["peak_bytes_in_use"]
    assert eng["largest_alloc_size"] == tf["largest_alloc_size"]
    assert eng["bytes_reserved"] == tf["pool_bytes"]
    assert eng["peak_bytes_reserved"] == tf["peak_pool_bytes"]
    assert eng["bytes_limit"] == tf["bytes_limit"] == params["limit"]
    assert eng["bytes_in_use"] == tf["bytes_in_use"] == 0
    # Checkpoints carry (op, tf in use, engine in use, tf pool, engine reserved).
    cps = r["checkpoints"]
    assert len(cps) % 5 == 0 and len(cps) >= 10
    for i in range(0, len(cps), 5):
        assert cps[i + 1] == cps[i + 2] and cps[i + 3] == cps[i + 4], cps[i : i + 5]


@pytest.mark.parametrize("params", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_engine_with_lms_off_allocates_like_tensorflow_bfc(
    harness: tuple[Path, dict[str, str]], params: dict[str, Any]
) -> None:
    _assert_parity(_run_parity(harness, params), params)


def test_garbage_collection_like_tensorflow_gpu_default(
    harness: tuple[Path, dict[str, str]],
) -> None:
    """TensorFlow's GPU BFC frees wholly free regions before reporting OOM.

    GPUBFCAllocator turns garbage_collection on unless
    TF_ENABLE_GPU_GARBAGE_COLLECTION=false. With allow_growth and large,
    varied sizes this changes which allocations fail. The harness sets
    EngineOptions::garbage_collection to match when the engine has it.
    """
    params = {"trace": "large", "allocs": 4000, "limit": 3 * GiB, "gc": 1}
    r = _run_parity(harness, params)
    if not r["engine_has_gc"]:
        pytest.xfail(
            "engine has no EngineOptions::garbage_collection yet; with TF's GPU default "
            f"the first differing allocation is op {r['first_outcome_diff']} "
            f"(TF {r['tf']['num_ooms']} OOMs, engine {r['engine']['num_ooms']})"
        )
    _assert_parity(r, params)


def test_region_back_off_sizes_like_tensorflow(harness: tuple[Path, dict[str, str]]) -> None:
    """The device holds 1022 MiB + 704482304 bytes: TF's fourth back-off step from 1 GiB
    (float arithmetic) fits exactly, a double-precision step would be 256 bytes larger."""
    params = {"trace": "backpedal", "limit": 4 * GiB, "capacity": 1022 * MiB + 704482304}
    r = _run_parity(harness, params)
    assert r["tf"]["pool_bytes"] == r["capacity"], "TF should have filled the device exactly"
    _assert_parity(r, params)


def test_full_device_fails_small_request_instead_of_spinning(
    harness: tuple[Path, dict[str, str]],
) -> None:
    """Regions of 2 and 4 MiB fill a 6 MiB device, then 256 bytes need a new region.

    TF 2.21's back-off rounds 2304 * 0.9 back up to 2304 and asks the refusing
    device again forever (the harness stops it); the engine must report the
    out-of-memory instead, at that allocation, with the same statistics.
    """
    params = {"trace": "exhaust", "limit": 64 * MiB, "capacity": 6 * MiB}
    both = _run_parity(harness, params, livelock_ok=True)
    if "livelock" not in both:  # a TensorFlow that no longer spins: plain parity
        _assert_parity(both, params)
        return
    assert both["livelock"] == "tf", both
    r = _run_parity(harness, {**params, "side": "engine"})
    eng = r["engine"]
    assert eng["oom_allocs"] == [2] and eng["num_ooms"] == 1
    assert eng["peak_bytes_in_use"] == eng["bytes_reserved"] == 6 * MiB
    assert eng["num_allocs"] == 2 and eng["bytes_in_use"] == 0


def test_the_profile_mode_runs_one_variant_alone(harness: tuple[Path, dict[str, str]]) -> None:
    """`profile` (bench/README.md) replays one bench variant for a profiler; a name that is
    not a variant is refused with the list of names."""
    binary, env = harness
    for variant in ("tf_bfc", "engine_lms_on_tensor"):
        cmd = [str(binary), "profile", f"variant={variant}", "trace=training", "reps=1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout)
        assert out["variant"] == variant and out["trace"] == "training"
        assert out["ns_per_pair"] > 0
    proc = subprocess.run(
        [str(binary), "profile", "variant=engine"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2
    assert "no variant 'engine'" in proc.stderr and "engine_lms_on_buffer" in proc.stderr
