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

#include "tensorflow/core/common_runtime/lms/kernel_pins.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/log/log.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_handle.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/type_index.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/framework/variant.h"
#include "tensorflow/core/kernels/tensor_array.h"
#include "tensorflow/core/kernels/tensor_list.h"
#include "tensorflow/core/platform/mutex.h"

namespace tensorflow {
namespace lms {
namespace {

// Lists nest (a list of lists); deeper nesting than this is not pinned
// further, which only costs a page-in fault if such a kernel ever exists.
constexpr int kMaxVariantDepth = 8;

// Calls `f(element, depth + 1)` for each tensor of the TensorLists `t` holds,
// if `t` is a variant tensor reached at `depth`; stops at the first error.
// Other variant payloads (datasets, optionals) live in host memory on a GPU
// and are never movable.
template <typename F>
absl::Status ForEachListElement(const Tensor& t, int depth, F f) {
  if (t.dtype() != DT_VARIANT || !t.IsInitialized() ||
      depth >= kMaxVariantDepth) {
    return absl::OkStatus();
  }
  auto flat = t.flat<Variant>();
  for (int64_t i = 0; i < flat.size(); ++i) {
    const TensorList* list = flat(i).get<TensorList>();
    if (list == nullptr) continue;
    for (const Tensor& element : list->tensors()) {
      absl::Status s = f(element, depth + 1);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// The kernel is about to pin all of `elements` together: the allocator may
// bring them together first, so that an output as large as all of them (a
// stack, a concat) finds a gap (the engine's gather.cc).
// The copies hold references: an array's element may be replaced while the
// allocator looks at the group.
void GatherForPins(absl::Span<const Tensor> elements) {
  absl::InlinedVector<MovableTensorBuffer*, 32> group;
  for (const Tensor& t : elements) {
    MovableTensorBuffer* m = MovableTensorBufferUtil::Get(t);
    if (m != nullptr) group.push_back(m);
  }
  if (group.size() > 1) MovableTensorBuffer::GatherForPins(group);
}

// The kernel's output will hold all of its inputs: the allocator may place
// them first so that the output finds a gap (the engine's gather.cc). A
// concat's two inputs pinned apart in the middle of the device left its
// output no room with twice its size free. The executor keeps the inputs
// alive until the kernel is done.
void GatherKernelInputs(OpKernelContext* context) {
  absl::InlinedVector<MovableTensorBuffer*, 8> group;
  for (int i = 0; i < context->num_inputs(); ++i) {
    if (!context->has_input(i) || context->input_is_ref(i)) continue;
    MovableTensorBuffer* m = MovableTensorBufferUtil::Get(context->input(i));
    if (m != nullptr) group.push_back(m);
  }
  if (group.size() > 1) MovableTensorBuffer::GatherForConcat(group);
}

// depth 0: a kernel input, which the executor keeps alive; deeper: reached
// through a list, an array or a variable, so held. List elements are held
// as well as pinned: a list kernel may replace them while it runs.
absl::Status PinTensor(const Tensor& t, bool elements, int depth,
                       ScopedTensorPins* pins) {
  absl::Status s = depth == 0 ? pins->Pin(t) : pins->PinAndHold(t);
  if (!s.ok() || !elements) return s;
  // One walk: the copies taken for the gather are the tensors pinned.
  absl::InlinedVector<Tensor, 32> group;
  ForEachListElement(t, depth, [&](const Tensor& element, int) {
    group.push_back(element);
    return absl::OkStatus();
  }).IgnoreError();
  GatherForPins(group);
  for (const Tensor& element : group) {
    s = PinTensor(element, /*elements=*/true, depth + 1, pins);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Variables and tensor arrays are reached through their handles: calls
// `on_var` with a variable (the caller takes its lock) or `on_array` with a
// tensor array. A handle that does not resolve here (another device, not
// created yet) is left to the kernel, which reports it.
template <typename OnVar, typename OnArray>
absl::Status VisitResource(OpKernelContext* context, const ResourceHandle& h,
                           OnVar on_var, OnArray on_array) {
  static const uint64_t kVar = TypeIndex::Make<Var>().hash_code();
  static const uint64_t kTensorArray =
      TypeIndex::Make<TensorArray>().hash_code();
  if (h.hash_code() == kVar) {
    core::RefCountPtr<Var> var;
    if (!LookupResource(context, h, &var).ok()) return absl::OkStatus();
    return on_var(var.get());
  }
  if (h.hash_code() == kTensorArray) {
    core::RefCountPtr<TensorArray> array;
    if (!LookupResource(context, h, &array).ok()) return absl::OkStatus();
    return on_array(array.get());
  }
  return absl::OkStatus();
}

// The resource handles among the kernel's inputs, for `f`; stops at the
// first error.
template <typename F>
absl::Status ForEachResourceInput(OpKernelContext* context, int input, F f) {
  const Tensor& t = context->input(input);
  if (t.dtype() != DT_RESOURCE || !t.IsInitialized()) return absl::OkStatus();
  auto handles = t.flat<ResourceHandle>();
  absl::Status s;
  for (int64_t j = 0; s.ok() && j < handles.size(); ++j) s = f(handles(j));
  return s;
}

absl::Status PinResource(OpKernelContext* context, const ResourceHandle& h,
                         bool elements, ScopedTensorPins* pins) {
  return VisitResource(
      context, h,
      [&](Var* var) {
        // Kernels update a variable's buffer in place, under its lock, only
        // while they hold the only reference, and replace it on assignment:
        // the pin takes no reference and survives the buffer being dropped
        // (PinUnowned). Taken under the variable's lock so that the tensor
        // cannot be swapped between reading and pinning it; the kernel takes
        // the lock itself afterwards.
        tf_shared_lock lock(*var->mu());
        const Tensor& current = *var->tensor();
        absl::Status s = pins->PinUnowned(current);
        if (s.ok() && elements && current.dtype() == DT_VARIANT) {
          s = PinTensor(current, elements, 1, pins);
        }
        return s;
      },
      [&](TensorArray* array) {
        // One walk, as for a list: the copies hold references, so an
        // element replaced meanwhile stays alive until its pin.
        absl::InlinedVector<Tensor, 32> group;
        array->ForEachTensor([&](const Tensor& t) { group.push_back(t); });
        if (elements) GatherForPins(group);
        for (const Tensor& t : group) {
          absl::Status status = PinTensor(t, elements, 1, pins);
          if (!status.ok()) return status;
        }
        return absl::OkStatus();
      });
}

// Ends the creation pin of `t`'s buffer, and of the list elements it holds,
// where `scope`'s kernel allocated them.
void ReleaseIfCreatedIn(const Tensor& t, const KernelCreationScope& scope,
                        int depth) {
  MovableTensorBuffer* m = MovableTensorBufferUtil::Get(t);
  if (m != nullptr) m->ReleaseCreationPinIfCreatedIn(scope);
  ForEachListElement(t, depth, [&](const Tensor& element, int d) {
    ReleaseIfCreatedIn(element, scope, d);
    return absl::OkStatus();
  }).IgnoreError();
}

// A kernel that has finished may have kept buffers it created without making
// them outputs: a variable's new buffer (assignment, copy-on-write before an
// update), elements of a list it outputs or of an array it writes. Their
// creation pins would otherwise last until their next reader unpins them,
// for weights and optimizer slots the whole time until the next step.
void ReleaseKeptCreationPins(OpKernelContext* context,
                             const KernelCreationScope& scope) {
  for (int i = 0; i < context->num_outputs(); ++i) {
    const Tensor* out = context->mutable_output(i);
    if (out != nullptr && out->dtype() == DT_VARIANT) {
      ReleaseIfCreatedIn(*out, scope, 0);
    }
  }
  for (int i = 0; i < context->num_inputs(); ++i) {
    if (!context->has_input(i) || context->input_is_ref(i)) continue;
    ForEachResourceInput(context, i, [&](const ResourceHandle& h) {
      return VisitResource(
          context, h,
          [&](Var* var) {
            tf_shared_lock lock(*var->mu());
            ReleaseIfCreatedIn(*var->tensor(), scope, 1);
            return absl::OkStatus();
          },
          [&](TensorArray* array) {
            array->ForEachTensor([&](const Tensor& t) {
              ReleaseIfCreatedIn(t, scope, 1);
            });
            return absl::OkStatus();
          });
    }).IgnoreError();
  }
}

std::atomic<bool> warned_about_xla{false};

// Auto-clustering launches clusters with these ops; jit_compile=True
// functions run as a kernel made for the function, marked _XlaMustCompile.
bool IsXlaClusterLaunch(const OpKernel& kernel) {
  const absl::string_view op_type = kernel.type_string_view();
  if (op_type == "XlaLaunch" || op_type == "XlaLaunchV2" ||
      op_type == "_XlaRun" || op_type == "_XlaCompile") {
    return true;
  }
  const auto& attrs = kernel.def().attr();
  auto it = attrs.find("_XlaMustCompile");
  return it != attrs.end() && it->second.b();
}

// XLA allocates a cluster's buffers itself, as raw allocations LMS never
// moves: say so once, with what to change, since nothing else would tell.
void WarnOnceAboutXla(OpKernelContext* context) {
  if (warned_about_xla.exchange(true)) return;
  LOG(WARNING) << "Large Model Support: XLA cluster "
               << context->op_kernel().name()
               << " runs with LMS on. XLA allocates its buffers itself and LMS "
                  "never moves them, so memory inside XLA clusters is not "
                  "managed by LMS. For LMS to page tensors out, compile without "
                  "XLA: model.compile(jit_compile=False) in Keras, "
                  "tf.function(jit_compile=False), and "
                  "TF_XLA_FLAGS=--tf_xla_auto_jit=0.";
}

}  // namespace

bool KernelReadsNoInputBytes(absl::string_view op_type) {
  // Forwarding, shape queries and calls: the callee's kernels pin what they
  // read, and pinning here would hold every argument for the whole call.
  static const auto* const kOps = new absl::flat_hash_set<absl::string_view>({
      "Identity",
      "IdentityN",
      "StopGradient",
      "PreventGradient",
      "Shape",
      "ShapeN",
      "Size",
      "Rank",
      "Enter",
      "RefEnter",
      "Exit",
      "RefExit",
      "Merge",
      "RefMerge",
      "NextIteration",
      "RefNextIteration",
      "LoopCond",
      "_Retval",
      "_DeviceRetval",
      "_Send",
      "_HostSend",
      "PartitionedCall",
      "StatefulPartitionedCall",
      "While",
      "StatelessWhile",
      "VarIsInitializedOp",
      "DestroyResourceOp",
      "VariableShape",
  });
  return kOps->contains(op_type);
}

int OnlyInputReadByKernel(absl::string_view op_type) {
  // Control flow that reads one scalar (the predicate or branch index) and
  // passes everything else along. On a GPU those scalars live in host memory
  // and are not movable; where device memory is host memory they are.
  static const auto* const kOps =
      new absl::flat_hash_map<absl::string_view, int>({
          {"Switch", 1},
          {"RefSwitch", 1},
          {"_SwitchN", 1},
          {"If", 0},
          {"StatelessIf", 0},
          {"Case", 0},
          {"StatelessCase", 0},
      });
  auto it = kOps->find(op_type);
  return it == kOps->end() ? -1 : it->second;
}

bool KernelReadsNoListElements(absl::string_view op_type) {
  static const auto* const kOps = new absl::flat_hash_set<absl::string_view>({
      "TensorListLength",
      "TensorListElementShape",
      "TensorListPushBack",
      "TensorListPopBack",
      "TensorListSetItem",
      "TensorListGetItem",
      "TensorListResize",
      "TensorArraySizeV3",
      "TensorArrayReadV3",
      "TensorArrayCloseV3",
      "TensorArrayGradV3",
      "TensorArrayGradWithShape",
  });
  return kOps->contains(op_type);
}

bool KernelOutputHoldsAllInputs(absl::string_view op_type) {
  // The planner's replay gathers the same kernels (CONCAT_OPS in
  // tflms/planner/replay.py; keep in step).
  static const auto* const kOps = new absl::flat_hash_set<absl::string_view>(
      {"ConcatV2", "Concat", "Pack", "ParallelConcat"});
  return kOps->contains(op_type);
}

absl::Status PinKernelInputs(OpKernelContext* context, ScopedTensorPins* pins) {
  const absl::string_view op_type = context->op_kernel().type_string_view();
  if (!warned_about_xla.load(std::memory_order_relaxed) &&
      IsXlaClusterLaunch(context->op_kernel())) {
    WarnOnceAboutXla(context);
  }
  if (KernelReadsNoInputBytes(op_type)) return absl::OkStatus();
  const int only = OnlyInputReadByKernel(op_type);
  if (only >= 0) {
    if (only >= context->num_inputs() || !context->has_input(only) ||
        context->input_is_ref(only)) {
      return absl::OkStatus();
    }
    return pins->Pin(context->input(only));
  }
  const bool elements = !KernelReadsNoListElements(op_type);
  if (KernelOutputHoldsAllInputs(op_type)) GatherKernelInputs(context);
  for (int i = 0; i < context->num_inputs(); ++i) {
    if (!context->has_input(i)) continue;
    // A reference input (TF1 variables) is read under its mutex; the copy
    // shares the buffer. Held: Assign may replace the buffer while it runs.
    const bool ref = context->input_is_ref(i);
    const Tensor t = ref ? context->mutable_input(i, /*lock_held=*/false)
                         : context->input(i);
    absl::Status s = PinTensor(t, elements, ref ? 1 : 0, pins);
    if (s.ok() && !ref) {
      s = ForEachResourceInput(context, i, [&](const ResourceHandle& h) {
        return PinResource(context, h, elements, pins);
      });
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void ReleaseOutputCreationPins(OpKernelContext* context) {
  for (int i = 0; i < context->num_outputs(); ++i) {
    const Tensor* out = context->mutable_output(i);
    if (out == nullptr) continue;
    MovableTensorBuffer* m = MovableTensorBufferUtil::Get(*out);
    if (m != nullptr) m->ReleaseCreationPin();
  }
}

namespace {

// Tells the device's LMS allocator which step the kernel belongs to, so that
// the engine finds step boundaries (and prefetches) with nobody marking them,
// and which kernel allocates next on this thread: the engine then knows an
// output by its size and its kernel, not by its size alone, whose rank the
// executor's order shuffles (an optimizer's updates, all of one size).
void NoteKernelStep(OpKernelContext* context) {
  MovableAllocator* movable = FindMovableAllocator(
      context->device()->GetAllocator(AllocatorAttributes()));
  if (movable == nullptr || !movable->LearnsStepOrder()) return;
  movable->NoteStepId(context->step_id());
  const uint64_t site =
      std::hash<absl::string_view>()(context->op_kernel().name_view());
  movable->NoteAllocationSite(site == 0 ? 1 : site);
}

}  // namespace

KernelPins::KernelPins(OpKernelContext* context) : context_(context) {
  if (!MovableTensorBufferUtil::Enabled()) return;
  creations_.emplace();
  NoteKernelStep(context);
  absl::Status s = PinKernelInputs(context, &pins_);
  if (!s.ok()) {
    pins_.Release();
    context->SetStatus(s);
    ok_ = false;
  }
}

KernelPins::~KernelPins() {
  if (!creations_.has_value()) return;
  if (ok_) {
    ReleaseOutputCreationPins(context_);
    if (creations_->created_any()) {
      ReleaseKeptCreationPins(context_, *creations_);
    }
  }
  pins_.Release();
}

bool PinAsyncKernelInputs(OpKernelContext* context,
                          AsyncOpKernel::DoneCallback* done) {
  if (!MovableTensorBufferUtil::Enabled()) return true;
  NoteKernelStep(context);
  auto pins = std::make_shared<ScopedTensorPins>();
  absl::Status s = PinKernelInputs(context, pins.get());
  if (!s.ok()) {
    pins->Release();
    context->SetStatus(s);
    (*done)();
    return false;
  }
  *done = [context, pins = std::move(pins), parent = std::move(*done)]() {
    ReleaseOutputCreationPins(context);
    pins->Release();
    parent();
  };
  return true;
}

bool PinForCopy(std::initializer_list<const Tensor*> tensors,
                StatusCallback* done) {
  if (!MovableTensorBufferUtil::Enabled()) return true;
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

}  // namespace lms
}  // namespace tensorflow
