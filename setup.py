"""Builds the engine's Python extension (tflms._core) from core/ with pybind11.

The engine sources are compiled in parallel because the machines the package is
installed on may have as few as two cores.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("TFLMS_BUILD_JOBS", default=0).install()

ENGINE_SOURCES = sorted(
    s for s in glob.glob("core/src/*.cc") if not os.path.basename(s).startswith("cuda_")
)

ext = Pybind11Extension(
    "tflms._core",
    sources=["tflms/_native/binding.cc", *ENGINE_SOURCES],
    include_dirs=["core/include", "core/src"],
    cxx_std=17,
    extra_compile_args=["-O2", "-fvisibility=hidden"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
