"""tflms: Large Model Support for TensorFlow 2.x.

The package carries the LMS engine (the C++ core that the TensorFlow patch builds in),
the patch tools, the planner and the examples' helpers.
"""

from tflms.engine import Buffer, Engine, OutOfMemoryError

__all__ = ["Buffer", "Engine", "OutOfMemoryError"]
__version__ = "0.1.0"
