"""Checks the Python half of the patch; run in a subprocess on the patched copy.

verify.py puts the patched copy of the wheel's `tensorflow` package first on
sys.path and runs this file. It prints one JSON object: {"checks": [{"name",
"ok", "detail"}], "tensorflow_file", "goldens": {path: text}}. Every check is independent; a
failure is reported, not raised, so one broken check does not hide others.
Order matters: the context checks run before anything initializes the
TensorFlow runtime, and the "after initialization" check runs last.
"""

from __future__ import annotations

import inspect
import json
import sys
import traceback
from collections.abc import Callable

GPU_STATS = (
    "num_allocs",
    "bytes_in_use",
    "peak_bytes_in_use",
    "largest_alloc_size",
    "bytes_limit",
    "bytes_reserved",
    "peak_bytes_reserved",
    "bytes_reservable_limit",
    "bytes_inactive",
    "bytes_active",
    "peak_bytes_active",
    "bytes_reclaimed",
    "current_bytes_reclaimed",
    "peak_bytes_reclaimed",
    "num_single_reclaims",
    "num_full_reclaims",
    "num_defragmentations",
    "bytes_defragged",
    "num_allocs_from_free",
    "num_allocs_from_new_region",
    "num_allocs_from_single_reclaim",
    "num_allocs_from_fragment_reclaim",
    "num_allocs_from_full_reclaim",
    "num_allocs_from_defrag",
)
HOST_STATS = ("gpu_host_bytes_in_use", "gpu_host_peak_bytes_in_use")

checks: list[dict[str, object]] = []


def check(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def wrap(fn: Callable[[], str]) -> Callable[[], str]:
        try:
            detail = fn()
            checks.append({"name": name, "ok": True, "detail": detail})
        except Exception:  # noqa: BLE001 - every failure is a result to report
            checks.append({"name": name, "ok": False, "detail": traceback.format_exc(limit=3)})
        return fn

    return wrap


def main() -> None:
    import tensorflow as tf
    from tensorflow.python.eager import context

    @check("patched copy is the TensorFlow imported")
    def _() -> str:
        assert "site/tensorflow" in tf.__file__, tf.__file__
        where = tf.__file__[tf.__file__.index("site/tensorflow") :]
        return f"tf {tf.__version__} from the copy's {where}"

    @check("ConfigProto has gpu_options.experimental.lms_enabled / lms_defrag_enabled")
    def _() -> str:
        cfg = tf.compat.v1.ConfigProto()
        exp = cfg.gpu_options.experimental
        assert exp.lms_enabled is False and exp.lms_defrag_enabled is False
        exp.lms_enabled = True
        exp.lms_defrag_enabled = True
        data = cfg.SerializeToString()
        back = tf.compat.v1.ConfigProto.FromString(data)
        assert back.gpu_options.experimental.lms_enabled is True
        assert back.gpu_options.experimental.lms_defrag_enabled is True
        fields = tf.compat.v1.GPUOptions.Experimental.DESCRIPTOR.fields_by_name
        nums = (fields["lms_enabled"].number, fields["lms_defrag_enabled"].number)
        assert nums == (20, 21), nums
        # Wire format: field 20 varint 1 = key 0xa0 0x01, value 0x01.
        assert b"\xa0\x01\x01" in data and b"\xa8\x01\x01" in data, data.hex()
        return f"fields {nums}, serialized {len(data)} bytes and parsed back"

    @check("ConfigProto has gpu_options.experimental.lms_limit_bytes (int64 22, default 0)")
    def _() -> str:
        from google.protobuf.descriptor import FieldDescriptor

        field = tf.compat.v1.GPUOptions.Experimental.DESCRIPTOR.fields_by_name["lms_limit_bytes"]
        assert (field.number, field.type) == (22, FieldDescriptor.TYPE_INT64), field
        cfg = tf.compat.v1.ConfigProto()
        assert cfg.gpu_options.experimental.lms_limit_bytes == 0
        cfg.gpu_options.experimental.lms_limit_bytes = 3 << 30
        back = tf.compat.v1.ConfigProto.FromString(cfg.SerializeToString())
        assert back.gpu_options.experimental.lms_limit_bytes == 3 << 30
        return "field 22, TYPE_INT64, default 0; 3 GiB serialized and parsed back"

    @check(
        "ConfigProto has gpu_options.experimental.lms_prefetch_enabled (optional bool 23, "
        "with presence) and lms_prefetch_lookahead (int32 24, default 0)"
    )
    def _() -> str:
        from google.protobuf.descriptor import FieldDescriptor

        fields = tf.compat.v1.GPUOptions.Experimental.DESCRIPTOR.fields_by_name
        enabled, lookahead = fields["lms_prefetch_enabled"], fields["lms_prefetch_lookahead"]
        assert (enabled.number, enabled.type) == (23, FieldDescriptor.TYPE_BOOL), enabled
        assert (lookahead.number, lookahead.type) == (24, FieldDescriptor.TYPE_INT32), lookahead
        assert enabled.has_presence and not lookahead.has_presence
        cfg = tf.compat.v1.ConfigProto()
        exp = cfg.gpu_options.experimental
        assert not exp.HasField("lms_prefetch_enabled") and exp.lms_prefetch_lookahead == 0
        assert cfg.SerializeToString() == b"", "an unset field was serialized"
        exp.lms_prefetch_enabled = False
        assert exp.HasField("lms_prefetch_enabled")
        # Wire format: field 23 varint = key 0xb8 0x01; field 24 varint = key 0xc0 0x01.
        # An explicit False is written (value 0), so it reaches the allocators as set.
        data = cfg.SerializeToString()
        assert data.endswith(b"\xb8\x01\x00"), data.hex()
        back = tf.compat.v1.ConfigProto.FromString(data).gpu_options.experimental
        assert back.HasField("lms_prefetch_enabled") and back.lms_prefetch_enabled is False
        exp.lms_prefetch_enabled = True
        exp.lms_prefetch_lookahead = 48
        data = cfg.SerializeToString()
        assert b"\xb8\x01\x01" in data and b"\xc0\x01\x30" in data, data.hex()
        back = tf.compat.v1.ConfigProto.FromString(data).gpu_options.experimental
        assert back.lms_prefetch_enabled is True and back.lms_prefetch_lookahead == 48
        exp.ClearField("lms_prefetch_enabled")
        assert not exp.HasField("lms_prefetch_enabled")
        return (
            "fields 23 (TYPE_BOOL, has presence) and 24 (TYPE_INT32); unset not serialized, "
            "False serialized as set, True and 48 serialized and parsed back"
        )

    @check("set_lms_enabled / get_lms_enabled round-trip, reach the eager context's GPUOptions")
    def _() -> str:
        ctx = context.context()
        assert ctx._context_handle is None, "runtime already initialized"
        assert tf.config.experimental.get_lms_enabled() is False
        tf.config.experimental.set_lms_enabled(True)
        assert tf.config.experimental.get_lms_enabled() is True
        assert ctx.config.gpu_options.experimental.lms_enabled is True
        tf.config.experimental.set_lms_enabled(False)
        assert ctx.config.gpu_options.experimental.lms_enabled is False
        tf.config.experimental.set_lms_enabled(True)
        return "True -> context.config.gpu_options.experimental.lms_enabled == True (and back)"

    @check("set_lms_defrag_enabled / get_lms_defrag_enabled round-trip")
    def _() -> str:
        assert tf.config.experimental.get_lms_defrag_enabled() is False
        tf.config.experimental.set_lms_defrag_enabled(True)
        assert tf.config.experimental.get_lms_defrag_enabled() is True
        assert context.context().config.gpu_options.experimental.lms_defrag_enabled is True
        return "True reaches context.config"

    @check("set_lms_limit / get_lms_limit: signatures, validation, round-trip to GPUOptions")
    def _() -> str:
        ctx = context.context()
        assert ctx._context_handle is None, "runtime already initialized"
        exp = tf.config.experimental
        assert str(inspect.signature(exp.set_lms_limit)) == "(nbytes)"
        assert str(inspect.signature(exp.get_lms_limit)) == "()"
        assert tf.compat.v1.config.experimental.set_lms_limit is exp.set_lms_limit
        assert exp.get_lms_limit() == 0
        for bad, error, text in (
            (-1, ValueError, "must be 0"),
            (255, ValueError, "at least 256 bytes"),
            ("1GB", TypeError, "must be an int"),
            (1.5e9, TypeError, "must be an int"),
            (True, TypeError, "must be an int"),
        ):
            try:
                exp.set_lms_limit(bad)
            except error as e:
                assert text in str(e), (bad, str(e))
            else:
                raise AssertionError(f"set_lms_limit({bad!r}) accepted")
        assert exp.get_lms_limit() == 0, "a rejected value was stored"
        exp.set_lms_limit(6 << 30)
        assert exp.get_lms_limit() == 6 << 30
        assert ctx.config.gpu_options.experimental.lms_limit_bytes == 6 << 30
        exp.set_lms_limit(256)
        assert ctx.config.gpu_options.experimental.lms_limit_bytes == 256
        exp.set_lms_limit(6 << 30)
        return "-1, 255, '1GB', 1.5e9, True rejected; 6 GiB -> context.config lms_limit_bytes"

    @check(
        "set_lms_prefetch_enabled / set_lms_prefetch_lookahead: signatures, validation, "
        "round-trip to GPUOptions"
    )
    def _() -> str:
        ctx = context.context()
        assert ctx._context_handle is None, "runtime already initialized"
        exp = tf.config.experimental
        for name, sig in (
            ("set_lms_prefetch_enabled", "(enable)"),
            ("get_lms_prefetch_enabled", "()"),
            ("set_lms_prefetch_lookahead", "(uses)"),
            ("get_lms_prefetch_lookahead", "()"),
        ):
            fn = getattr(exp, name)
            assert str(inspect.signature(fn)) == sig, (name, inspect.signature(fn))
            assert getattr(tf.compat.v1.config.experimental, name) is fn, name
        default = context._LMS_PREFETCH_ENABLED_DEFAULT  # noqa: SLF001
        assert exp.get_lms_prefetch_enabled() is default
        assert exp.get_lms_prefetch_lookahead() == 0
        assert not ctx.config.gpu_options.experimental.HasField("lms_prefetch_enabled")
        for setter, bad, error, text in (
            (exp.set_lms_prefetch_enabled, 1, TypeError, "lms_prefetch_enabled must be a bool"),
            (exp.set_lms_prefetch_enabled, "yes", TypeError, "must be a bool"),
            (exp.set_lms_prefetch_lookahead, -1, ValueError, "positive number of tensor uses"),
            (exp.set_lms_prefetch_lookahead, 1 << 31, ValueError, "below 2**31"),
            (exp.set_lms_prefetch_lookahead, 8.0, TypeError, "must be an int"),
            (exp.set_lms_prefetch_lookahead, True, TypeError, "must be an int"),
        ):
            try:
                setter(bad)
            except error as e:
                assert text in str(e), (bad, str(e))
            else:
                raise AssertionError(f"{setter.__name__}({bad!r}) accepted")
        assert exp.get_lms_prefetch_enabled() is default, "a rejected value was stored"
        assert exp.get_lms_prefetch_lookahead() == 0, "a rejected value was stored"
        # Explicit False and True are both set in the config; None clears it.
        exp.set_lms_prefetch_enabled(False)
        assert exp.get_lms_prefetch_enabled() is False
        gpu = ctx.config.gpu_options.experimental
        assert gpu.HasField("lms_prefetch_enabled") and gpu.lms_prefetch_enabled is False
        exp.set_lms_prefetch_enabled(None)
        assert exp.get_lms_prefetch_enabled() is default
        assert not ctx.config.gpu_options.experimental.HasField("lms_prefetch_enabled")
        exp.set_lms_prefetch_enabled(True)
        exp.set_lms_prefetch_lookahead(64)
        assert exp.get_lms_prefetch_enabled() is True
        assert exp.get_lms_prefetch_lookahead() == 64
        gpu = ctx.config.gpu_options.experimental
        assert gpu.lms_prefetch_enabled is True and gpu.lms_prefetch_lookahead == 64
        exp.set_lms_prefetch_enabled(False)
        assert ctx.config.gpu_options.experimental.lms_prefetch_enabled is False
        exp.set_lms_prefetch_enabled(True)
        return (
            f"default {default}, field unset; bad values rejected; False set, None unset, "
            "True and 64 -> context.config lms_prefetch_*"
        )

    @check("tf.experimental.reclaim_inactive: signature, clear error without a GPU")
    def _() -> str:
        fn = tf.experimental.reclaim_inactive
        assert str(inspect.signature(fn)) == "(gpu_id=0)", inspect.signature(fn)
        assert tf.compat.v1.experimental.reclaim_inactive is fn
        assert not tf.config.list_physical_devices("GPU"), "a GPU is present"
        try:
            fn()
        except RuntimeError as e:
            message = str(e)
            assert "no GPU is visible" in message and "reclaim_inactive" in message, message
        else:
            raise AssertionError("reclaim_inactive() returned without a GPU")
        try:
            fn(-1)
        except ValueError as e:
            assert "gpu_id must be a non-negative int" in str(e)
        else:
            raise AssertionError("negative gpu_id accepted")
        assert context.context()._context_handle is None, "reclaim_inactive initialized TF"
        return message

    @check("setters reject non-booleans with TypeError")
    def _() -> str:
        for bad in ("yes", 1, None):
            try:
                tf.config.experimental.set_lms_enabled(bad)
            except TypeError as e:
                assert "lms_enabled must be a bool" in str(e)
            else:
                raise AssertionError(f"{bad!r} accepted")
        return "'yes', 1, None rejected"

    @check("v1 sessions: a ConfigProto with lms_enabled runs; Session() inherits set_lms_enabled")
    def _() -> str:
        # tf.compat.v1.Session() without a config uses context().config.
        cfg = context.context().config
        assert cfg.gpu_options.experimental.lms_enabled is True
        assert cfg.gpu_options.experimental.lms_prefetch_enabled is True
        assert cfg.gpu_options.experimental.lms_prefetch_lookahead == 64
        with tf.Graph().as_default():
            explicit = tf.compat.v1.ConfigProto()
            explicit.gpu_options.experimental.lms_enabled = True
            explicit.gpu_options.experimental.lms_prefetch_enabled = True
            explicit.gpu_options.experimental.lms_prefetch_lookahead = 32
            with tf.compat.v1.Session(config=explicit) as sess:
                out = sess.run(tf.constant(7) * 6)
        assert out == 42
        return (
            "context().config, which Session() uses without a ConfigProto, has "
            "lms_enabled and lms_prefetch_*; Session(config with lms_enabled and "
            "lms_prefetch_*) runs on the wheel's runtime"
        )

    @check("tf.experimental statistics functions: names and signatures")
    def _() -> str:
        names = [*GPU_STATS, "lms_stats"]
        for name in names:
            fn = getattr(tf.experimental, f"get_{name}")
            sig = str(inspect.signature(fn))
            assert sig == "(gpu_id=0)", (name, sig)
            assert getattr(tf.compat.v1.experimental, f"get_{name}") is fn
        for name in HOST_STATS:
            sig = str(inspect.signature(getattr(tf.experimental, f"get_{name}")))
            assert sig == "(numa_node=0)", (name, sig)
        return f"{len(names) + len(HOST_STATS)} functions in tf.experimental and compat.v1"

    @check("statistics functions give a clear error without a GPU")
    def _() -> str:
        assert not tf.config.list_physical_devices("GPU"), "a GPU is present"
        message = ""
        for name in (*GPU_STATS, *HOST_STATS, "lms_stats"):
            try:
                getattr(tf.experimental, f"get_{name}")()
            except RuntimeError as e:
                message = str(e)
                assert "no GPU is visible" in message and f"get_{name}" in message, message
            else:
                raise AssertionError(f"get_{name}() returned without a GPU")
        try:
            tf.experimental.get_bytes_in_use(-1)
        except ValueError as e:
            assert "gpu_id must be a non-negative int" in str(e)
        else:
            raise AssertionError("negative gpu_id accepted")
        return message

    @check("settings are locked once the runtime is initialized (RuntimeError)")
    def _() -> str:
        tf.constant(1.0)  # initializes the runtime
        tf.config.experimental.set_lms_enabled(True)  # the value in force: allowed
        try:
            tf.config.experimental.set_lms_enabled(False)
        except RuntimeError as e:
            text = str(e)
            assert "cannot be changed after" in text and "set_lms_enabled(False)" in text
        else:
            raise AssertionError("change after initialization accepted")
        try:
            tf.config.experimental.set_lms_defrag_enabled(False)
        except RuntimeError:
            pass
        else:
            raise AssertionError("defrag change after initialization accepted")
        exp = tf.config.experimental
        exp.set_lms_prefetch_enabled(True)  # the value in force: allowed
        exp.set_lms_prefetch_lookahead(64)  # the value in force: allowed
        for setter, value in (
            (exp.set_lms_prefetch_enabled, False),
            (exp.set_lms_prefetch_lookahead, 8),
        ):
            try:
                setter(value)
            except RuntimeError as e:
                assert "cannot be changed after" in str(e), str(e)
                assert f"{setter.__name__}({value})" in str(e), str(e)
            else:
                raise AssertionError(f"{setter.__name__}({value}) after initialization accepted")
        assert exp.get_lms_prefetch_enabled() is True and exp.get_lms_prefetch_lookahead() == 64
        assert tf.config.experimental.get_lms_enabled() is True
        # The limit, unlike the other settings, may change at run time (with no
        # GPU there is no allocator to pass it to, so only the value changes).
        tf.config.experimental.set_lms_limit(1 << 30)
        assert tf.config.experimental.get_lms_limit() == 1 << 30
        try:
            tf.config.experimental.set_lms_limit(-5)
        except ValueError:
            pass
        else:
            raise AssertionError("negative limit accepted after initialization")
        return (
            text + " | set_lms_prefetch_enabled(False), set_lms_prefetch_lookahead(8) refused"
            " | set_lms_limit(1 GiB) accepted after initialization"
        )

    # The goldens of the patched API, for verify's g) (saves a TensorFlow import).
    from tflms.patch.goldens import render_all

    goldens = render_all()
    print(json.dumps({"checks": checks, "tensorflow_file": tf.__file__, "goldens": goldens}))


if __name__ == "__main__":
    main()
    sys.exit(0)
