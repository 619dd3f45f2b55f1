"""Machines that exist: a GPU model on the host link it really ships with, and the host's RAM.

The planner's reports iterate over these pairings. A GPU on another link (a V100 on
PCIe 5), or with another memory size, is a what-if: `tflms simulate --link/--memory`
still answers it, and says that the figure is hypothetical.

Link rates are measured one-direction pinned-copy rates (gpu.LINKS). RAM and GPU
counts are those of the named systems' standard configurations; all GPUs of a
machine are assumed to train, one process each (host.HostSide).
"""

from __future__ import annotations

import dataclasses

from tflms.planner.gpu import LINKS, GpuModel, get_gpu
from tflms.planner.host import GIB, HostSide


@dataclasses.dataclass(frozen=True)
class Pairing:
    """A real machine: GPU model, its host link, RAM and GPU count."""

    name: str
    gpu: str  # key of gpu.GPUS
    link: str  # key of gpu.LINKS
    ram_bytes: int
    gpus: int
    description: str

    @property
    def gpu_model(self) -> GpuModel:
        return get_gpu(self.gpu)

    @property
    def link_gbps(self) -> float:
        return LINKS[self.link]

    def host(self, gpus_per_process: int = 1, limit_mb: float | None = None) -> HostSide:
        return HostSide(self.ram_bytes, self.gpus, gpus_per_process, limit_mb)


PAIRINGS: dict[str, Pairing] = {
    p.name: p
    for p in (
        Pairing(
            "dgx1-v100",
            "v100-16gb",
            "pcie3",
            512 * GIB,
            8,
            "NVIDIA DGX-1: 8 V100 SXM2 16 GB, PCIe 3 to two Xeons, 512 GB RAM",
        ),
        Pairing(
            "ac922-v100",
            "v100-16gb",
            "nvlink2-power9",
            512 * GIB,
            4,
            "IBM Power System AC922 (the TFLMS papers' machine): 4 V100 SXM2 16 GB, "
            "NVLink 2 to two POWER9, 512 GB RAM (configurable 128 GB to 2 TB)",
        ),
        Pairing(
            "dgx-a100-40gb",
            "a100-40gb",
            "pcie4",
            1024 * GIB,
            8,
            "NVIDIA DGX A100 320GB: 8 A100 SXM4 40 GB, PCIe 4, 1 TB RAM",
        ),
        Pairing(
            "dgx-a100-80gb",
            "a100-80gb",
            "pcie4",
            2048 * GIB,
            8,
            "NVIDIA DGX A100 640GB: 8 A100 SXM4 80 GB, PCIe 4, 2 TB RAM",
        ),
        Pairing(
            "dgx-h100",
            "h100-80gb",
            "pcie5",
            2048 * GIB,
            8,
            "NVIDIA DGX H100: 8 H100 SXM5 80 GB, PCIe 5, 2 TB RAM",
        ),
        Pairing(
            "gh200",
            "gh200-96gb",
            "c2c",
            480 * 10**9,
            1,
            "NVIDIA GH200 Grace Hopper: one H100 96 GB on NVLink-C2C to a Grace CPU "
            "with 480 GB LPDDR5X",
        ),
    )
}

DEFAULT_PAIRING = "dgx1-v100"


def get_pairing(name: str) -> Pairing:
    try:
        return PAIRINGS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown machine {name!r}: use one of {', '.join(PAIRINGS)}") from None


def pairings_for_gpu(gpu: str) -> list[Pairing]:
    return [p for p in PAIRINGS.values() if p.gpu == gpu]


def real_pairing(gpu: str, link: str) -> Pairing | None:
    """The machine that pairs this GPU with this link, if one exists."""
    return next((p for p in PAIRINGS.values() if p.gpu == gpu and p.link == link), None)
