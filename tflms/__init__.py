"""tflms: Large Model Support for TensorFlow 2.x.

The package carries the LMS engine (the C++ core that the TensorFlow patch builds in),
the patch tools, the planner and the examples' helpers. The engine's extension is
loaded on first use, so the command line works even before it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tflms.engine import Buffer, Engine, OutOfMemoryError

__all__ = ["Buffer", "Engine", "OutOfMemoryError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tflms import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'tflms' has no attribute {name!r}")
