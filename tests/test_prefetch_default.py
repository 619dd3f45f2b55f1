"""LMS prefetch's default is one switch: the C++ constant and its Python mirror agree.

The GPU allocators (the patch's lms_gpu_allocator.cc and tflms.addon's lms_gpu_device.cc)
decide with tensorflow::lms::kPrefetchEnabledDefault when the program leaves prefetch
unset; the patch's Python side, which must work without the compiled library, mirrors it
for tf.config.experimental.get_lms_prefetch_enabled, and the planner mirrors it to label
the rows it calls the patch's default. Flipping the default means changing the three
lines; this test fails when only some are changed.
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


def test_the_planner_labels_what_the_patch_does_by_default() -> None:
    # The planner's third copy: which rows it calls the patch's default and how it labels
    # prefetch (tflms/planner/replay.py).
    from tflms.planner.replay import PATCH_PREFETCH_DEFAULT, PREFETCH_LABEL, EngineConfig

    assert cpp_default() == PATCH_PREFETCH_DEFAULT
    assert ("default" in PREFETCH_LABEL) == cpp_default()
    assert EngineConfig(1, 1, 1.0, prefetch=cpp_default()).patch_default
    assert not EngineConfig(1, 1, 1.0, prefetch=not cpp_default()).patch_default
