"""Models of GPUs and host links the planner replays traces on.

A modelled GPU has a memory size, an effective compute rate and an effective
memory bandwidth. An op takes ``max(flops / compute rate, bytes moved /
bandwidth)`` plus a fixed launch cost on the host. The effective rates and the
share of the traced memory traffic that real kernels move are calibrated
so that the modelled ResNet50 training step matches published single-GPU
throughputs (see CALIBRATION and docs/results.md).

Link figures are measured pinned-copy rates in one direction, not data-sheet
numbers (docs/reference: PCIe 3 about 12 GB/s, PCIe 4 about 24, PCIe 5 about
52, NVLink 2 on POWER9 about 68; NVLink-C2C 450 is the data-sheet figure, no
measured one was at hand). Which GPU ships on which link is in machines.py.
"""

from __future__ import annotations

import dataclasses
import re

GIB = 1 << 30
MIB = 1 << 20
GB = 1e9

# Achieved fraction of the 16-bit tensor-core peak on a mixed-precision step's ops: an
# assumption, not a calibration (no published TensorFlow per-op transformer figure was at hand;
# large-model training reports 40-55% of peak). docs/transformers.md labels these figures.
HALF_EFFICIENCY = 0.40
# Dense 16-bit tensor-core peaks in TFLOPS (fp16 on V100, bfloat16 from A100 on), by GPU family.
HALF_PEAK_TFLOPS = {"v100": 125.0, "a100": 312.0, "h100": 989.0, "gh200": 989.0}

# Share of the trace's per-op memory traffic (bytes_accessed: every input read and
# output written in full) that real kernels move; fitted, see CALIBRATION below.
MEMORY_TRAFFIC = 0.352


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """A modelled accelerator. Rates are the data-sheet peaks for fp32 training."""

    name: str
    memory_bytes: int  # what the allocator gets (TensorFlow's default limit: TF_MEMORY_LIMIT_MIB)
    peak_tflops: float  # fp32 (or TF32 where TensorFlow uses it for fp32 by default)
    mem_gbps: float  # device memory bandwidth, GB/s
    compute_efficiency: float  # achieved fraction of peak_tflops on large kernels
    memory_efficiency: float  # achieved fraction of mem_gbps on streaming kernels
    launch_overhead_us: float  # host time to launch one op (TF executor + driver)
    description: str
    memory_traffic: float = MEMORY_TRAFFIC
    # Dense 16-bit tensor-core peak (fp16 on V100, bfloat16 from A100 on): ops whose output is
    # 16-bit run at HALF_EFFICIENCY of it.
    half_peak_tflops: float = 0.0
    # The card's whole memory; 0 where it is not a real card's.
    card_bytes: int = 0

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.mem_gbps * GB * self.memory_efficiency

    @property
    def device_copy_gbps(self) -> float:
        # A device-to-device move reads and writes every byte.
        return self.mem_gbps * self.memory_efficiency / 2

    def with_memory(self, memory_bytes: int) -> GpuModel:
        return dataclasses.replace(self, memory_bytes=memory_bytes)

    def whole_card(self) -> tuple[GpuModel, str]:
        """This GPU with the card's whole memory for the allocator, and that what-if in words."""
        if not self.card_bytes:
            raise ValueError(f"{self.name} is not a real card: give its memory as a size")
        what = f"all {format_bytes(self.card_bytes)} of the card for TensorFlow"
        return self.with_memory(self.card_bytes), what

    def with_tflops(self, effective_tflops: float) -> GpuModel:
        """The same GPU with an effective compute rate of `effective_tflops`."""
        return dataclasses.replace(
            self,
            peak_tflops=effective_tflops,
            compute_efficiency=1.0,
            half_peak_tflops=0.0,
            name=f"{self.name}*",
        )

    @property
    def half_flops_per_s(self) -> float:
        if self.half_peak_tflops <= 0:
            return self.flops_per_s
        return max(self.flops_per_s, self.half_peak_tflops * 1e12 * HALF_EFFICIENCY)

    def op_seconds(self, flops: float, bytes_accessed: float, half: bool = False) -> float:
        """Kernel time of one op on this GPU (no launch cost); `half`: a 16-bit op."""
        rate = self.half_flops_per_s if half else self.flops_per_s
        return max(flops / rate, bytes_accessed * self.memory_traffic / self.bytes_per_s)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A published throughput the efficiency factors were fitted to."""

    gpu: str
    model: str
    batch_size: int
    images_per_s: float
    precision: str
    source: str


# Published single-GPU ResNet-50 v1.5 training throughputs from NVIDIA's own
# TensorFlow benchmark (DeepLearningExamples). The V100 figure is without XLA:
# LMS tracks tensors per op, so the step it runs is TensorFlow's per-op executor,
# which is also what the trace records. No per-op (non-XLA) A100 figure was
# found; its XLA figure is used, which makes the modelled A100 compute fast and
# the predicted LMS overheads on it pessimistic (docs/results.md).
CALIBRATION: dict[str, Calibration] = {
    "v100-16gb": Calibration(
        "v100-16gb",
        "ResNet50",
        128,
        364.9,
        "fp32",
        "NVIDIA DeepLearningExamples, TensorFlow/Classification/RN50v1.5 README (May 2019), "
        "DGX-1 (V100 16G), 1 GPU, FP32, tensorflow-19.05 container, no XLA",
    ),
    "a100-40gb": Calibration(
        "a100-40gb",
        "ResNet50",
        256,
        909.0,
        "tf32",
        "NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5 README, "
        "DGX A100 (A100 40GB), 1 GPU, TF32 + XLA, tensorflow 20.06 container",
    ),
}

# The limit TensorFlow gives its GPU allocator on each card with no memory options set:
# N from its log line `Created device ... with N MB memory` (MiB), the newest found in
# published logs. TensorFlow takes the memory free once the CUDA context exists, less a
# reserve (MinSystemMemory in gpu_device.cc: 1050 MiB at compute capability 7, 1536 MiB
# at 8, 1800 MiB at 9 and above), so N varies by tens of MiB with the driver and the
# TensorFlow version. A card's whole memory is a what-if (`tflms simulate --memory card`).
TF_MEMORY_LIMIT_MIB: dict[str, int] = {
    "v100-16gb": 14684,  # Tesla V100-SXM2-16GB, TensorFlow 2.6's log (none newer found)
    "v100-32gb": 31134,  # Tesla V100-SXM2-32GB
    "a100-40gb": 38482,  # NVIDIA A100-SXM4-40GB
    "a100-80gb": 79261,  # NVIDIA A100-SXM4-80GB
    "h100-80gb": 78763,  # NVIDIA H100 80GB HBM3
    "gh200-96gb": 94915,  # NVIDIA GH200 120GB (96 GB of HBM3)
}


# The calibration (`tflms results --calibrate`, on the Keras ResNet50 trace):
# memory_efficiency is the usual achievable fraction of HBM bandwidth for
# streaming kernels, and the V100's compute efficiency is assumed to be what
# cuDNN reaches on fp32 convolutions (0.80). MEMORY_TRAFFIC is then fitted to
# the V100 figure, and the A100's compute efficiency to the A100 figure.
#
# Each GPU's memory_bytes is what TensorFlow gives its allocator there (TF_MEMORY_LIMIT_MIB),
# not the card's whole memory (card_bytes): LMS works within TensorFlow's default limit.
GPUS: dict[str, GpuModel] = {
    g.name: dataclasses.replace(
        g,
        half_peak_tflops=HALF_PEAK_TFLOPS[g.name.split("-")[0]],
        memory_bytes=TF_MEMORY_LIMIT_MIB[g.name] * MIB,
        card_bytes=g.memory_bytes,
    )
    for g in (
        GpuModel("v100-16gb", 16 * GIB, 15.7, 900.0, 0.80, 0.80, 5.0, "NVIDIA V100 SXM2 16 GB"),
        GpuModel("v100-32gb", 32 * GIB, 15.7, 900.0, 0.80, 0.80, 5.0, "NVIDIA V100 SXM2 32 GB"),
        GpuModel("a100-40gb", 40 * GIB, 156.0, 1555.0, 0.257, 0.80, 5.0, "NVIDIA A100 SXM4 40 GB"),
        GpuModel("a100-80gb", 80 * GIB, 156.0, 2039.0, 0.257, 0.80, 5.0, "NVIDIA A100 SXM4 80 GB"),
        # No published TensorFlow fp32 figure was used for H100: it inherits the
        # A100's fitted fractions (uncertain; docs/results.md says so).
        GpuModel("h100-80gb", 80 * GIB, 494.7, 3350.0, 0.257, 0.80, 5.0, "NVIDIA H100 SXM5 80 GB"),
        # The GH200's H100 has the H100 SXM5's peaks with 96 GB of HBM3 at 4 TB/s.
        GpuModel("gh200-96gb", 96 * GIB, 494.7, 4000.0, 0.257, 0.80, 5.0, "NVIDIA GH200 96 GB"),
    )
}

DEFAULT_GPU = "v100-16gb"


# Measured pinned host<->device copy rates, GB/s per direction.
LINKS: dict[str, float] = {
    "pcie3": 12.0,
    "pcie4": 24.0,
    "pcie5": 52.0,
    "nvlink2-power9": 68.0,
    "c2c": 450.0,
}
DEFAULT_LINK = "pcie3"  # the default GPU's (dgx1-v100 in machines.py)
DEFAULT_LINK_LATENCY_US = 10.0

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}


def parse_size(text: str) -> int:
    """Bytes in '16GiB', '80 GB', '512MiB', '1.5t' or a plain integer."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot read the size {text!r}: write a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB or KB, MB, GB, TB), e.g. 16GiB"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_link(text: str) -> tuple[str, float]:
    """(name, GB/s per direction) for a link name or a number of GB/s."""
    key = text.strip().lower()
    if key in LINKS:
        return key, LINKS[key]
    try:
        gbps = float(key.removesuffix("gb/s").removesuffix("gbps"))
    except ValueError:
        raise ValueError(
            f"unknown host link {text!r}: use one of {', '.join(LINKS)} or a bandwidth in GB/s"
        ) from None
    if gbps <= 0:
        raise ValueError(f"host link bandwidth must be positive, got {text!r}")
    return f"{gbps:g}GB/s", gbps


def get_gpu(name: str) -> GpuModel:
    try:
        return GPUS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}") from None


def format_bytes(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
