"""Builds the engine's Python extension (tflms._core) from core/ with pybind11.

The engine sources are compiled in parallel because the machines the package is
installed on may have as few as two cores.

build_py also copies what the patch tools read (patches/, tf/, core/include and core/src,
see tflms/_data.py) into the package as tflms/data/, so that an install from a wheel or an
sdist finds them without a checkout. The checkout keeps them at the top (MANIFEST.in puts
them in the sdist); an editable install reads them there and copies nothing.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

ParallelCompile("TFLMS_BUILD_JOBS", default=0).install()

ENGINE_SOURCES = sorted(
    s for s in glob.glob("core/src/*.cc") if not os.path.basename(s).startswith("cuda_")
)

# Copied into the package as tflms/data/<same path> (tflms._data.SHIPPED_DIR).
SHIPPED_DIR = os.path.join("tflms", "data")
SHIPPED_TREES = ("patches", "tf", os.path.join("core", "include"), os.path.join("core", "src"))


def shipped_sources():
    """The files the patch tools read, relative to the project root, sorted."""
    found = []
    for tree in SHIPPED_TREES:
        for dirpath, dirnames, filenames in os.walk(tree):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            found += [
                os.path.join(dirpath, f) for f in filenames if not f.endswith((".pyc", ".pyo"))
            ]
    return sorted(found)


class build_py_with_sources(build_py):
    """build_py, plus the patches and their sources under tflms/data/ (not when editable)."""

    def _shipped(self):
        if getattr(self, "editable_mode", False):
            return {}
        return {os.path.join(self.build_lib, SHIPPED_DIR, src): src for src in shipped_sources()}

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        missing = [tree for tree in SHIPPED_TREES if not os.path.isdir(tree)]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} missing: build from a checkout or an sdist")
        for dest, src in self._shipped().items():
            self.mkpath(os.path.dirname(dest))
            self.copy_file(src, dest, preserve_mode=False)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), *self._shipped()]

    def get_output_mapping(self):
        return {**super().get_output_mapping(), **self._shipped()}


ext = Pybind11Extension(
    "tflms._core",
    sources=["tflms/_native/binding.cc", *ENGINE_SOURCES],
    # Without the headers here, a change to one alone (engine_impl.h's constants)
    # left a stale extension that an in-place rebuild did not replace.
    depends=sorted(glob.glob("core/include/tflms/*.h") + glob.glob("core/src/*.h")),
    include_dirs=["core/include", "core/src"],
    cxx_std=17,
    extra_compile_args=["-O2", "-fvisibility=hidden"],
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext, "build_py": build_py_with_sources},
)
