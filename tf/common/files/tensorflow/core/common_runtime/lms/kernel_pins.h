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

// What a device pins for a kernel or a copy (Large Model Support).
//
// The one decision of which tensor buffers must stay put while a kernel runs.
// The GPU device of the patch (gpu/lms/lms_kernel_pins.h wraps these for
// BaseGPUDevice), the CPU test harness and the add-on device all call it, so
// the rule below is tested wherever it runs.
//
// A kernel may read or write, besides its plain inputs:
//   * the tensors a variant input holds (TensorList elements): the list
//     kernels (Stack, Gather, Concat, BinaryAdd, ...) read them directly;
//   * the tensor of each resource variable a resource input names
//     (ReadVariableOp, AssignVariableOp, ResourceApply*, ResourceGather, ...);
//   * the tensors of a TensorArray a resource input names (Gather, Concat).
// All of these are pinned until the kernel returns (synchronous kernels) or
// calls done (asynchronous kernels). List and array elements are also held,
// since the kernel may replace them. A variable's buffer is pinned without a
// reference (kernels update it in place only while nothing else references
// it) in a way that survives the kernel replacing it (PinUnowned), so
// weights and optimizer slots move between uses, as in TFLMS v2.
//
// When the kernel has finished (returned, or called done), the creation pins
// of its outputs end: an output waiting for a consumer that runs much later
// (the executor runs ahead, loop iterations overlap) may then move. So do, for
// synchronous kernels, those of buffers the kernel created on its thread and
// kept without outputting them: the variable's new buffer when an assignment
// or an update copied it (the old one was still referenced), the elements of
// a list it outputs or of a tensor array it writes. Otherwise a weight copied
// by its optimizer update would stay pinned until the next step reads it.
//
// Kernels that only pass tensors along, never reading their bytes (Identity,
// Shape, control-flow forwarding, function calls whose bodies pin what they
// read), pin nothing, so they never page a buffer in. List kernels that only
// move element tensors around (TensorListSetItem, GetItem, PushBack, ...) pin
// the list's plain inputs but not its elements. A kernel whose output holds
// all of its inputs (ConcatV2, Pack) names them to the allocator before the
// pins, as a list's elements are named, so that they are placed together.
//
// The first XLA cluster launched with LMS on logs a warning: XLA's buffers are
// raw allocations that never move, so LMS cannot help inside a cluster.
//
// With no movable allocator in the process every function here returns after
// one relaxed atomic load.
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_LMS_KERNEL_PINS_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_LMS_KERNEL_PINS_H_

#include <initializer_list>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace lms {

// True for kernels that never read or write their inputs' bytes.
bool KernelReadsNoInputBytes(absl::string_view op_type);
// For control flow that reads one scalar input and forwards the rest: that
// input's index, else -1.
int OnlyInputReadByKernel(absl::string_view op_type);
// True for TensorList kernels that do not read the bytes of list elements.
bool KernelReadsNoListElements(absl::string_view op_type);
// True for kernels whose one output holds every byte of their inputs
// (ConcatV2, Pack): their inputs are gathered before they are pinned.
bool KernelOutputHoldsAllInputs(absl::string_view op_type);

// Pins, into `pins`, every buffer `context`'s kernel may access (see above).
// On error the pins taken so far stay in `pins`; the caller releases them.
absl::Status PinKernelInputs(OpKernelContext* context, ScopedTensorPins* pins);

// Ends the creation pins of the kernel's outputs; the kernel has finished.
void ReleaseOutputCreationPins(OpKernelContext* context);

// For a device's Compute: pins on construction; on destruction releases the
// creation pins of the outputs and of the buffers the kernel kept, and
// unpins. When ok() is false the context's status
// says why (a buffer could not be brought back into device memory) and the
// kernel must not run.
class KernelPins {
 public:
  explicit KernelPins(OpKernelContext* context);
  ~KernelPins();
  KernelPins(const KernelPins&) = delete;
  KernelPins& operator=(const KernelPins&) = delete;
  bool ok() const { return ok_; }

 private:
  OpKernelContext* const context_;
  // Marks what the kernel allocates on this thread; only with LMS on.
  std::optional<KernelCreationScope> creations_;
  ScopedTensorPins pins_;
  bool ok_ = true;
};

// For a device's ComputeAsync: pins and wraps *done so that it releases the
// outputs' creation pins and unpins first.
// Returns false, having set the context's status and called *done, when a
// buffer could not be pinned; the kernel must not run then.
bool PinAsyncKernelInputs(OpKernelContext* context,
                          AsyncOpKernel::DoneCallback* done);

// For a device context's copies: pins `tensors` (null entries and unmovable
// buffers are skipped) and wraps *done so that it unpins them. Returns false,
// having called *done with the error, when one could not be pinned.
bool PinForCopy(std::initializer_list<const Tensor*> tensors,
                StatusCallback* done);

}  // namespace lms
}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_LMS_KERNEL_PINS_H_
