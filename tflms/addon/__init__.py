"""Large Model Support for the stock TensorFlow GPU wheel, without rebuilding TensorFlow.

    import tflms.addon            # before TensorFlow creates its devices (before the first op)
    import tensorflow as tf
    tf.config.experimental.set_lms_enabled(True)
    ...                           # eager, tf.function, Keras: GPU tensors page to host memory
    tf.experimental.get_peak_bytes_in_use(0)

Importing this module imports TensorFlow, loads a library built from the patch's own
TensorFlow-side sources and the engine against the installed `tensorflow` wheel (built on
first use with a progress bar, then cached under ~/.cache/tflms/addon/), installs an LMS GPU
device factory and GPU process state in that TensorFlow, and gives it the patch's Python
names: `tf.config.experimental.set_lms_enabled` / `get_lms_enabled` /
`set_lms_defrag_enabled` / `get_lms_defrag_enabled` / `set_lms_limit` / `get_lms_limit` /
`set_lms_prefetch_enabled` / `get_lms_prefetch_enabled` / `set_lms_prefetch_lookahead` /
`get_lms_prefetch_lookahead` and the statistics functions under `tf.experimental` (TFLMS
v2's names).
`TF_GPU_HOST_MEM_LIMIT_IN_MB` bounds the pinned host memory reclaimed tensors occupy.

With LMS off (the default) TensorFlow allocates exactly as stock; on a machine without a
GPU, TensorFlow runs on the CPU, unchanged. docs/addon.md says what differs from the patch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tflms._addon_build import SUPPORTED_TF_VERSIONS, BuildError, library_path
from tflms.patch.python_half_check import GPU_STATS

__all__ = [
    "SUPPORTED_TF_VERSIONS",
    "AddonError",
    "BuildError",
    "STAT_FUNCTIONS",
    "installed",
    "last_error",
    "library",
]


class AddonError(RuntimeError):
    """The add-on cannot take effect in this process; the message says what to change."""


# tf.experimental.<name>(gpu_id=0) -> the engine counter it returns (TFLMS v2's names).
STAT_FUNCTIONS: dict[str, str] = {f"get_{name}": name for name in GPU_STATS}
# tf.experimental.get_gpu_host_<name>(numa_node=0) -> the engine's host-pool counter.
HOST_STAT_FUNCTIONS: dict[str, str] = {
    "get_gpu_host_bytes_in_use": "host_bytes_in_use",
    "get_gpu_host_peak_bytes_in_use": "host_peak_bytes_in_use",
}

_lib: ctypes.CDLL | None = None
# Python's view of the settings; the library holds the ones TensorFlow reads. "prefetch"
# None: never set, so the library's default (kFixedAddressPrefetchEnabledDefault) applies,
# as the patch's kPrefetchEnabledDefault does for an unset lms_prefetch_enabled.
_settings: dict[str, Any] = {
    "enabled": False,
    "defrag": False,
    "limit": 0,
    "prefetch": None,
    "lookahead": 0,
}
# The largest lookahead the engine takes (an int32, as in the patch's ConfigProto).
_MAX_LOOKAHEAD = 2**31 - 1


def _devices_exist() -> bool:
    from tensorflow.python.eager import context  # noqa: PLC0415

    ctx = context.context_safe()
    return ctx is not None and ctx._context_handle is not None  # noqa: SLF001


def _check_environment(tf: Any) -> None:
    version = tf.__version__
    if version not in SUPPORTED_TF_VERSIONS:
        raise AddonError(
            f"tflms.addon supports TensorFlow {', '.join(SUPPORTED_TF_VERSIONS)} only (TensorFlow "
            f"has no stable C++ ABI, so the add-on is built per version); this process has "
            f"TensorFlow {version}. Install tensorflow=={SUPPORTED_TF_VERSIONS[-1]}, or build "
            f"TensorFlow {version} with the patch (tflms patch, tflms build-wheel)."
        )
    if not tf.test.is_built_with_cuda():
        raise AddonError(
            "tflms.addon is for the stock GPU wheel (pip install tensorflow=="
            f"{SUPPORTED_TF_VERSIONS[-1]}); this TensorFlow was built without CUDA "
            "(tensorflow-cpu?). To run the patch's TensorFlow-side code on the CPU, use "
            "tflms.tfcpu."
        )
    if _devices_exist():
        raise AddonError(
            "tflms.addon was imported after TensorFlow created its devices: import it "
            "before the first TensorFlow op (right after `import tensorflow`, or before it)"
        )


def _declare(lib: ctypes.CDLL) -> None:
    lib.tflms_addon_install.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.tflms_addon_install.restype = ctypes.c_int
    lib.tflms_addon_set_options.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.tflms_addon_set_options.restype = ctypes.c_int
    lib.tflms_addon_settings_in_force.restype = ctypes.c_int
    lib.tflms_addon_prefetch_default.restype = ctypes.c_int
    lib.tflms_addon_prefetch_resolved.restype = ctypes.c_int
    lib.tflms_addon_last_error.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.tflms_addon_last_error.restype = ctypes.c_int
    lib.tflms_addon_stats.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.tflms_addon_stats.restype = ctypes.c_int
    lib.tflms_addon_reclaim_inactive.argtypes = [ctypes.c_int]
    lib.tflms_addon_reclaim_inactive.restype = ctypes.c_int64
    lib.tflms_addon_set_lms_limit.argtypes = [
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    lib.tflms_addon_set_lms_limit.restype = ctypes.c_int
    lib.tflms_addon_rehook.restype = ctypes.c_int
    lib.tflms_addon_self_check.restype = ctypes.c_int


def _load() -> ctypes.CDLL:
    try:
        import tensorflow as tf  # noqa: PLC0415  (loads TensorFlow's libraries)
    except ImportError as e:
        raise AddonError(
            f"tflms.addon needs TensorFlow: pip install tensorflow=={SUPPORTED_TF_VERSIONS[-1]}"
        ) from e
    _check_environment(tf)
    path, _ = library_path(quiet=bool(os.environ.get("TFLMS_QUIET_BUILD")))
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    _declare(lib)
    error = ctypes.create_string_buffer(1024)
    if lib.tflms_addon_install(error, 1024) != 0:
        raise AddonError(f"tflms.addon: {error.value.decode()}")
    return lib


def _require() -> ctypes.CDLL:
    assert _lib is not None  # set at import
    return _lib


def last_error() -> str:
    """Why LMS could not be set up on a GPU (logged too), or "" if it could."""
    lib = _require()
    n = lib.tflms_addon_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.tflms_addon_last_error(buf, n + 1)
    return buf.value.decode()


def installed() -> dict[str, bool]:
    """Whether TensorFlow's GPU device factory and GPU process state are the add-on's."""
    bits = _require().tflms_addon_self_check()
    return {"device_factory": bool(bits & 1), "gpu_process_state": bool(bits & 2)}


def library() -> Path:
    """The add-on library's path (built if needed)."""
    return library_path(quiet=True)[0]


# ---- tf.config.experimental: the patch's settings ----


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} expects a bool, got {value!r}")


def _prefetch_default() -> bool:
    """The add-on's prefetch default (the library's kFixedAddressPrefetchEnabledDefault)."""
    return bool(_require().tflms_addon_prefetch_default())


def _in_force(key: str, value: Any) -> Any:
    """What a setting means once resolved: an unset prefetch is the default."""
    if key == "prefetch" and value is None:
        return _prefetch_default()
    return value


def _apply(key: str, value: Any, what: str) -> None:
    """Sets one LMS setting, read when TensorFlow creates its GPU devices."""
    if value is _settings[key] or (value is not None and value == _settings[key]):
        return
    lib = _require()
    if lib.tflms_addon_settings_in_force() or _devices_exist():
        if _in_force(key, value) == _in_force(key, _settings[key]):
            return  # the value in force, as the patch allows
        raise RuntimeError(
            f"{what} must be set before TensorFlow creates its devices (before the first "
            "op): the runtime is already initialized with the setting in force"
        )
    new = {**_settings, key: value}
    rc = lib.tflms_addon_set_options(
        int(new["enabled"]),
        int(new["defrag"]),
        new["limit"],
        -1 if new["prefetch"] is None else int(new["prefetch"]),
        new["lookahead"],
    )
    if rc != 0:
        raise RuntimeError(f"{what}: TensorFlow already created its GPU allocators")
    _settings.update(new)


def get_lms_enabled() -> bool:
    """Returns whether Large Model Support is (or, before the runtime is up, will be) on."""
    return bool(_settings["enabled"])


def set_lms_enabled(enable: bool) -> None:
    """Enables or disables Large Model Support for GPUs, before the first op.

    As the patch's `tf.config.experimental.set_lms_enabled`: tensors no running op uses
    move to pinned host memory (sized by `TF_GPU_HOST_MEM_LIMIT_IN_MB`) when an
    allocation does not fit, and come back when an op needs them. On the stock wheel a
    tensor keeps its GPU address: eviction unmaps its pages, a page-in maps them back.
    Raises TypeError for a non-bool, RuntimeError once the runtime is up with another
    setting in force.
    """
    _check_bool("set_lms_enabled", enable)
    _apply("enabled", enable, "tf.config.experimental.set_lms_enabled")


def get_lms_defrag_enabled() -> bool:
    """Returns whether LMS may defragment GPU memory (the add-on never needs to)."""
    return bool(_settings["defrag"])


def set_lms_defrag_enabled(enable: bool) -> None:
    """Accepted for the patch's programs; a no-op on the stock wheel.

    With fixed addresses there is no physical fragmentation to repair (any free page backs
    any address) and no tensor may move, so the engine ignores it.
    """
    _check_bool("set_lms_defrag_enabled", enable)
    _apply("defrag", enable, "tf.config.experimental.set_lms_defrag_enabled")


def get_lms_prefetch_enabled() -> bool:
    """Returns whether LMS brings tensors back ahead of their use (TF_LMS_PREFETCH aside):
    the value set, or LMS's default (off) when none was."""
    return bool(_in_force("prefetch", _settings["prefetch"]))


def set_lms_prefetch_enabled(enable: bool | None) -> None:
    """Enables or disables LMS prefetch for GPUs, before the first op.

    As the patch's `tf.config.experimental.set_lms_prefetch_enabled`: LMS learns the order
    in which a step uses its tensors and maps evicted ones back ahead of their use, up to
    `get_lms_prefetch_lookahead()` tensor uses ahead. True and False are kept as asked;
    None (and never calling it) leaves the add-on's default, off (unlike the patch: mapping
    pages back ahead of use has not yet beaten paging on demand on a GPU). `TF_LMS_PREFETCH`
    (true/false),
    when set, overrides it when the allocators are created. Raises TypeError for anything
    else, RuntimeError once the runtime is up with another setting in force.
    """
    if enable is not None:
        _check_bool("set_lms_prefetch_enabled", enable)
    _apply("prefetch", enable, "tf.config.experimental.set_lms_prefetch_enabled")


def get_lms_prefetch_lookahead() -> int:
    """Returns the prefetch lookahead in tensor uses (0: the engine's default, 128)."""
    return int(_settings["lookahead"])


def set_lms_prefetch_lookahead(uses: int) -> None:
    """Sets how many tensor uses ahead LMS prefetch looks (0: the default, 128).

    Before the first op, as `set_lms_prefetch_enabled`. Raises TypeError for a non-int,
    ValueError for a negative value or one of 2**31 or more, RuntimeError once the runtime
    is up with another setting in force.
    """
    if isinstance(uses, bool) or not isinstance(uses, int):
        raise TypeError(
            f"set_lms_prefetch_lookahead expects an int number of tensor uses, got {uses!r}"
        )
    if uses < 0 or uses > _MAX_LOOKAHEAD:
        raise ValueError(
            f"set_lms_prefetch_lookahead: {uses} must be 0 (the default, 128 tensor uses) or "
            f"a positive number of tensor uses below 2**31"
        )
    _apply("lookahead", uses, "tf.config.experimental.set_lms_prefetch_lookahead")


def get_lms_limit() -> int:
    """Returns the bytes in use at which LMS starts reclaiming (0: the whole limit)."""
    return int(_settings["limit"])


def set_lms_limit(nbytes: int) -> None:
    """Sets the GPU bytes in use at which LMS reclaims (0: the whole memory limit).

    Before the runtime is up it applies to every GPU created; afterwards it changes the LMS
    allocator of every GPU at once.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"set_lms_limit expects an int, got {nbytes!r}")
    if nbytes < 0 or 0 < nbytes < 256:
        raise ValueError(f"set_lms_limit: {nbytes} must be 0 or at least 256")
    lib = _require()
    if not (lib.tflms_addon_settings_in_force() or _devices_exist()):
        _apply("limit", nbytes, "tf.config.experimental.set_lms_limit")
        return
    _settings["limit"] = nbytes
    import tensorflow as tf  # noqa: PLC0415

    for gpu in tf.config.list_logical_devices("GPU"):
        gpu_id = int(gpu.name.rsplit(":", 1)[1])
        error = ctypes.create_string_buffer(512)
        if lib.tflms_addon_set_lms_limit(gpu_id, nbytes, error, 512) == -2:
            raise ValueError(f"set_lms_limit: {error.value.decode()}")


# ---- tf.experimental: statistics (TFLMS v2's names) ----


def _check_id(kind: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{kind} must be a non-negative int, got {value!r}")


def _require_gpu(caller: str, what: str = "LMS statistics exist") -> None:
    import tensorflow as tf  # noqa: PLC0415

    if not tf.config.list_physical_devices("GPU"):
        raise RuntimeError(
            f"{caller}: no GPU is visible to TensorFlow (tf.config.list_physical_devices('GPU') "
            f"is empty), and {what} only for GPUs."
        )


def _not_found(caller: str, gpu_id: int) -> Exception:
    import tensorflow as tf  # noqa: PLC0415

    reason = last_error()
    return tf.errors.NotFoundError(
        None,
        None,
        f"{caller}: GPU:{gpu_id} has no LMS allocator: no GPU has that id, LMS is not enabled "
        "(tf.config.experimental.set_lms_enabled(True) before the first op), or the GPU has "
        "not been used yet" + (f". LMS could not start: {reason}" if reason else ""),
    )


def _raw_stats(gpu_id: int) -> dict[str, int] | None:
    lib = _require()
    n = lib.tflms_addon_stats(gpu_id, None, 0)
    if n < 0:
        return None
    buf = ctypes.create_string_buffer(n + 1)
    lib.tflms_addon_stats(gpu_id, buf, n + 1)
    out: dict[str, int] = {}
    for line in buf.value.decode().splitlines():
        name, value = line.split()
        out[name] = int(value)
    return out


def get_lms_stats(gpu_id: int = 0) -> dict[str, int]:
    """Every LMS counter of a GPU's allocator, as a dict (as the patch's function)."""
    caller = "tf.experimental.get_lms_stats"
    _check_id("gpu_id", gpu_id)
    _require_gpu(caller)
    stats = _raw_stats(gpu_id)
    if stats is None:
        raise _not_found(caller, gpu_id)
    return stats


def _gpu_stat(name: str) -> Callable[[int], int]:
    def stat(gpu_id: int = 0) -> int:
        caller = f"tf.experimental.get_{name}"
        _check_id("gpu_id", gpu_id)
        _require_gpu(caller)
        stats = _raw_stats(gpu_id)
        if stats is None:
            raise _not_found(caller, gpu_id)
        return int(stats[name])

    stat.__name__ = f"get_{name}"
    stat.__doc__ = f"Returns the LMS allocator's `{name}` counter of GPU `gpu_id`."
    return stat


def _host_stat(name: str, key: str) -> Callable[[int], int]:
    def stat(numa_node: int = 0) -> int:
        caller = f"tf.experimental.{name}"
        _check_id("numa_node", numa_node)
        _require_gpu(caller)
        import tensorflow as tf  # noqa: PLC0415

        total, found = 0, False
        for gpu in tf.config.list_logical_devices("GPU"):
            stats = _raw_stats(int(gpu.name.rsplit(":", 1)[1]))
            if stats is not None:
                total, found = total + stats[key], True
        if not found:
            raise _not_found(caller, 0)
        return total

    stat.__name__ = name
    stat.__doc__ = (
        "Pinned host memory holding reclaimed tensors, summed over the GPUs' LMS "
        "allocators (the add-on's host pool is per GPU, not TensorFlow's per-NUMA-node "
        "gpu_host_bfc)."
    )
    return stat


def reclaim_inactive(gpu_id: int = 0) -> int:
    """Moves every inactive tensor of a GPU to host memory now; returns the bytes moved."""
    caller = "tf.experimental.reclaim_inactive"
    _check_id("gpu_id", gpu_id)
    _require_gpu(caller, "LMS reclaims tensors")
    moved = _require().tflms_addon_reclaim_inactive(gpu_id)
    if moved == -1:
        raise _not_found(caller, gpu_id)
    if moved < 0:
        raise RuntimeError(f"{caller}: the engine failed (see TensorFlow's log)")
    return int(moved)


CONFIG_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "get_lms_enabled": get_lms_enabled,
    "set_lms_enabled": set_lms_enabled,
    "get_lms_defrag_enabled": get_lms_defrag_enabled,
    "set_lms_defrag_enabled": set_lms_defrag_enabled,
    "get_lms_limit": get_lms_limit,
    "set_lms_limit": set_lms_limit,
    "get_lms_prefetch_enabled": get_lms_prefetch_enabled,
    "set_lms_prefetch_enabled": set_lms_prefetch_enabled,
    "get_lms_prefetch_lookahead": get_lms_prefetch_lookahead,
    "set_lms_prefetch_lookahead": set_lms_prefetch_lookahead,
}


def _experimental_functions() -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {
        "get_lms_stats": get_lms_stats,
        "reclaim_inactive": reclaim_inactive,
    }
    out.update({fn: _gpu_stat(name) for fn, name in STAT_FUNCTIONS.items()})
    out.update({fn: _host_stat(fn, key) for fn, key in HOST_STAT_FUNCTIONS.items()})
    return out


def _install_names() -> None:
    """Gives the stock wheel the patch's Python names, where the patch puts them."""
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.python.framework import config as tf_config  # noqa: PLC0415
    from tensorflow.python.framework import load_library  # noqa: PLC0415

    experimental = _experimental_functions()
    for name, fn in CONFIG_FUNCTIONS.items():
        setattr(tf.config.experimental, name, fn)
        setattr(tf_config, name, fn)
    for name, fn in experimental.items():
        setattr(tf.experimental, name, fn)
        setattr(tf_config, name, fn)
    # Custom-op libraries loaded later call Tensor's constructors through their own
    # PLT: redirect those too (the patch's tensor.cc hunk covers them by construction).
    load_op_library = load_library.load_op_library

    @functools.wraps(load_op_library)
    def _load_op_library(library_filename: str) -> Any:
        module = load_op_library(library_filename)
        _require().tflms_addon_rehook()
        return module

    load_library.load_op_library = _load_op_library
    tf.load_op_library = _load_op_library


def _import_time_setup() -> None:
    global _lib
    _lib = _load()
    _install_names()


if "sphinx" not in sys.modules:  # documentation builds import without side effects
    _import_time_setup()
