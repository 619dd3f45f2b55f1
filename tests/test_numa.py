"""NUMA pinning: GPU discovery from fake sysfs/proc trees, and real launches of commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tflms.build.numa import (
    Gpu,
    NumaError,
    gpu_numa_node,
    gpus_from_proc,
    gpus_from_sysfs,
    normalize_bus_id,
    numa_nodes,
    parse_nvidia_smi,
    plan_numa,
    visible_gpus,
)

REPO = Path(__file__).resolve().parents[1]


def fake_sysfs(root: Path, nodes: int, gpus: dict[str, int]) -> Path:
    """A sysfs tree with `nodes` NUMA nodes and NVIDIA GPUs {bus id: numa_node}."""
    for n in range(nodes):
        (root / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
    (root / "devices" / "system" / "node" / "online").write_text(f"0-{max(nodes - 1, 0)}\n")
    pci = root / "bus" / "pci" / "devices"
    pci.mkdir(parents=True, exist_ok=True)
    for bus, node in gpus.items():
        dev = pci / bus
        dev.mkdir()
        (dev / "vendor").write_text("0x10de\n")
        (dev / "class").write_text("0x030200\n")
        (dev / "numa_node").write_text(f"{node}\n")
    # A non-GPU device must be ignored.
    nic = pci / "0000:00:1f.6"
    nic.mkdir()
    (nic / "vendor").write_text("0x8086\n")
    (nic / "class").write_text("0x020000\n")
    (nic / "numa_node").write_text("0\n")
    return root


def fake_numactl(bin_dir: Path, record: Path) -> Path:
    """A numactl stand-in that records its options and runs the command after them."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "numactl"
    script.write_text(f'#!/bin/sh\necho "$1 $2" > {record}\nshift 2\nexec "$@"\n')
    script.chmod(0o755)
    return script


def no_tools(_: str) -> str | None:
    return None


def test_bus_ids_are_normalised_to_sysfs_form() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:af:00.1") == "0000:af:00.1"
    assert normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    with pytest.raises(ValueError):
        normalize_bus_id("GPU-1234")


def test_nvidia_smi_csv_is_parsed() -> None:
    text = "0, 00000000:3B:00.0, GPU-aaaa\n1, 00000000:AF:00.0, GPU-bbbb\n"
    assert parse_nvidia_smi(text) == [
        Gpu(0, "0000:3b:00.0", "GPU-aaaa"),
        Gpu(1, "0000:af:00.0", "GPU-bbbb"),
    ]


def test_proc_and_sysfs_discovery_number_gpus_in_bus_order(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for bus, uuid in (("0000:af:00.0", "GPU-bbbb"), ("0000:3b:00.0", "GPU-aaaa")):
        d = proc / "driver" / "nvidia" / "gpus" / bus
        d.mkdir(parents=True)
        (d / "information").write_text(
            f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"
        )
    assert gpus_from_proc(proc) == [
        Gpu(0, "0000:3b:00.0", "GPU-aaaa"),
        Gpu(1, "0000:af:00.0", "GPU-bbbb"),
    ]
    sysfs = fake_sysfs(tmp_path / "sys", 2, {"0000:af:00.0": 1, "0000:3b:00.0": 0})
    assert gpus_from_sysfs(sysfs) == [Gpu(0, "0000:3b:00.0"), Gpu(1, "0000:af:00.0")]
    assert numa_nodes(sysfs) == [0, 1]
    assert gpu_numa_node(sysfs, "0000:af:00.0") == 1


def test_cuda_visible_devices_selects_by_index_and_uuid() -> None:
    gpus = [Gpu(0, "0000:3b:00.0", "GPU-aaaa"), Gpu(1, "0000:af:00.0", "GPU-bbbb")]
    assert visible_gpus(gpus, None) == gpus
    assert visible_gpus(gpus, "1") == [gpus[1]]
    assert visible_gpus(gpus, "GPU-bb,0") == [gpus[1], gpus[0]]
    assert visible_gpus(gpus, "") == []
    assert visible_gpus(gpus, "0,7,1") == [gpus[0]]  # CUDA stops at the first bad entry
    with pytest.raises(NumaError, match="MIG"):
        visible_gpus(gpus, "MIG-1234")


def test_single_node_plans_a_plain_run(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 1, {"0000:3b:00.0": 0})
    plan = plan_numa("auto", env={}, sysfs_root=sysfs, proc_root=tmp_path, which=no_tools)
    assert plan.prefix == [] and "one NUMA node" in plan.message


def test_gpu_node_is_chosen_from_sysfs(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 2, {"0000:3b:00.0": 0, "0000:af:00.0": 1})

    def which(name: str) -> str | None:
        return "/usr/bin/numactl" if name == "numactl" else None

    kw = {"sysfs_root": sysfs, "proc_root": tmp_path, "which": which}
    one = plan_numa("auto", env={"CUDA_VISIBLE_DEVICES": "1"}, **kw)
    assert one.prefix == ["/usr/bin/numactl", "--cpunodebind=1", "--membind=1"]
    both = plan_numa("auto", env={}, **kw)
    assert both.prefix == [] and "nodes [0, 1]" in both.message
    ranked = plan_numa("auto", "local-rank", env={"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, **kw)
    assert ranked.node == 0
    with pytest.raises(NumaError, match="local rank"):
        plan_numa("auto", "local-rank", env={}, **kw)
    explicit = plan_numa("1", env={}, **kw)
    assert explicit.prefix[1:] == ["--cpunodebind=1", "--membind=1"]
    with pytest.raises(NumaError, match="does not exist"):
        plan_numa("5", env={}, **kw)


def test_unknown_gpu_node_names_the_way_out(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 2, {"0000:3b:00.0": -1})
    with pytest.raises(NumaError) as err:
        plan_numa("auto", env={}, sysfs_root=sysfs, proc_root=tmp_path, which=no_tools)
    assert "--numa N" in str(err.value) and "0000:3b:00.0" in str(err.value)


def test_missing_numa_information_runs_unpinned(tmp_path: Path) -> None:
    plan = plan_numa("auto", env={}, sysfs_root=tmp_path, proc_root=tmp_path, which=no_tools)
    assert plan.prefix == [] and "no NUMA information" in plan.message


def _tflms_run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tflms", "run", *args],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(REPO)},
        timeout=120,
    )


def test_cli_single_node_runs_the_command_plainly(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 1, {"0000:3b:00.0": 0})
    out = tmp_path / "ran"
    proc = _tflms_run(
        [f"--sysfs-root={sysfs}", f"--proc-root={tmp_path}", "--", sys.executable, "-c",
         f"open({str(out)!r}, 'w').write('yes'); raise SystemExit(3)"],
        {"PATH": str(tmp_path / "empty")},
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert out.read_text() == "yes"
    assert "one NUMA node" in proc.stderr


def test_cli_missing_numactl_says_what_to_install(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 2, {"0000:3b:00.0": 1})
    (tmp_path / "empty").mkdir()
    proc = _tflms_run(
        [f"--sysfs-root={sysfs}", f"--proc-root={tmp_path}", "--", sys.executable, "-c", "0"],
        {"PATH": str(tmp_path / "empty")},
    )
    assert proc.returncode == 2
    assert "numactl was not found" in proc.stderr and "apt-get install numactl" in proc.stderr
    assert "--numa none" in proc.stderr


def test_cli_pins_through_numactl(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 2, {"0000:3b:00.0": 0, "0000:af:00.0": 1})
    record = tmp_path / "numactl-args"
    fake_numactl(tmp_path / "bin", record)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "1"}
    proc = _tflms_run(
        [f"--sysfs-root={sysfs}", f"--proc-root={tmp_path}", "--", sys.executable, "-c",
         "raise SystemExit(5)"],
        env,
    )  # fmt: skip
    assert proc.returncode == 5, proc.stderr
    assert record.read_text().split() == ["--cpunodebind=1", "--membind=1"]


def test_numa_pin_script_runs_plainly_on_one_node(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 1, {})
    proc = subprocess.run(
        [str(REPO / "scripts" / "numa_pin.sh"), f"--sysfs-root={sysfs}", "--",
         sys.executable, "-c", "print('inside')"],
        capture_output=True,
        text=True,
        env={**os.environ, "TFLMS_PYTHON": sys.executable},
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "inside"


def test_cli_unknown_command_and_numa_none(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", 2, {"0000:3b:00.0": 1})
    missing = _tflms_run(
        [f"--sysfs-root={sysfs}", "--numa", "none", "--", "no-such-program-tflms"],
        {"PATH": "/usr/bin:/bin"},
    )
    assert missing.returncode == 127
    assert (
        "NUMA pinning off" in missing.stderr
        and "cannot run no-such-program-tflms" in missing.stderr
    )
