"""On-disk cache of traces, so the planner traces each model once.

A step's op graph does not depend on the batch size (capture verifies it), so one trace per
(model, input size, TensorFlow version, capture revision) serves every batch size through
Trace.rescaled(). Files live under $TFLMS_CACHE_DIR, else ~/.cache/tflms/traces.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata
from pathlib import Path

from tflms.trace.format import FORMAT_VERSION, Trace, TraceFormatError, load_trace, save_trace
from tflms.trace.models import check_input_size, resolve_model_name

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("TFLMS_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path.home() / ".cache" / "tflms" / "traces"


def _tensorflow_version() -> str:
    # Read from package metadata: importing TensorFlow just to name a cache file costs seconds.
    for dist in ("tensorflow-cpu", "tensorflow", "tensorflow-gpu", "tf-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import tensorflow as tf

    return str(tf.__version__)


def cache_path(model: str, input_size: int | None = None, precision: str = "fp32") -> Path:
    """Where the trace of a model at an input size and precision is cached (any batch size)."""
    from tflms.trace.capture import CAPTURE_REVISION, check_precision

    name = resolve_model_name(model)
    size = check_input_size(name, input_size)
    check_precision(precision)
    version = re.sub(r"[^0-9A-Za-z.]+", "_", _tensorflow_version())
    mixed = "" if precision == "fp32" else f"-{precision}"
    stem = f"{name}-s{size}{mixed}-tf{version}-v{FORMAT_VERSION}r{CAPTURE_REVISION}"
    return cache_dir() / f"{stem}.json.gz"


def cached_trace(
    model: str,
    batch_size: int,
    input_size: int | None = None,
    progress: bool = True,
    precision: str = "fp32",
) -> Trace:
    """The trace of `model` at `batch_size`: from the cache (rescaled) when present, else traced
    once at this batch size and cached. A corrupt cache file is replaced."""
    path = cache_path(model, input_size, precision)
    if path.exists():
        try:
            trace = load_trace(path)
        except (OSError, TraceFormatError, EOFError) as exc:
            log.warning("ignoring unreadable cached trace %s: %s", path, exc)
        else:
            log.info("using cached trace %s", path)
            return trace if trace.batch_size == batch_size else trace.rescaled(batch_size)
    from tflms.trace.capture import trace_model

    trace = trace_model(model, batch_size, input_size, progress=progress, precision=precision)
    save_trace(trace, path)
    log.info("cached trace at %s", path)
    return trace
