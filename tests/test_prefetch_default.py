"""LMS prefetch's defaults live in one header, and their mirrors agree with it.

The GPU allocators decide with the constants of lms_options.h when the program leaves
prefetch unset: the patch's lms_gpu_allocator.cc with tensorflow::lms::kPrefetchEnabledDefault,
tflms.addon's lms_gpu_device.cc (the engine's fixed-address mode) through
lms_options.cc's FixedAddressPrefetchEnabled, which applies
kFixedAddressPrefetchEnabledDefault. The patch's Python side, which must work without the
compiled library, mirrors the first for tf.config.experimental.get_lms_prefetch_enabled, and
the planner mirrors both to label the rows it calls a default. Flipping a default means
changing its constant and its mirrors; these tests fail when only some are changed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LMS = REPO / "tf/common/files/tensorflow/core/common_runtime/lms"
HEADER = LMS / "lms_options.h"
OPTIONS = LMS / "lms_options.cc"
PYTHON_DIFF = REPO / "tf/common/diffs/51-python-lms-config-and-stats.diff"
ADDON = REPO / "tflms/addon/csrc/lms_gpu_device.cc"
TFCPU = REPO / "tflms/tfcpu/csrc/lms_cpu_device.cc"
ALLOCATOR = REPO / "tf/common/files/tensorflow/core/common_runtime/gpu/lms/lms_gpu_allocator.cc"


def _header_constant(name: str) -> bool:
    found = re.findall(rf"^inline constexpr bool {name} = (true|false);$", HEADER.read_text(), re.M)
    assert len(found) == 1, (name, found)
    return found[0] == "true"


def cpp_default() -> bool:
    """kPrefetchEnabledDefault as lms_options.h declares it (the patch's default)."""
    return _header_constant("kPrefetchEnabledDefault")


def fixed_address_default() -> bool:
    """kFixedAddressPrefetchEnabledDefault (the add-on's default) as lms_options.h has it."""
    return _header_constant("kFixedAddressPrefetchEnabledDefault")


def run_ahead_default() -> int:
    """kRunAheadEpochsDefault as lms_options.h declares it (the host throttle's default)."""
    found = re.findall(
        r"^inline constexpr int kRunAheadEpochsDefault = (\d+);$", HEADER.read_text(), re.M
    )
    assert len(found) == 1, found
    return int(found[0])


def _python_default() -> bool:
    found = re.findall(
        r"^\+_LMS_PREFETCH_ENABLED_DEFAULT = (True|False)$", PYTHON_DIFF.read_text(), re.M
    )
    assert len(found) == 1, found
    return found[0] == "True"


def test_cpp_default_and_its_python_mirror_agree() -> None:
    assert cpp_default() == _python_default()


def test_each_allocator_takes_its_default_from_the_header() -> None:
    # Neither GPU allocator may carry its own copy of a default: each reads its mode's
    # constant where the program left prefetch unset, the add-on (and the CPU harness in
    # its mode) through the one resolution of the fixed-address setting.
    for source, constant in (
        (ALLOCATOR, "kPrefetchEnabledDefault"),
        (OPTIONS, "kFixedAddressPrefetchEnabledDefault"),
        (ADDON, "tensorflow::lms::FixedAddressPrefetchEnabled"),
        (TFCPU, "tensorflow::lms::FixedAddressPrefetchEnabled"),
    ):
        code = "\n".join(
            line for line in source.read_text().splitlines() if not line.lstrip().startswith("//")
        )
        assert re.search(rf"\b{re.escape(constant)}\b", code), (source, constant)
        assert not re.search(r"constexpr bool \w*[Pp]refetch\w*Default", code), source


def test_the_planner_labels_what_the_patch_does_by_default() -> None:
    # The planner's copies: which rows it calls the patch's default and how it labels
    # prefetch, with and without fixed addresses (tflms/planner/replay.py).
    from tflms.planner.replay import (
        ADDON_PREFETCH_DEFAULT,
        PATCH_PREFETCH_DEFAULT,
        PREFETCH_LABEL,
        EngineConfig,
    )

    assert cpp_default() == PATCH_PREFETCH_DEFAULT
    assert fixed_address_default() == ADDON_PREFETCH_DEFAULT
    assert ("default" in PREFETCH_LABEL) == cpp_default()
    assert EngineConfig(1, 1, 1.0, prefetch=cpp_default()).patch_default
    assert not EngineConfig(1, 1, 1.0, prefetch=not cpp_default()).patch_default
    fixed = EngineConfig(1, 1, 1.0, prefetch=True, fixed_addresses=True).label()
    assert ("(default)" in fixed) == fixed_address_default(), fixed


def test_the_planner_replays_the_patch_s_run_ahead_default() -> None:
    # The host throttle (TF_LMS_RUN_AHEAD_EPOCHS unset): the planner's replays and its CLI
    # use the patch's value, and only rows at that value are labelled the patch's default.
    from tflms.planner.replay import PATCH_RUN_AHEAD_EPOCHS, EngineConfig
    from tflms.planner.simulate import Machine

    assert run_ahead_default() == PATCH_RUN_AHEAD_EPOCHS
    assert EngineConfig(1, 1, 1.0).run_ahead_epochs == PATCH_RUN_AHEAD_EPOCHS
    assert Machine.__dataclass_fields__["run_ahead_epochs"].default == PATCH_RUN_AHEAD_EPOCHS
    other = EngineConfig(1, 1, 1.0, prefetch=cpp_default(), run_ahead_epochs=5)
    assert not other.patch_default
    assert EngineConfig(1, 1, 1.0, prefetch=cpp_default()).patch_default
