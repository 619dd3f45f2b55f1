// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Which TensorFlow the add-on is being built against, and whether it is one
// the add-on supports. TensorFlow has no stable C++ ABI: the add-on is built
// per version, against that version's own GPU wheel (tflms/_addon_build.py).
//
// The version comes from TensorFlow's own macros. From 2.20 on the wheel's
// headers do not define them (public/release_version.h expects them from the
// build), so the add-on's build defines them from the installed wheel's
// version, as TensorFlow's build does; 2.19's public/version.h defines them
// too, with the same values (a different value would be a redefinition
// warning). This header includes nothing, so a test can check the gate alone.
//
// Supported: the patch's tags (tflms/patch/__init__.py SUPPORTED_VERSIONS).
// Checked against each one's GPU wheel (headers and exported symbols): the
// classes and functions the add-on uses (BaseGPUDevice's constructor, Init,
// Compute, ComputeAsync, CopyTensorInSameDevice; BaseGPUDeviceFactory's
// CreateDevices and private CreateGPUDevice; GPUProcessState's singleton and
// GetGPUAllocator; GPUDeviceContext's constructor and copies; Stream's
// platform_specific_handle; Tensor's allocating constructors, Slice and
// SubSlice) have the same declarations in 2.19.1, 2.20.0 and 2.21.0, up to
// spellings of the same types (Status / absl::Status, gtl::InlinedVector /
// absl::InlinedVector, uint64 / uint64_t). So no code switches on the
// version today; TFLMS_TF_AT_LEAST is where such a switch would go.
#ifndef TFLMS_ADDON_TF_VERSION_H_
#define TFLMS_ADDON_TF_VERSION_H_

#if !defined(TF_MAJOR_VERSION) || !defined(TF_MINOR_VERSION) || \
    !defined(TF_PATCH_VERSION)
#error "tflms.addon: TF_MAJOR_VERSION, TF_MINOR_VERSION and TF_PATCH_VERSION are not defined. Build the add-on through tflms/_addon_build.py (import tflms.addon does), which defines them from the installed tensorflow wheel."
#endif

#define TFLMS_TF_VERSION \
  (TF_MAJOR_VERSION * 10000 + TF_MINOR_VERSION * 100 + TF_PATCH_VERSION)
// True when the TensorFlow being built against is major.minor or newer.
#define TFLMS_TF_AT_LEAST(major, minor) \
  (TF_MAJOR_VERSION * 100 + TF_MINOR_VERSION >= (major) * 100 + (minor))

#if TFLMS_TF_VERSION != 21901 && TFLMS_TF_VERSION != 22000 && \
    TFLMS_TF_VERSION != 22100
#error "tflms.addon supports TensorFlow 2.19.1, 2.20.0, 2.21.0 only (the patch's tags): install one of those tensorflow GPU wheels, or use the patch for your version (tflms patch). To add a version: compare its gpu_device.h, gpu_process_state.h, gpu_device_context.h and exported symbols with these (docs/addon.md), then add it here and to SUPPORTED_VERSIONS in tflms/patch/__init__.py."
#endif

#endif  // TFLMS_ADDON_TF_VERSION_H_
