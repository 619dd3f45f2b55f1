"""The host side of LMS as TensorFlow sizes it: the pinned pool reclaimed tensors live in.

Inside TensorFlow, LMS pages tensors out into the `gpu_host_bfc` allocator that
`GPUProcessState::GetGpuHostAllocator` creates. Its byte limit is, in this order:

1. `GPUOptions.experimental.gpu_host_mem_limit_in_mb` when it is set (> 0);
2. else the environment variable `TF_GPU_HOST_MEM_LIMIT_IN_MB`;
3. else 1 << 17 MB = 128 GiB (TensorFlow raised it from 1 << 16 in 2023; the
   GPUOptions field exists in the 2.21.0 wheel's config.pb.h).

The allocator is made once per process: every later call returns the first one
(whatever NUMA node is asked for), so all GPUs one process drives share one
limit. The pool is pinned memory, so it also needs that much physical RAM, and
the same RAM holds the input pipeline, the TensorFlow runtime and the operating
system. The planner therefore gives one GPU's LMS the smaller of its share of
the limit and its share of the RAM left over once those are paid for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 1 << 30
MIB = 1 << 20

# TensorFlow's default TF_GPU_HOST_MEM_LIMIT_IN_MB (gpu_process_state.cc).
TF_HOST_LIMIT_DEFAULT_MB = 1 << 17

# Assumption (stated in docs/planner.md): what one training process needs in host RAM
# besides the pinned pool: its share of the operating system, the Python and TensorFlow
# runtime with the CUDA context, and a tf.data input pipeline (shuffle buffer of encoded
# images, a few decoded batches prefetched). 16 GiB is generous for ImageNet-style
# pipelines; a pipeline that caches its data set in memory needs far more.
PROCESS_RESERVE_BYTES = 16 * GIB

HOST_LIMIT = "TF_GPU_HOST_MEM_LIMIT_IN_MB"
HOST_RAM = "host RAM"


@dataclasses.dataclass(frozen=True)
class HostSide:
    """Host memory around one GPU: the machine's RAM and TensorFlow's pinned-pool limit.

    ram_bytes: RAM of the whole machine; gpus: GPUs in it, all training, one process per
    `gpus_per_process` of them (1: Horovod style, one process per GPU).
    limit_mb: TF_GPU_HOST_MEM_LIMIT_IN_MB (or gpu_host_mem_limit_in_mb); None: TF's default.
    """

    ram_bytes: int
    gpus: int = 1
    gpus_per_process: int = 1
    limit_mb: float | None = None
    reserve_bytes: int = PROCESS_RESERVE_BYTES

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_process < 1:
            raise ValueError("a host needs at least one GPU and one GPU per process")
        if self.gpus_per_process > self.gpus:
            raise ValueError(
                f"{self.gpus_per_process} GPUs per process, but the machine has {self.gpus}"
            )
        if self.limit_mb is not None and self.limit_mb <= 0:
            raise ValueError(f"the host memory limit must be positive, got {self.limit_mb} MB")

    @property
    def processes(self) -> int:
        return max(1, self.gpus // self.gpus_per_process)

    @property
    def pool_limit_bytes(self) -> int:
        """The gpu_host_bfc limit of one process (all its GPUs together)."""
        mb = TF_HOST_LIMIT_DEFAULT_MB if self.limit_mb is None else self.limit_mb
        return int(mb * MIB)

    @property
    def ram_for_pool_bytes(self) -> int:
        """RAM one process can pin: its share of the machine's RAM less its own needs."""
        return max(0, self.ram_bytes // self.processes - self.reserve_bytes)

    @property
    def lms_bytes(self) -> int:
        """Host bytes one GPU's reclaimed tensors may occupy."""
        return min(self.pool_limit_bytes, self.ram_for_pool_bytes) // self.gpus_per_process

    @property
    def bound_by(self) -> str:
        """What sets lms_bytes: TensorFlow's limit or the RAM there is to pin."""
        return HOST_LIMIT if self.pool_limit_bytes <= self.ram_for_pool_bytes else HOST_RAM

    def with_limit_mb(self, limit_mb: float | None) -> HostSide:
        return dataclasses.replace(self, limit_mb=limit_mb)

    def scaled(self, factor: float) -> HostSide:
        """This host with `factor` times the pinned memory one GPU gets: the binding
        quantity (the limit, or the RAM) is scaled, so the answer is what raising it gives."""
        if self.bound_by == HOST_LIMIT:
            return self.with_limit_mb(self.pool_limit_bytes * factor / MIB)
        # More RAM: per process, reserve + factor x what is left for the pool; the
        # limit follows so that it does not become the bound instead.
        ram = int((self.reserve_bytes + self.ram_for_pool_bytes * factor) * self.processes)
        limit = max(self.pool_limit_bytes, int(self.ram_for_pool_bytes * factor) + MIB)
        return dataclasses.replace(self, ram_bytes=ram, limit_mb=limit / MIB)

    def to_json(self) -> dict[str, Any]:
        return {
            "ram_bytes": self.ram_bytes,
            "gpus": self.gpus,
            "gpus_per_process": self.gpus_per_process,
            "limit_mb": self.limit_mb,
            "limit_is_default": self.limit_mb is None,
            "pool_limit_bytes": self.pool_limit_bytes,
            "reserve_bytes": self.reserve_bytes,
            "ram_for_pool_bytes": self.ram_for_pool_bytes,
            "lms_bytes": self.lms_bytes,
            "bound_by": self.bound_by,
        }


def fixed_host(nbytes: int) -> HostSide:
    """A host whose LMS gets exactly `nbytes` (the limit binds; RAM is ample)."""
    return HostSide(ram_bytes=nbytes + PROCESS_RESERVE_BYTES + GIB, limit_mb=nbytes / MIB)
