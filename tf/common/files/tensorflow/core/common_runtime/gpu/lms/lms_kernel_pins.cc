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

#include "tensorflow/core/common_runtime/gpu/lms/lms_kernel_pins.h"

#include "tensorflow/core/common_runtime/gpu/lms/lms_gpu_allocator.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {

void LmsAttachComputeStream(Device* device, stream_executor::Stream* compute) {
  if (!MovableTensorBufferUtil::Enabled() || device == nullptr ||
      compute == nullptr) {
    return;
  }
  lms::AttachComputeStream(device->GetAllocator(AllocatorAttributes()),
                           compute);
}

}  // namespace tensorflow
