"""What the tflms.tfcpu harness runs of the patch, and what it stands in for.

docs/verification.md (written by `tflms verify`) prints this table; keep it true when
the harness or the patch changes.
"""

from __future__ import annotations

RUNS = "runs"
STANDS_IN = "stood in for"
NOT_RUN = "not run"

# (part of the patch, how the harness treats it, how)
COVERAGE: list[tuple[str, str, str]] = [
    (
        "framework/movable_tensor_buffer.{h,cc}",
        RUNS,
        "compiled unchanged; every movable tensor buffer in the harness is one",
    ),
    (
        "common_runtime/lms/lms_allocator.{h,cc}",
        RUNS,
        "the device's allocator, over the engine's simulated device instead of "
        "StreamExecutorLmsDevice",
    ),
    (
        "common_runtime/lms/kernel_pins.{h,cc}",
        RUNS,
        "called by the harness device's Compute, ComputeAsync and same-device copy, as "
        "the GPU device's hunks call it through gpu/lms/lms_kernel_pins.h",
    ),
    (
        "common_runtime/lms/lms_options.{h,cc}",
        RUNS,
        "enable() with prefetch unset resolves it here as a GPU's LMS allocator does: "
        "GPUOptions without lms_prefetch_enabled (the stock config.pb.h has no such "
        "field, so the set case is not run), the default constant, TF_LMS_PREFETCH",
    ),
    ("gpu/lms/core (the engine)", RUNS, "compiled from the patch's copy"),
    (
        "02-tensor-buffer-movable-data (tensor.h)",
        RUNS,
        "the harness is compiled against the patched header; the wheel's kernels, "
        "compiled against the stock one, read data_ at the same offset",
    ),
    (
        "04-tensor-array-visit-tensors (tensor_array.h)",
        RUNS,
        "ForEachTensor is an inline template; the array's layout is the stock one",
    ),
    (
        "03-tensor-allocate-movable (tensor.cc)",
        STANDS_IN,
        "tflms/tfcpu/csrc/tensor_hooks.cc redirects the PLT calls of every loaded "
        "TensorFlow library to Tensor's allocating constructors, Tensor::Slice and "
        "SubSlice to code that calls the same MovableTensorBufferUtil functions the "
        "hunk calls (a slice gets the harness's PinningSlice buffer, which pins its "
        "root as the hunk's SubBuffer does; the wheel's SubBuffer cannot be "
        "changed); calls inside tensor.cc itself (FromProto, UnalignedSlice) keep "
        "stock buffers, which never move",
    ),
    (
        "10-gpu-process-state-lms-allocator (gpu_process_state.cc)",
        STANDS_IN,
        "a device factory registered for CPU above the stock one creates the "
        "LmsAllocator; the GPU sub-allocator and gpu_host_bfc are not involved",
    ),
    (
        "11-gpu-device-pin-kernel-inputs (gpu_device.cc)",
        STANDS_IN,
        "LmsCpuDevice (a ThreadPoolDevice) makes the same calls around each kernel; "
        "the compute-stream hand-over (AttachComputeStream) is GPU only",
    ),
    (
        "20-c-api-device-pointer-unmovable (c_api.cc)",
        STANDS_IN,
        "Python reads CPU tensors in place (numpy, DLPack): the harness calls the "
        "patch's MakeTensorUnmovable before each such read, as the hunk does in "
        "TFE_TensorHandleDevicePointer",
    ),
    (
        "12-gpu-device-context-pin-copies, 14-gpu-util-pin-device-to-device-copies",
        NOT_RUN,
        "a CPU device has no host<->device or GPU<->GPU copies; lms::PinForCopy runs "
        "for same-device copies only",
    ),
    (
        "gpu/lms/stream_executor_lms_device, lms_gpu_allocator, lms_stats, python/lms",
        NOT_RUN,
        "need a GPU build; compiled by b), the Python half checked by c)",
    ),
    ("06-op-kernel-oom-lms-hint, BUILD hunks", NOT_RUN, "need TensorFlow's build"),
]


def render() -> list[str]:
    lines = [
        "## e) Run inside stock TensorFlow (tflms.tfcpu)",
        "",
        "tests/test_tfcpu.py runs Keras and TensorFlow programs with the patch's "
        "TensorFlow side moving their tensors through a modelled device memory of at "
        "most a quarter of their peak, and compares their results bit for bit with "
        "stock TensorFlow (see docs/how-it-works.md).",
        "",
        "| part of the patch | in the harness | how |",
        "|---|---|---|",
    ]
    lines += [f"| {part} | {status} | {how} |" for part, status, how in COVERAGE]
    return lines
