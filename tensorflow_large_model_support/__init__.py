"""TFLMS v1 compatibility: `from tensorflow_large_model_support import LMS, ...` keeps working.

TFLMS v1 was a graph-editing library; tflms is allocator LMS inside a patched
TensorFlow. The three v1 classes take every v1 parameter with its v1 default
and switch allocator LMS on (see docs/migration.md):

    LMS(optimizer_scopes, ...).run(graph)   before the first Session
    LMSSessionRunHook(optimizer_scopes, ...)   in MonitoredTrainingSession hooks
    LMSKerasCallback(...)                   created before the model is built

`lms_config(config)` returns a ConfigProto with LMS on, for sessions given one.
On a TensorFlow without the tflms patch they raise LMSUnavailableError, which
says how to build one (docs/building.md).

LMSSessionRunHook and LMSKerasCallback subclass TensorFlow's hook and callback
classes, so they are imported (with TensorFlow) on first use.
"""

from __future__ import annotations

from typing import Any

from tensorflow_large_model_support.lms import LMS
from tensorflow_large_model_support.parameters import PARAMETERS, V1Parameter
from tensorflow_large_model_support.runtime import (
    LMSParameterWarning,
    LMSTooLateError,
    LMSUnavailableError,
    lms_config,
)

__all__ = [
    "LMS",
    "LMSKerasCallback",
    "LMSParameterWarning",
    "LMSSessionRunHook",
    "LMSTooLateError",
    "LMSUnavailableError",
    "PARAMETERS",
    "V1Parameter",
    "lms_config",
]

_LAZY = {
    "LMSSessionRunHook": "tensorflow_large_model_support.session_hook",
    "LMSKerasCallback": "tensorflow_large_model_support.keras_callback",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
