"""Applying a translation to the running TensorFlow, and the errors users see.

A TensorFlow built with the tflms patch has tf.config.experimental.set_lms_enabled;
the stock wheels do not. Other settings (the prefetch switch and lookahead that lb/ub
map to) may be missing from an older patched build: each is looked up by name, and a
missing one is reported in one warning instead of failing.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from tensorflow_large_model_support.parameters import (
    MAX_LOOKAHEAD,
    SET_ENABLED,
    Translation,
    translate,
)

BUILD_DOC = "docs/building.md"


class LMSUnavailableError(RuntimeError):
    """The running TensorFlow was built without the tflms patch."""


class LMSTooLateError(RuntimeError):
    """LMS cannot be switched any more: the GPU allocators already exist."""


class LMSParameterWarning(UserWarning):
    """A TFLMS v1 parameter (or a setting it maps to) has no effect here."""


def tensorflow() -> ModuleType:
    import tensorflow as tf

    return tf


def is_patched(tf: ModuleType) -> bool:
    return hasattr(tf.config.experimental, SET_ENABLED)


def unavailable_message(tf: ModuleType, caller: str) -> str:
    version = getattr(tf, "__version__", "?")
    where = getattr(tf, "__file__", "?")
    return (
        f"{caller}: Large Model Support needs a TensorFlow built with the tflms patch, but the "
        f"TensorFlow imported ({version}, {where}) has no "
        f"tf.config.experimental.set_lms_enabled. Build and install a patched wheel "
        f"(`tflms build-wheel --tf-version {version} --cuda`, see {BUILD_DOC} in the tflms "
        f"repository), or drop the LMS object to run without Large Model Support. "
        f"tensorflow_large_model_support no longer edits graphs: it switches on the allocator "
        f"LMS of the patched TensorFlow."
    )


def require_patched(caller: str) -> ModuleType:
    """Returns tensorflow, or raises LMSUnavailableError naming the fix."""
    tf = tensorflow()
    if not is_patched(tf):
        raise LMSUnavailableError(unavailable_message(tf, caller))
    return tf


def prepare(values: Mapping[str, object], caller: str) -> Translation:
    """Translates a constructor's v1 arguments; warns once about the ignored ones.

    Fails early, at construction, on a TensorFlow without the patch: the
    v1 call sites build the LMS object right before training starts.
    """
    translation = translate(values)
    if translation.enabled:
        require_patched(caller)
    if translation.ignored:
        # stacklevel 3: the user's line that constructed the object.
        warnings.warn(translation.ignored_message(caller), LMSParameterWarning, stacklevel=3)
    return translation


def v1_arguments(local_names: Mapping[str, object]) -> dict[str, object]:
    """A constructor's arguments from its locals(), without self."""
    return {k: v for k, v in local_names.items() if k not in ("self", "__class__")}


def _too_late_message(
    caller: str, what: str, advice: str, cause: Exception, translation: Translation | None = None
) -> str:
    """`what` is the change refused: "switched on", or a setter and its v1 sources."""
    if what in ("on", "off"):
        change = f"Large Model Support cannot be switched {what} now"
    else:
        params = ", ".join(translation.sources.get(what, ())) if translation else ""
        value = translation.settings.get(what) if translation else None
        change = f"tf.config.experimental.{what}({value!r})" + (
            f" (from {params})" if params else ""
        )
        change = f"{change} cannot be applied now"
    return (
        f"{caller}: {change}: the TensorFlow runtime, and with it the GPU allocators, "
        f"already exist. {advice} (TensorFlow said: {cause})"
    )


def _getter(experimental: Any, setter: str) -> Any:
    return getattr(experimental, "get_" + setter.removeprefix("set_"), None)


def default_session_exists(tf: ModuleType) -> bool:
    return tf.compat.v1.get_default_session() is not None


def apply(translation: Translation, caller: str, advice: str) -> dict[str, object]:
    """Applies the settings; returns the ones applied.

    `advice` tells the user where to switch LMS instead when it is too late.
    Raises LMSUnavailableError on a stock TensorFlow (unless LMS is to be off,
    which stock TensorFlow already is) and LMSTooLateError when the runtime
    refuses the change.
    """
    tf = tensorflow()
    if not is_patched(tf):
        if translation.enabled:
            raise LMSUnavailableError(unavailable_message(tf, caller))
        return {}
    experimental: Any = tf.config.experimental
    enable = translation.enabled
    on_off = "on" if enable else "off"
    # A session's devices are created when it is; TensorFlow cannot refuse a
    # later change then, so refuse it here for the session we can see.
    if default_session_exists(tf):
        for setter, value in translation.settings.items():
            getter = _getter(experimental, setter)
            if getter is not None and getter() != value:
                raise LMSTooLateError(
                    _too_late_message(
                        caller,
                        on_off if setter == SET_ENABLED else setter,
                        advice,
                        RuntimeError("a Session is already open"),
                        translation,
                    )
                )
    applied: dict[str, object] = {}
    missing: list[str] = []
    for setter, value in translation.settings.items():
        function = getattr(experimental, setter, None)
        if function is None:
            params = ", ".join(translation.sources.get(setter, ()))
            missing.append(
                f"{params}: this TensorFlow has no tf.config.experimental.{setter}, so "
                f"{setter}({value!r}) is not applied (a TensorFlow built with a newer tflms "
                f"patch has it)"
            )
            continue
        try:
            function(value)
        except RuntimeError as e:
            what = on_off if setter == SET_ENABLED else setter
            raise LMSTooLateError(_too_late_message(caller, what, advice, e, translation)) from e
        applied[setter] = value
    if missing:
        warnings.warn(
            f"{caller}: " + "; ".join(missing) + ".",
            LMSParameterWarning,
            stacklevel=3,
        )
    return applied


def lms_config(
    config: Any = None,
    *,
    defrag: bool = False,
    prefetch: bool | None = None,
    prefetch_lookahead: int = 0,
) -> Any:
    """A copy of `config` (a tf.compat.v1.ConfigProto) with LMS switched on.

    For tf.compat.v1.Session(config=...), MonitoredTrainingSession(config=...)
    and an Estimator's RunConfig(session_config=...): a session given a
    ConfigProto reads LMS from it, not from tf.config.experimental. `prefetch`
    and `prefetch_lookahead` (tensor uses; 0 keeps the default, 128) set
    gpu_options.experimental.lms_prefetch_enabled / lms_prefetch_lookahead, what
    v1's lb/ub map to (`parameters.prefetch_lookahead(lb, ub)` computes it).
    `prefetch` True or False sets the field explicitly (False stays off whatever
    TensorFlow's default); None leaves it as `config` has it (unset: LMS's
    default, off in this release).
    """
    if not isinstance(defrag, bool) or not isinstance(prefetch, (bool, type(None))):
        raise TypeError(
            f"lms_config(): defrag must be a bool and prefetch a bool or None, got {defrag!r} "
            f"and {prefetch!r}"
        )
    if (
        isinstance(prefetch_lookahead, bool)
        or not isinstance(prefetch_lookahead, int)
        or not 0 <= prefetch_lookahead <= MAX_LOOKAHEAD
    ):
        raise ValueError(
            f"lms_config(): prefetch_lookahead must be an int from 0 (the default, 128 tensor "
            f"uses) to 2**31 - 1, got {prefetch_lookahead!r}"
        )
    tf = tensorflow()
    experimental_type = tf.compat.v1.GPUOptions.Experimental
    fields = experimental_type.DESCRIPTOR.fields_by_name
    needed = ["lms_enabled"]
    if prefetch is not None or prefetch_lookahead:
        needed += ["lms_prefetch_enabled", "lms_prefetch_lookahead"]
    missing = [name for name in needed if name not in fields]
    if missing:
        raise LMSUnavailableError(
            unavailable_message(tf, "lms_config()").replace(
                "has no tf.config.experimental.set_lms_enabled",
                f"has no ConfigProto field gpu_options.experimental.{missing[0]}",
            )
        )
    result = tf.compat.v1.ConfigProto()
    if config is not None:
        if not isinstance(config, tf.compat.v1.ConfigProto):
            raise TypeError(
                f"lms_config() takes a tf.compat.v1.ConfigProto or None, got "
                f"{type(config).__name__}"
            )
        result.CopyFrom(config)
    result.gpu_options.experimental.lms_enabled = True
    if defrag:
        result.gpu_options.experimental.lms_defrag_enabled = True
    if prefetch is not None:
        # The field has presence: an explicit False is kept, and reaches the allocators as set.
        result.gpu_options.experimental.lms_prefetch_enabled = prefetch
    if prefetch_lookahead:
        result.gpu_options.experimental.lms_prefetch_lookahead = prefetch_lookahead
    return result
