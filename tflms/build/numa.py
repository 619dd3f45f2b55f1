"""`tflms run --numa auto`: run a program on the CPUs and memory of its GPU's NUMA node.

LMS copies tensors between the GPU and pinned host memory; a copy that crosses the socket
interconnect runs slower than one to the GPU's own node. The node of a PCI device is in
/sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node (-1 when the firmware does not say).

GPUs are found, in order of preference, with `nvidia-smi --query-gpu=index,pci.bus_id,uuid`,
from /proc/driver/nvidia/gpus/*/information, or by scanning sysfs for NVIDIA display devices.
Roots are parameters so tests can build a fake sysfs and proc tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

NVIDIA_VENDOR = "0x10de"
# PCI classes of NVIDIA compute GPUs: VGA controller (0x0300) and 3D controller (0x0302).
GPU_CLASSES = ("0x0300", "0x0302")
# Launchers that tell each process its rank on the node, most specific first.
LOCAL_RANK_ENV = (
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
    "HOROVOD_LOCAL_RANK",
    "LOCAL_RANK",
)
INSTALL_NUMACTL = "install numactl (apt-get install numactl, dnf install numactl)"


class NumaError(RuntimeError):
    """Pinning was asked for but cannot be done; the message says what to change."""


@dataclass(frozen=True)
class Gpu:
    index: int
    bus_id: str  # as sysfs names it: 0000:3b:00.0
    uuid: str | None = None


@dataclass(frozen=True)
class NumaPlan:
    prefix: list[str]  # numactl and its options, or empty for a plain run
    node: int | None
    message: str


def normalize_bus_id(bus_id: str) -> str:
    """nvidia-smi's 00000000:3B:00.0 -> sysfs's 0000:3b:00.0."""
    bus_id = bus_id.strip().lower()
    match = re.fullmatch(r"(?:([0-9a-f]+):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])", bus_id)
    if not match:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, dev, fn = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Parses `nvidia-smi --query-gpu=index,pci.bus_id,uuid --format=csv,noheader`."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 2 or not fields[0].isdigit():
            continue
        uuid = fields[2] if len(fields) > 2 and fields[2] else None
        gpus.append(Gpu(int(fields[0]), normalize_bus_id(fields[1]), uuid))
    return gpus


def gpus_from_proc(proc_root: Path) -> list[Gpu]:
    """GPUs from the NVIDIA driver's /proc files, numbered in PCI bus order like nvidia-smi."""
    found = []
    for info in sorted((proc_root / "driver" / "nvidia" / "gpus").glob("*/information")):
        fields: dict[str, str] = {}
        for line in info.read_text(errors="replace").splitlines():
            if ":" in line:
                key, value = line.split(":", 1)
                fields[key.strip()] = value.strip()
        bus = fields.get("Bus Location") or info.parent.name
        try:
            found.append((normalize_bus_id(bus), fields.get("GPU UUID")))
        except ValueError:
            continue
    return [Gpu(i, bus, uuid) for i, (bus, uuid) in enumerate(sorted(found))]


def gpus_from_sysfs(sysfs_root: Path) -> list[Gpu]:
    found = []
    for dev in sorted((sysfs_root / "bus" / "pci" / "devices").glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            klass = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and klass[:6] in GPU_CLASSES:
            found.append(normalize_bus_id(dev.name))
    return [Gpu(i, bus) for i, bus in enumerate(sorted(found))]


def list_gpus(
    sysfs_root: Path = Path("/sys"),
    proc_root: Path = Path("/proc"),
    which: Callable[[str], str | None] = shutil.which,
) -> list[Gpu]:
    smi = which("nvidia-smi")
    if smi:
        try:
            proc = subprocess.run(
                [smi, "--query-gpu=index,pci.bus_id,uuid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if proc.returncode == 0:
                gpus = parse_nvidia_smi(proc.stdout)
                if gpus:
                    return gpus
        except (OSError, subprocess.TimeoutExpired):
            pass
    return gpus_from_proc(proc_root) or gpus_from_sysfs(sysfs_root)


def visible_gpus(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA program sees under CUDA_VISIBLE_DEVICES, in its order."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if not entry:
            break
        if entry.isdigit():
            match = [g for g in gpus if g.index == int(entry)]
        elif entry.startswith("MIG-"):
            raise NumaError(
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}) whose GPU cannot be told "
                "from sysfs: pass --numa N with the node of its GPU, or --numa none."
            )
        else:
            match = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        chosen.append(match[0])
    return chosen


def local_rank(env: Mapping[str, str]) -> int | None:
    for key in LOCAL_RANK_ENV:
        value = env.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return None


def gpu_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """The NUMA node sysfs gives for a PCI device; None when unknown (missing or -1)."""
    try:
        value = int((sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def numa_nodes(sysfs_root: Path) -> list[int]:
    base = sysfs_root / "devices" / "system" / "node"
    nodes = []
    for entry in base.glob("node*"):
        suffix = entry.name[len("node") :]
        if suffix.isdigit():
            nodes.append(int(suffix))
    return sorted(nodes)


def _numactl_prefix(node: int, which: Callable[[str], str | None], why: str) -> list[str]:
    numactl = which("numactl")
    if not numactl:
        raise NumaError(
            f"{why}, but numactl was not found: {INSTALL_NUMACTL}, or run with --numa none."
        )
    return [numactl, f"--cpunodebind={node}", f"--membind={node}"]


def plan_numa(
    numa: str,
    gpu: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    sysfs_root: Path = Path("/sys"),
    proc_root: Path = Path("/proc"),
    which: Callable[[str], str | None] = shutil.which,
) -> NumaPlan:
    """Decides how to launch: under numactl on one node, or plainly (with the reason)."""
    env = os.environ if env is None else env
    if numa == "none":
        return NumaPlan([], None, "NUMA pinning off (--numa none)")
    nodes = numa_nodes(sysfs_root)
    if numa != "auto":
        if not numa.isdigit():
            raise NumaError(f"--numa takes auto, none or a node number, not {numa!r}.")
        node = int(numa)
        if nodes and node not in nodes:
            raise NumaError(f"NUMA node {node} does not exist here (nodes: {nodes}).")
        prefix = _numactl_prefix(node, which, f"--numa {node} asks for pinning")
        return NumaPlan(prefix, node, f"pinned to NUMA node {node} (--numa {node})")

    if not nodes:
        return NumaPlan(
            [],
            None,
            f"no NUMA information under {sysfs_root}/devices/system/node: running unpinned",
        )
    if len(nodes) == 1:
        return NumaPlan([], None, "one NUMA node: running without numactl")

    gpus = visible_gpus(list_gpus(sysfs_root, proc_root, which), env.get("CUDA_VISIBLE_DEVICES"))
    if not gpus:
        return NumaPlan([], None, "no visible NVIDIA GPU found: running unpinned")
    if gpu is not None:
        if gpu == "local-rank":
            rank = local_rank(env)
            if rank is None:
                raise NumaError(
                    "--gpu local-rank, but no launcher set a local rank ("
                    + ", ".join(LOCAL_RANK_ENV)
                    + "): launch under mpirun/horovodrun/srun/torchrun, or pass --gpu N."
                )
            gpus = [gpus[rank % len(gpus)]]
        elif gpu.isdigit() and int(gpu) < len(gpus):
            gpus = [gpus[int(gpu)]]
        else:
            raise NumaError(
                f"--gpu {gpu}: there are {len(gpus)} visible GPUs (0..{len(gpus) - 1})."
            )

    placed = {g.bus_id: gpu_numa_node(sysfs_root, g.bus_id) for g in gpus}
    unknown = [bus for bus, node in placed.items() if node is None]
    if unknown:
        raise NumaError(
            f"sysfs gives no NUMA node for GPU {', '.join(unknown)} (numa_node missing or -1, "
            "as firmware on some hosts leaves it): pass --numa N to choose the node, or "
            "--numa none."
        )
    distinct = sorted({n for n in placed.values() if n is not None})
    if len(distinct) > 1:
        return NumaPlan(
            [],
            None,
            f"the visible GPUs sit on NUMA nodes {distinct}: one process cannot be pinned to "
            "all of them, running unpinned (run one process per GPU with --gpu local-rank, "
            "or pass --numa N)",
        )
    node = distinct[0]
    names = ", ".join(f"GPU {g.index} ({g.bus_id})" for g in gpus)
    prefix = _numactl_prefix(node, which, f"{names} is on NUMA node {node}")
    return NumaPlan(prefix, node, f"{names} on NUMA node {node}: pinned with numactl")


def exec_pinned(command: list[str], plan: NumaPlan) -> NoReturn:
    """Replaces this process with the command, so signals and the exit status are its own."""
    argv = [*plan.prefix, *command]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        raise NumaError(f"cannot run {argv[0]}: {exc.strerror}") from exc


def run_pinned(command: list[str], plan: NumaPlan) -> int:
    """Runs the command under the plan and returns its exit status."""
    try:
        return subprocess.call([*plan.prefix, *command])
    except FileNotFoundError as exc:
        raise NumaError(f"cannot run {command[0]}: {exc.strerror}") from exc
