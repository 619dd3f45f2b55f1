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

// Where the GPU runtime pins tensor buffers for Large Model Support.
//
// BaseGPUDevice and GPUDeviceContext call these; each hands the device's
// compute stream to its LMS allocator (the engine orders page-outs after the
// kernels already enqueued there) and then applies the pin rule every LMS
// device shares (common_runtime/lms/kernel_pins.h). The GPU device pins a
// kernel's buffers while the kernel is enqueued (synchronous kernels) or
// until it calls done (asynchronous kernels), before it logs inputs for
// TF_GPU_DEBUG_OPS_TO_LOG; the device context and the GPU->GPU copy function
// pin both sides of every copy until the copy's done callback. Unpinning does
// not wait for the GPU.
//
// Each function costs one relaxed atomic load when LMS is off.
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_KERNEL_PINS_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_KERNEL_PINS_H_

#include <initializer_list>
#include <utility>

#include "tensorflow/core/common_runtime/lms/kernel_pins.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {

// Hands `compute` to the LMS allocator of `device`, if it has one.
void LmsAttachComputeStream(Device* device, stream_executor::Stream* compute);

// For BaseGPUDevice::Compute. When ok() is false the context's status says
// why (an input could not be brought back into GPU memory) and the kernel
// must not run.
class LmsKernelPins {
 public:
  LmsKernelPins(Device* device, stream_executor::Stream* compute,
                OpKernelContext* context)
      : pins_((LmsAttachComputeStream(device, compute), context)) {}
  bool ok() const { return pins_.ok(); }

 private:
  lms::KernelPins pins_;
};

// For BaseGPUDevice::ComputeAsync: pins the kernel's buffers and wraps *done
// so that it unpins them. Returns false, having set the context's status and
// called *done, when one could not be pinned; the kernel must not run then.
inline bool LmsPinAsyncKernelInputs(Device* device,
                                    stream_executor::Stream* compute,
                                    OpKernelContext* context,
                                    AsyncOpKernel::DoneCallback* done) {
  if (!MovableTensorBufferUtil::Enabled()) return true;
  LmsAttachComputeStream(device, compute);
  return lms::PinAsyncKernelInputs(context, done);
}

// For GPUDeviceContext's copies: pins `tensors` (the GPU side; host tensors
// are skipped) and wraps *done so that it unpins them. Returns false, having
// called *done with the error, when one could not be pinned.
inline bool LmsPinForCopy(Device* device, stream_executor::Stream* compute,
                          std::initializer_list<const Tensor*> tensors,
                          StatusCallback* done) {
  if (!MovableTensorBufferUtil::Enabled()) return true;
  LmsAttachComputeStream(device, compute);
  return lms::PinForCopy(tensors, done);
}

// For the GPU->GPU CopyTensor registration in gpu_util.cc: runs `Copy`
// (GPUUtil::DeviceToDeviceCopy) with both tensors pinned until it is done.
// A template, so that this library need not depend on gpu_util.
template <auto Copy>
void LmsPinnedDeviceToDeviceCopy(
    DeviceContext* send_dev_context, DeviceContext* recv_dev_context,
    Device* src, Device* dst, const AllocatorAttributes src_alloc_attr,
    const AllocatorAttributes dst_alloc_attr, const Tensor* input,
    Tensor* output, int dev_to_dev_stream_index, StatusCallback done) {
  stream_executor::Stream* compute =
      send_dev_context == nullptr ? nullptr : send_dev_context->stream();
  if (!LmsPinForCopy(src, compute, {input, output}, &done)) return;
  Copy(send_dev_context, recv_dev_context, src, dst, src_alloc_attr,
       dst_alloc_attr, input, output, dev_to_dev_stream_index, std::move(done));
}

}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_KERNEL_PINS_H_
