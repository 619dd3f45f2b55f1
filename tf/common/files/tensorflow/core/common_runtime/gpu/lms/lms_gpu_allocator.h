/* Copyright 2026 The TensorFlow Authors. All Rights Reserved.

Licensed under the Apache License, Version 2.0 (the "License");
you may not use this file except in compliance with the License.
You may obtain a copy of the License at

    http://www.apache.org/licenses/LICENSE-2.0

Unless required by applicable law or agreed to in writing, software
distributed under the License is distributed on an "AS IS" BASIS,
WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
See the License for the specific language governing permissions and
limitations under the License.
==============================================================================*/

// Creating the LMS allocator for a GPU, and finding it again.
//
// GPUProcessState::GetGPUAllocator calls CreateLmsGpuAllocator in the place
// of constructing a GPUBFCAllocator when
// GPUOptions.experimental.lms_enabled is set, with the same sub-allocator.
// The registry lets the GPU device hand its compute stream over and lets the
// statistics functions (lms_stats.h) find each GPU's allocator.
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_GPU_ALLOCATOR_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_GPU_ALLOCATOR_H_

#include <cstddef>
#include <functional>
#include <memory>

#include "tensorflow/core/common_runtime/lms/lms_allocator.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "xla/stream_executor/stream.h"
#include "xla/tsl/framework/allocator.h"
#include "xla/tsl/framework/device_id.h"

namespace tensorflow {

// Returns the LMS allocator for `tf_device_id`, or nullptr (with the reason
// logged) if it could not be created. Debugging allocators selected with
// TF_GPU_ALLOCATOR do not combine with LMS and are ignored, with a warning.
// `defrag_enabled` is GPUOptions.experimental.lms_defrag_enabled.
// `host_allocator` returns the pinned host allocator of the GPU's NUMA node
// (GPUProcessState::GetGpuHostAllocator); it is called on the first page-out,
// never from here, since the caller holds the GPUProcessState lock.
std::unique_ptr<tsl::Allocator> CreateLmsGpuAllocator(
    const GPUOptions& options, bool defrag_enabled,
    tsl::TfDeviceId tf_device_id, size_t total_bytes,
    std::unique_ptr<tsl::SubAllocator> sub_allocator,
    std::function<tsl::Allocator*()> host_allocator);

namespace lms {

// The LMS allocator created for `tf_device_id`, or nullptr.
LmsAllocator* FindLmsAllocator(int tf_device_id);
// The LMS allocator that `allocator` is, or nullptr. Lock-free.
LmsAllocator* FindLmsAllocator(const tsl::Allocator* allocator);

// For the GPU device: `compute` is the stream kernels of the device whose
// memory `allocator` manages run on. A no-op when that is not LMS.
void AttachComputeStream(const tsl::Allocator* allocator,
                         stream_executor::Stream* compute);

}  // namespace lms
}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_GPU_ALLOCATOR_H_
