"""Run the patch's TensorFlow side inside stock tensorflow-cpu, on the CPU.

    import tflms.tfcpu
    tflms.tfcpu.enable(device_memory="64MiB")   # before TensorFlow creates its devices
    import tensorflow as tf
    ...                                          # ops on CPU:0 run with LMS moving tensors
    tflms.tfcpu.stats()                          # the engine's counters

`enable` loads a library built from the patch's own TensorFlow-side sources (built on
first use against the installed wheel, then cached), registers an LMS "CPU" device in
the place of TensorFlow's thread-pool device, and redirects Tensor's allocating
constructors to the patch's movable buffers. The device's "device memory" is a host
arena of `device_memory` bytes managed by the real engine: when it is full, tensors no
running kernel uses are paged out to `host_memory` and paged back in when a kernel
needs them, so TensorFlow's own CPU kernels, executor, eager runtime, tf.function and
Keras run with LMS moving their tensors. docs/verification.md says which hunks of the
patch this exercises and which it stands in for.

Without `enable` nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Any

from tflms.tfcpu._build import SUPPORTED_TF_VERSIONS, BuildError, library_path

__all__ = [
    "SUPPORTED_TF_VERSIONS",
    "BuildError",
    "TfcpuError",
    "defragment",
    "enable",
    "enabled",
    "prefetch_enabled",
    "reclaim_inactive",
    "stats",
]


class TfcpuError(RuntimeError):
    """enable() cannot take effect; the message says what to change."""


_lib: ctypes.CDLL | None = None
_pylib: ctypes.PyDLL | None = None


def _size(value: int | str, name: str) -> int:
    if isinstance(value, int):
        return value
    from tflms.planner.gpu import parse_size  # noqa: PLC0415

    try:
        return parse_size(value)
    except ValueError as e:
        raise TfcpuError(f"{name}={value!r}: {e}") from None


def _devices_exist() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context  # noqa: PLC0415

    ctx = context.context_safe()
    return ctx is not None and ctx._context_handle is not None  # noqa: SLF001


def enable(
    device_memory: int | str = "64MiB",
    host_memory: int | str = "1GiB",
    defrag: bool = False,
    prefetch: bool | None = None,
    verify_moves: bool = False,
    lms: bool = True,
    fixed_addresses: bool = False,
    page_size: int | str = "4KiB",
    verify_pins: bool = False,
    prefetch_guard: bool = False,
) -> None:
    """Makes CPU:0 an LMS device with `device_memory` bytes of modelled device memory.

    With lms=False the device and its allocator are the same but no tensor is movable:
    stock TensorFlow's behaviour over the engine's BFC allocator, a baseline.
    With fixed_addresses=True the engine runs in the add-on's mode: a tensor keeps its
    address for life, eviction unmaps its pages (of `page_size` bytes), and a kernel
    that reads an evicted tensor no pin covered faults at once. The default page, the
    host's, is to a few MiB of modelled memory what a GPU's 2 MiB mapping granule is to
    its GiBs: coarser pages on a tiny device would strand memory no GPU strands.
    With verify_pins=True every pin that makes a tensor active again checks that its
    bytes are the ones its last unpin left (a stale page-in or a write no pin covered
    fails the kernel with an error naming the buffer); it reads each tensor twice per
    use, so it is for tests and for hunting such bugs.
    prefetch=None resolves prefetch as the patched TensorFlow does for a program that
    never sets it, through the patch's own code (lms_options.cc): on
    (kPrefetchEnabledDefault), or off with fixed_addresses as in tflms.addon
    (kFixedAddressPrefetchEnabledDefault); TF_LMS_PREFETCH, when set, overrides it.
    With lms=False it is off.
    True or False is taken as given, whatever the environment says.
    `prefetch_enabled()` says what the engine runs.
    With prefetch, prefetch_guard (the engine's experimental guard, off by default)
    times steps with and without prefetch once a step is learned and keeps the faster.

    Call it before TensorFlow creates its devices (before the first op). Imports
    TensorFlow. Raises TfcpuError if it is too late or already enabled, and BuildError
    if the harness library cannot be built (no compiler, wrong TensorFlow version).
    """
    global _lib, _pylib
    if _lib is not None:
        raise TfcpuError("tflms.tfcpu.enable() was already called in this process")
    device_bytes = _size(device_memory, "device_memory")
    host_bytes = _size(host_memory, "host_memory")
    page_bytes = _size(page_size, "page_size") if fixed_addresses else 0
    if _devices_exist():
        raise TfcpuError(
            "TensorFlow has already created its devices in this process: call "
            "tflms.tfcpu.enable() before the first TensorFlow op (right after import)"
        )
    import tensorflow as tf  # noqa: F401, PLC0415  (loads TensorFlow's libraries)

    path = library_path()
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    _declare(lib)
    error = ctypes.create_string_buffer(1024)
    rc = lib.tflms_tfcpu_enable(
        device_bytes,
        host_bytes,
        int(lms),
        int(defrag),
        -1 if prefetch is None else int(prefetch),
        int(prefetch_guard),
        int(verify_moves),
        int(verify_pins),
        page_bytes,
        error,
        1024,
    )
    if rc != 0:
        raise TfcpuError(f"tflms.tfcpu: {error.value.decode()}")
    _lib = lib
    _pylib = ctypes.PyDLL(str(path))
    _pylib.tflms_tfcpu_make_unmovable.argtypes = [ctypes.py_object, ctypes.c_char_p, ctypes.c_int]
    _pylib.tflms_tfcpu_make_unmovable.restype = ctypes.c_int
    _install_python_escapes()


def _declare(lib: ctypes.CDLL) -> None:
    lib.tflms_tfcpu_enable.argtypes = [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    lib.tflms_tfcpu_enable.restype = ctypes.c_int
    lib.tflms_tfcpu_stats.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.tflms_tfcpu_stats.restype = ctypes.c_int
    lib.tflms_tfcpu_reclaim_inactive.restype = ctypes.c_int64
    lib.tflms_tfcpu_defragment.restype = ctypes.c_int64
    lib.tflms_tfcpu_rehook.restype = ctypes.c_int
    lib.tflms_tfcpu_delay_page_ins.argtypes = [ctypes.c_int]
    lib.tflms_tfcpu_model_link.argtypes = [ctypes.c_double]
    lib.tflms_tfcpu_kernel_wait_ns.restype = ctypes.c_int64
    lib.tflms_tfcpu_prefetch_enabled.restype = ctypes.c_int


def _make_unmovable(tensor: Any) -> None:
    assert _pylib is not None
    error = ctypes.create_string_buffer(512)
    if _pylib.tflms_tfcpu_make_unmovable(tensor, error, 512) != 0:
        raise TfcpuError(f"tflms.tfcpu: {error.value.decode()}")


def _install_python_escapes() -> None:
    """Python reads a CPU tensor's bytes in place (numpy views, DLPack).

    On a GPU those reads are device-to-host copies, which the patch pins; here they
    are raw addresses escaping, which the patch's C API hunk makes unmovable. The
    same call is made before each such read.
    """
    from tensorflow.python import pywrap_tfe  # noqa: PLC0415
    from tensorflow.python.framework import (
        load_library,  # noqa: PLC0415
        ops,  # noqa: PLC0415
    )

    base = ops._EagerTensorBase  # noqa: SLF001
    numpy_internal = base._numpy  # noqa: SLF001

    @functools.wraps(numpy_internal)
    def _numpy(self: Any) -> Any:
        _make_unmovable(self)
        return numpy_internal(self)

    base._numpy = _numpy  # noqa: SLF001
    # numpy prefers the buffer protocol (zero-copy) to __array__.
    eager_tensor_type = ops.EagerTensor
    assert _pylib is not None
    _pylib.tflms_tfcpu_hook_buffer_protocol.argtypes = [ctypes.py_object]
    if _pylib.tflms_tfcpu_hook_buffer_protocol(eager_tensor_type) != 0:
        raise TfcpuError("tflms.tfcpu: cannot route EagerTensor's buffer protocol")
    to_dlpack = pywrap_tfe.TFE_ToDlpackCapsule

    def _to_dlpack(tensor: Any) -> Any:
        _make_unmovable(tensor)
        return to_dlpack(tensor)

    pywrap_tfe.TFE_ToDlpackCapsule = _to_dlpack
    load_op_library = load_library.load_op_library

    @functools.wraps(load_op_library)
    def _load_op_library(library_filename: str) -> Any:
        module = load_op_library(library_filename)
        assert _lib is not None
        _lib.tflms_tfcpu_rehook()  # its calls to Tensor's constructors, too
        return module

    load_library.load_op_library = _load_op_library
    import tensorflow as tf  # noqa: PLC0415

    tf.load_op_library = _load_op_library


def enabled() -> bool:
    return _lib is not None


def _require() -> ctypes.CDLL:
    if _lib is None:
        raise TfcpuError("tflms.tfcpu is not enabled: call tflms.tfcpu.enable() first")
    return _lib


def stats() -> dict[str, int]:
    """The engine's counters, named as tflms.Engine.stats() names them."""
    lib = _require()
    n = lib.tflms_tfcpu_stats(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.tflms_tfcpu_stats(buf, n + 1)
    out: dict[str, int] = {}
    for line in buf.value.decode().splitlines():
        name, value = line.split()
        out[name] = int(value)
    return out


def prefetch_enabled() -> bool:
    """Whether the engine prefetches, as enable() resolved it."""
    return bool(_require().tflms_tfcpu_prefetch_enabled() == 1)


def reclaim_inactive() -> int:
    """Pages every tensor no kernel uses out to host memory now; returns the bytes."""
    moved = _require().tflms_tfcpu_reclaim_inactive()
    if moved < 0:
        raise TfcpuError("reclaim_inactive failed (see TensorFlow's log)")
    return int(moved)


def defragment() -> int:
    """Compacts the modelled device memory now; returns the bytes moved."""
    moved = _require().tflms_tfcpu_defragment()
    if moved < 0:
        raise TfcpuError("defragment failed (see TensorFlow's log)")
    return int(moved)


def _delay_page_ins(microseconds: int) -> None:
    """Tests: every later page-in copy sleeps this long before it lands."""
    _require().tflms_tfcpu_delay_page_ins(microseconds)


def _model_link(bytes_per_second: float) -> None:
    """Benchmarks: both copy streams run at this bandwidth in real time (0: memcpy speed).

    Copies then take as long, relative to the kernels, as they would over a GPU's link,
    so a page-in that prefetch did not start early enough holds up the kernel that needs
    it (`_kernel_wait_ns`).
    """
    if bytes_per_second < 0:
        raise TfcpuError(f"link bandwidth must be >= 0 bytes/s, got {bytes_per_second}")
    _require().tflms_tfcpu_model_link(float(bytes_per_second))


def _kernel_wait_ns() -> int:
    """Wall time kernels spent blocked on the copies they were ordered after.

    On a GPU this is the compute stream idling for a page-in, which no engine counter
    sees (the host does not wait); here the kernel's own thread waits.
    """
    return int(_require().tflms_tfcpu_kernel_wait_ns())


def library() -> Path:
    """Builds (if needed) and returns the harness library's path."""
    return library_path()
