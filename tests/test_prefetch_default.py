"""LMS prefetch's default is one switch: the C++ constant and its Python mirror agree.

The GPU allocators (the patch's lms_gpu_allocator.cc and tflms.addon's lms_gpu_device.cc)
decide with tensorflow::lms::kPrefetchEnabledDefault when the program leaves prefetch
unset; the patch's Python side, which must work without the compiled library, mirrors it
for tf.config.experimental.get_lms_prefetch_enabled. Flipping the default means changing
both lines; this test fails when only one is changed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "tf/common/files/tensorflow/core/common_runtime/lms/lms_allocator.h"
PYTHON_DIFF = REPO / "tf/common/diffs/51-python-lms-config-and-stats.diff"
ADDON = REPO / "tflms/addon/csrc/lms_gpu_device.cc"
ALLOCATOR = REPO / "tf/common/files/tensorflow/core/common_runtime/gpu/lms/lms_gpu_allocator.cc"


def cpp_default() -> bool:
    """kPrefetchEnabledDefault as lms_allocator.h declares it."""
    found = re.findall(
        r"^inline constexpr bool kPrefetchEnabledDefault = (true|false);$",
        HEADER.read_text(),
        re.M,
    )
    assert len(found) == 1, found
    return found[0] == "true"


def _python_default() -> bool:
    found = re.findall(
        r"^\+_LMS_PREFETCH_ENABLED_DEFAULT = (True|False)$", PYTHON_DIFF.read_text(), re.M
    )
    assert len(found) == 1, found
    return found[0] == "True"


def test_cpp_default_and_its_python_mirror_agree() -> None:
    assert cpp_default() == _python_default()


def test_both_allocators_take_the_default_from_the_one_constant() -> None:
    # Neither GPU allocator may carry its own copy of the default: each reads the constant
    # where the program left prefetch unset.
    for source in (ALLOCATOR, ADDON):
        text = source.read_text()
        assert "kPrefetchEnabledDefault" in text, source
        assert not re.search(r"constexpr bool \w*[Pp]refetch\w*Default", text), source
