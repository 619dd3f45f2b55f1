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

#include <initializer_list>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "tensorflow/core/common_runtime/gpu/lms/lms_gpu_allocator.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace {

void Attach(Device* device, stream_executor::Stream* compute) {
  if (device == nullptr || compute == nullptr) return;
  lms::AttachComputeStream(device->GetAllocator(AllocatorAttributes()),
                           compute);
}

absl::Status PinInputs(OpKernelContext* context, ScopedTensorPins* pins) {
  for (int i = 0; i < context->num_inputs(); ++i) {
    if (!context->has_input(i)) continue;
    // A reference input is read under its mutex; the copy shares the buffer.
    absl::Status s =
        context->input_is_ref(i)
            ? pins->Pin(context->mutable_input(i, /*lock_held=*/false))
            : pins->Pin(context->input(i));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

LmsKernelPins::LmsKernelPins(Device* device, stream_executor::Stream* compute,
                             OpKernelContext* context) {
  if (!MovableTensorBufferUtil::Enabled()) return;
  Attach(device, compute);
  absl::Status s = PinInputs(context, &pins_);
  if (!s.ok()) {
    pins_.Release();
    context->SetStatus(s);
    ok_ = false;
  }
}

bool LmsPinAsyncKernelInputs(Device* device, stream_executor::Stream* compute,
                             OpKernelContext* context,
                             AsyncOpKernel::DoneCallback* done) {
  if (!MovableTensorBufferUtil::Enabled()) return true;
  Attach(device, compute);
  auto pins = std::make_shared<ScopedTensorPins>();
  absl::Status s = PinInputs(context, pins.get());
  if (!s.ok()) {
    pins->Release();
    context->SetStatus(s);
    (*done)();
    return false;
  }
  if (pins->empty()) return true;
  *done = [pins = std::move(pins), parent = std::move(*done)]() {
    pins->Release();
    parent();
  };
  return true;
}

bool LmsPinForCopy(Device* device, stream_executor::Stream* compute,
                   std::initializer_list<const Tensor*> tensors,
                   StatusCallback* done) {
  if (!MovableTensorBufferUtil::Enabled()) return true;
  Attach(device, compute);
  auto pins = std::make_shared<ScopedTensorPins>();
  for (const Tensor* t : tensors) {
    if (t == nullptr) continue;
    absl::Status s = pins->Pin(*t);
    if (!s.ok()) {
      pins->Release();
      (*done)(s);
      return false;
    }
  }
  if (pins->empty()) return true;
  *done = [pins = std::move(pins),
           parent = std::move(*done)](const absl::Status& s) {
    pins->Release();
    parent(s);
  };
  return true;
}

}  // namespace tensorflow
