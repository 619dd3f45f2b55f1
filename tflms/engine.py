"""The LMS engine from Python: a typed front over the C++ extension ``tflms._core``.

The engine is the same C++ code that the TensorFlow patch compiles into TensorFlow;
here it runs over the ``sim`` backend, whose device memory is a host arena (or, with
``store_data=False``, only addresses and a modelled clock, for planning large GPUs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tflms import _core

OutOfMemoryError = _core.OutOfMemoryError
# The engine's own default (EngineOptions in core/include/tflms/engine.h), in pins.
DEFAULT_PREFETCH_LOOKAHEAD: int = _core.DEFAULT_PREFETCH_LOOKAHEAD
# The engine's bound on run_ahead_epochs (tflms::kMaxRunAheadEpochs, core/include/tflms/engine.h).
MAX_RUN_AHEAD_EPOCHS: int = _core.MAX_RUN_AHEAD_EPOCHS
Buffer = _core.Buffer

BACKENDS = ("sim", "cuda")


class Engine:
    """A BFC allocator with Large Model Support over one (simulated) device.

    Buffers start unpinned (inactive): the engine may page them out to host memory as
    soon as ``allocate`` returns. ``pin`` makes a buffer resident and returns its
    current device address; the address may change after ``unpin``.

    With ``fixed_addresses=True`` (the mode of the add-on for the stock TensorFlow
    wheel) it never does: the engine hands out addresses in a reserved virtual range
    (``virtual_address_bytes``, default 4x ``device_memory``) and maps physical pages
    of ``page_size`` bytes behind them (a multiple of the OS page on the sim backend;
    2 MiB like CUDA by default). Eviction unmaps a buffer's unshared pages, so
    touching it faults; page-in maps pages back at the same address. ``defrag`` is
    ignored in this mode: nothing may move and no physical fragmentation exists.

    ``launch_queue_depth`` (modelled time) bounds how far the host runs ahead of the
    GPU: a kernel or device copy enqueued while that many compute-stream operations
    are unfinished blocks the host until the oldest finishes, as CUDA's launch queue
    does. 0 (the default) leaves the host unbounded.

    ``prefetch_guard`` (with ``prefetch``; experimental, off by default): once a step is
    learned, steps are timed on the modelled host clock with and without prefetch, and
    the faster is kept, the other tried again every 50 steps.

    ``run_ahead_epochs`` (with ``prefetch``; 0, the engine's default: off; the patch and
    the add-on set 8): while tensors are on the host, the host waits at every last-use
    epoch (32 unpins) until the GPU has done the kernels of that many epochs before
    (EngineOptions::run_ahead_epochs).

    ``unfragmented`` (a yardstick, not a mode to run): the arena has 4x ``device_memory``
    of addresses while the bytes in use stay within the LMS limit, so a request whose
    bytes are free always finds them in one piece; what only addresses call for
    (placement beside what cannot leave, relocation, defragmentation, slides) is left
    out. A replay with it is the engine's eviction and prefetch with addresses taken
    out (EngineOptions::unfragmented). Needs ``lms``; not with ``fixed_addresses``.

    ``layout_lookahead`` (experimental, not set by the patch): the step plan's copies in
    are placed by a look-ahead over the learned step instead of being held back by the
    plan's slack (EngineOptions::layout_lookahead). Only with ``prefetch``.
    ``layout_look_ns_per_event`` and ``layout_look_ns_per_range``: the modelled host time
    of a look, per step event it models and per free range its best fits scan (0: free),
    charged to the simulated host clock as the engine's own work at the pin; the stats
    count both (``layout_look_events``, ``layout_look_ranges_scanned``).
    """

    def __init__(
        self,
        device_memory: int,
        host_memory: int = 1 << 30,
        lms: bool = True,
        defrag: bool = False,
        backend: str = "sim",
        *,
        prefetch: bool = False,
        prefetch_budget: int = 0,
        prefetch_lookahead: int = DEFAULT_PREFETCH_LOOKAHEAD,
        allow_growth: bool = True,
        lms_limit: int = 0,
        store_data: bool = True,
        link_gbps: float = 24.0,
        link_latency_us: float = 10.0,
        device_gbps: float = 1500.0,
        verify_moves: bool = False,
        fixed_addresses: bool = False,
        page_size: int = 2 << 20,
        virtual_address_bytes: int = 0,
        map_us_per_page: float = 0.0,
        unmap_us_per_page: float = 0.0,
        launch_queue_depth: int = 0,
        verify_pins: bool = False,
        prefetch_guard: bool = False,
        run_ahead_epochs: int = 0,
        unfragmented: bool = False,
        layout_lookahead: bool = False,
        layout_look_ns_per_event: float = 0.0,
        layout_look_ns_per_range: float = 0.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if backend == "cuda":
            raise RuntimeError(
                "the cuda backend is compiled into the TensorFlow patch and the C++ tests "
                "(make cuda-test on a GPU machine); the Python package drives the sim backend"
            )
        for name, value in (("device_memory", device_memory), ("host_memory", host_memory)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer byte count, got {value!r}")
        if device_memory <= 0:
            raise ValueError(f"device_memory must be positive, got {device_memory}")
        if lms and host_memory <= 0:
            raise ValueError(
                "with lms=True, host_memory must be a positive byte count: it is where "
                "reclaimed tensors live"
            )
        for name, value in (
            ("page_size", page_size),
            ("virtual_address_bytes", virtual_address_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer byte count, got {value!r}")
        if prefetch_lookahead < 0:
            raise ValueError("prefetch_lookahead must be >= 0")
        if isinstance(run_ahead_epochs, bool) or not 0 <= run_ahead_epochs <= MAX_RUN_AHEAD_EPOCHS:
            raise ValueError(
                f"run_ahead_epochs must be 0 (no limit) or 1 to {MAX_RUN_AHEAD_EPOCHS}, "
                f"got {run_ahead_epochs!r}"
            )
        self._engine = _core.Engine(
            device_memory=device_memory,
            host_memory=host_memory,
            lms=lms,
            defrag=defrag,
            prefetch=prefetch,
            prefetch_budget=prefetch_budget,
            prefetch_lookahead=prefetch_lookahead,
            allow_growth=allow_growth,
            lms_limit=lms_limit,
            store_data=store_data,
            link_gbps=link_gbps,
            link_latency_us=link_latency_us,
            device_gbps=device_gbps,
            verify_moves=verify_moves,
            fixed_addresses=fixed_addresses,
            page_size=page_size,
            virtual_address_bytes=virtual_address_bytes,
            map_us_per_page=map_us_per_page,
            unmap_us_per_page=unmap_us_per_page,
            launch_queue_depth=launch_queue_depth,
            verify_pins=verify_pins,
            prefetch_guard=prefetch_guard,
            unfragmented=unfragmented,
            layout_lookahead=layout_lookahead,
            layout_look_ns_per_event=layout_look_ns_per_event,
            layout_look_ns_per_range=layout_look_ns_per_range,
            run_ahead_epochs=run_ahead_epochs,
        )
        self.device_memory = device_memory
        self.host_memory = host_memory
        self.lms = lms
        self.defrag = defrag
        self.backend = backend
        self.store_data = store_data
        self.fixed_addresses = fixed_addresses

    def allocate(self, nbytes: int, pinned: bool = False) -> Buffer:
        """A new buffer of ``nbytes``; raises OutOfMemoryError when it cannot fit."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise ValueError(f"nbytes must be an integer, got {nbytes!r}")
        return self._engine.allocate(nbytes, pinned)

    def free(self, buf: Buffer) -> None:
        self._engine.free(buf)

    def pin(self, buf: Buffer) -> int:
        return int(self._engine.pin(buf))

    def unpin(self, buf: Buffer) -> None:
        self._engine.unpin(buf)

    def gather_for_concat(self, bufs: Sequence[Buffer]) -> None:
        """Before a kernel pins ``bufs`` and allocates one output as large as all of them
        (a concat, a stack): places them so that the output finds a gap (best effort)."""
        self._engine.gather_for_concat(list(bufs))

    @contextmanager
    def pinned(self, buf: Buffer) -> Iterator[int]:
        address = self.pin(buf)
        try:
            yield address
        finally:
            self.unpin(buf)

    def stats(self) -> dict[str, int]:
        return dict(self._engine.stats())

    def clear_stats(self) -> None:
        """Starts a new measurement period, like TensorFlow's ``reset_memory_stats``.

        Peaks restart from the current values, ``largest_alloc_size`` and every
        cumulative counter (``num_allocs``, reclaims, page-ins, bytes moved, prefetch,
        stall times, allocation sources, ``num_ooms``) from zero. Current values and
        limits are unchanged; buffers are not touched.
        """
        self._engine.clear_stats()

    def defragment(self) -> int:
        """Compacts device memory; returns the number of bytes moved."""
        return int(self._engine.defragment())

    def reclaim_inactive(self) -> int:
        """Moves every inactive buffer to host memory now; returns the device bytes freed."""
        return int(self._engine.reclaim_inactive())

    def step_begin(self) -> None:
        """Marks a training-step boundary; prefetch learns the pin order per step."""
        self._engine.step_begin()

    def note_step_id(self, step_id: int) -> None:
        """A kernel of framework step `step_id` is about to pin on this thread: this
        thread's pins from the next one on count under that id (each thread keeps its
        own), and the engine finds step boundaries itself from these ids, as it does
        inside TensorFlow."""
        self._engine.note_step_id(step_id)

    def note_allocation_site(self, site: int) -> None:
        """The kernel about to allocate on this thread, named by a nonzero 64-bit hash
        (0: none known), as TensorFlow's allocator passes its op name's: prefetch then
        knows a tensor by its size and site, so kernels allocating one size in another
        order each step do not shift each other's keys."""
        if not 0 <= site < 1 << 64:
            raise ValueError(f"site must be an unsigned 64-bit hash, got {site}")
        self._engine.note_allocation_site(site)

    def set_lms_limit(self, nbytes: int) -> None:
        self._engine.set_lms_limit(nbytes)

    def check_invariants(self) -> None:
        """Raises RuntimeError if any statistics or structural invariant is broken."""
        self._engine.check_invariants()

    def free_space(self) -> tuple[int, int]:
        """(largest free chunk, total free bytes) of the regions obtained so far."""
        largest, total = self._engine.free_space()
        return int(largest), int(total)

    # Modelled time (sim backend).
    def compute(self, seconds: float) -> None:
        self._engine.compute(seconds)

    def host_advance(self, seconds: float) -> None:
        self._engine.host_advance(seconds)

    def synchronize(self) -> None:
        self._engine.synchronize()

    def timeline(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._engine.timeline().items()}

    def record_copies(self, on: bool = True) -> None:
        """Keep every host link copy's modelled start and end from now on (off by default)."""
        self._engine.record_copies(on)

    def take_copies(self) -> list[tuple[str, float, float, int]]:
        """The copies recorded since the last call: (``"d2h"`` or ``"h2d"``, start, end, bytes).

        Times are modelled seconds on :meth:`timeline`'s clock, as the GPU would run the
        copy (after what its stream waits for), not when the host enqueued it.
        """
        return [(str(k), float(s), float(e), int(b)) for k, s, e, b in self._engine.take_copies()]

    # Fault injection (tests).
    def fail_next_copies(self, kind: str, n: int = 1) -> None:
        self._engine.fail_next_copies(kind, n)

    def refuse_device_allocations(self, refuse: bool = True) -> None:
        self._engine.refuse_device_allocations(refuse)

    def fail_next_maps(self, n: int = 1) -> None:
        """Fixed-address mode: the next ``n`` page maps fail."""
        self._engine.fail_next_maps(n)

    def fail_next_unmaps(self, n: int = 1) -> None:
        """Fixed-address mode: the next ``n`` page unmaps fail."""
        self._engine.fail_next_unmaps(n)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the virtual range the sim device backs with pages now."""
        return int(self._engine.mapped_bytes)

    def refuse_host_allocations(self, refuse: bool = True) -> None:
        self._engine.refuse_host_allocations(refuse)

    @property
    def host_bytes_allocated(self) -> int:
        return int(self._engine.host_bytes_allocated)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"Engine(device_memory={self.device_memory}, lms={self.lms}, defrag={self.defrag}, "
            f"bytes_in_use={s['bytes_in_use']}, reclaimed={s['current_bytes_reclaimed']})"
        )
