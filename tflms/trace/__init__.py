"""Training-step traces of Keras models: capture (tflms trace), file format, cache.

Importing this package does not import TensorFlow; only trace_model does.
"""

from tflms.trace.format import OpInfo, TensorInfo, Trace, load_trace, save_trace
from tflms.trace.models import MODEL_NAMES

__all__ = [
    "MODEL_NAMES",
    "OpInfo",
    "TensorInfo",
    "Trace",
    "cached_trace",
    "load_trace",
    "save_trace",
    "trace_model",
]


def trace_model(
    model: str,
    batch_size: int,
    input_size: int | None = None,
    progress: bool = True,
    precision: str = "fp32",
) -> Trace:
    """See tflms.trace.capture.trace_model (imported lazily: it pulls in TensorFlow)."""
    from tflms.trace.capture import trace_model as _trace_model

    return _trace_model(model, batch_size, input_size, progress, precision)


def cached_trace(
    model: str, batch_size: int, input_size: int | None = None, precision: str = "fp32"
) -> Trace:
    """See tflms.trace.cache.cached_trace."""
    from tflms.trace.cache import cached_trace as _cached_trace

    return _cached_trace(model, batch_size, input_size, precision=precision)
