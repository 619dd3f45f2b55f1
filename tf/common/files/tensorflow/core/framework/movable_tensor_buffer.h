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

// Tensor buffers whose bytes may move (Large Model Support).
//
// An allocator registered as a MovableAllocator (the LMS GPU allocator) may
// page a buffer out to host memory, page it back in at another address, or
// move it within device memory, whenever the buffer is not pinned. Code that
// reads or writes a tensor's bytes therefore pins it first and unpins it when
// the access (including device work it enqueued) no longer needs the address.
// The pin sites are few and fixed (common_runtime/lms/kernel_pins.h): the
// device around every kernel (its inputs, the tensors held inside variant
// inputs, the buffers of the variables and tensor arrays its resource inputs
// name), the
// device context around every copy, and the C API when a raw device pointer
// escapes (which makes the buffer unmovable for good).
//
// Invariants:
//   * A new buffer starts pinned by its creator (the kernel that writes it,
//     or a copy that fills it). The creation pin ends when the kernel that
//     made the buffer has finished, if the pin site finds it among the
//     kernel's outputs or the tensors its resource inputs and variant outputs
//     hold (a variable's new buffer after copy-on-write, a list element);
//     else with the first unpin from a pin site. A buffer destroyed while
//     still creation-pinned drops that pin itself, so it never outlives its
//     memory.
//   * A pin holds no reference on the buffer: whoever pins keeps the tensor
//     alive until it unpins (the executor holds a kernel's inputs until the
//     kernel returns or calls done). Taking a reference would make
//     Tensor::RefCountIsOne() false inside every kernel and so disable buffer
//     forwarding.
//   * A slice (Tensor::Slice, SubSlice) keeps its own copy of the root's
//     address, so slicing makes the root buffer unmovable.
//
// ABI: nothing here adds a virtual function or a member to TensorBuffer or
// tsl::Allocator, so binaries built against the stock headers (custom ops)
// keep working. A movable buffer is recognized by its dynamic type and a
// movable allocator by a registry.
//
// With no movable allocator registered (LMS off) every function the runtime
// calls returns after one relaxed atomic load.
#ifndef TENSORFLOW_CORE_FRAMEWORK_MOVABLE_TENSOR_BUFFER_H_
#define TENSORFLOW_CORE_FRAMEWORK_MOVABLE_TENSOR_BUFFER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/platform/macros.h"

namespace tensorflow {

// Interface of an allocator whose buffers may move between device and host
// memory, or within device memory, while they are not pinned.
//
// A buffer is named by an opaque handle. Its device address is valid from
// AllocateMovable or PinMovable until the matching UnpinMovable, and may
// differ after every PinMovable. A new buffer is returned pinned once.
// MakeUnmovable is for addresses that escape (C API, DLPack): it returns once
// the bytes are resident at *data, and the buffer never moves again.
// All methods are thread-safe.
class MovableAllocator {
 public:
  // Returns the handle, or nullptr when no memory could be made available.
  virtual void* AllocateMovable(size_t alignment, size_t num_bytes,
                                const AllocationAttributes& allocation_attr,
                                void** data) = 0;
  // REQUIRES: the buffer is not pinned.
  virtual void DeallocateMovable(void* handle) = 0;
  virtual absl::Status PinMovable(void* handle, void** data) = 0;
  virtual void UnpinMovable(void* handle) = 0;
  virtual absl::Status MakeUnmovable(void* handle, void** data) = 0;
  virtual size_t MovableSize(const void* handle) const = 0;
  // Whether NoteStepId and NoteAllocationSite are of use to this allocator
  // (it learns a step's order to prefetch); pin sites skip both otherwise,
  // hashing no kernel name.
  virtual bool LearnsStepOrder() const { return false; }
  // A kernel of step `step_id` (OpKernelContext::step_id) is about to pin its
  // inputs. Allocators that learn a step's order to prefetch override it.
  virtual void NoteStepId(int64_t /*step_id*/) {}
  // The same kernel's allocations on this thread, until the next kernel's
  // note, come from the site `site` names (a nonzero hash of the kernel's
  // name): an allocator that learns a step's order may know tensors by it.
  virtual void NoteAllocationSite(uint64_t /*site*/) {}
  // A kernel is about to pin these buffers together (every element of a
  // list or array it reads): an allocator that places buffers may bring
  // them together first, so that its output finds a gap. Best effort.
  virtual void GatherMovable(void* const* /*handles*/, size_t /*n*/) {}
  // As GatherMovable, for a kernel that then allocates one output as large
  // as all of them (a concat, a stack): any group of two or more.
  virtual void GatherMovableForConcat(void* const* /*handles*/, size_t /*n*/) {
  }

 protected:
  // Owned as an Allocator, never through this interface.
  virtual ~MovableAllocator() = default;
};

// `allocator` hands out movable tensor buffers through `movable` (usually the
// same object). Registered allocators must be unregistered before they are
// destroyed. Returns false when the registry is full.
bool RegisterMovableAllocator(const Allocator* allocator,
                              MovableAllocator* movable);
void UnregisterMovableAllocator(const Allocator* allocator);
// The MovableAllocator of `allocator`, or nullptr. Lock-free.
MovableAllocator* FindMovableAllocator(const Allocator* allocator);

// Marks the movable buffers allocated on the calling thread while it lives
// as created by one kernel run, so that the pin site can end their creation
// pins when the kernel has finished even where they are not outputs (see
// KernelPins). Scopes nest. Buffers allocated on other threads (a kernel's
// intra-op workers, an asynchronous kernel's callbacks) are not marked and
// keep their creation pin until the first unpin, which is safe, only later.
class KernelCreationScope {
 public:
  KernelCreationScope();
  ~KernelCreationScope();
  // Whether a movable buffer was created on this thread within the scope.
  bool created_any() const;

 private:
  friend class MovableTensorBuffer;
  // A scope is named by its address: unique among live scopes. A buffer
  // whose creator has ended and whose address a later scope reuses may be
  // released by that scope too, which is safe, since its creator is done.
  uintptr_t id() const { return reinterpret_cast<uintptr_t>(this); }

  const uintptr_t outer_;
  const int64_t created_before_;

  KernelCreationScope(const KernelCreationScope&) = delete;
  void operator=(const KernelCreationScope&) = delete;
};

// A root tensor buffer allocated from a MovableAllocator.
class MovableTensorBuffer final : public TensorBuffer {
 public:
  // Returns a buffer of `num_bytes`, pinned by its creator; data() is nullptr
  // when the allocator could not provide the memory.
  static MovableTensorBuffer* Allocate(Allocator* allocator,
                                       MovableAllocator* movable,
                                       size_t num_bytes,
                                       const AllocationAttributes& attr);

  // `buffer` if it is a MovableTensorBuffer, else nullptr.
  static MovableTensorBuffer* FromBuffer(TensorBuffer* buffer);
  // Tells the allocator of `group`'s buffers that they are about to be
  // pinned together (MovableAllocator::GatherMovable). Buffers of another
  // allocator than the first one's are left out.
  static void GatherForPins(absl::Span<MovableTensorBuffer* const> group);
  // The same, for a kernel whose output holds every byte of `group`
  // (MovableAllocator::GatherMovableForConcat).
  static void GatherForConcat(absl::Span<MovableTensorBuffer* const> group);

  // Makes the buffer resident and keeps it at data() until Unpin().
  absl::Status Pin();
  void Unpin();
  // Ends the creator's pin if it is still held (the creator is done).
  void ReleaseCreationPin();
  // The same, only if the buffer was allocated within `scope`, whose kernel
  // has finished.
  void ReleaseCreationPinIfCreatedIn(const KernelCreationScope& scope);
  // A slice's hold on its root: like Pin/Unpin, except that releasing it
  // never ends the creator's pin (a kernel may slice its own output and drop
  // the slice while it still writes the root).
  absl::Status PinForSlice() { return Pin(); }
  void UnpinForSlice();
  // For ScopedTensorPins::PinUnowned (see there). REQUIRES: the caller keeps
  // the buffer alive during the call (it holds the variable's lock).
  absl::Status PinUnowned();
  // Ends one PinUnowned pin of `buffer` if the buffer is still alive; if it
  // was destroyed, its destructor already ended the pin.
  static void UnpinUnowned(MovableTensorBuffer* buffer);
  // Resident at data() from now on, pinned or not.
  absl::Status MakeUnmovable();
  bool unmovable() const { return unmovable_.load(std::memory_order_acquire); }

  size_t size() const override { return num_bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override;
  bool GetAllocatedBytes(size_t* out_bytes) const override;
  AllocatorMemoryType GetMemoryType() const override {
    return AllocatorMemoryType::kDevice;
  }

 private:
  MovableTensorBuffer(Allocator* allocator, MovableAllocator* movable,
                      void* handle, void* data, size_t num_bytes,
                      uintptr_t creator);
  ~MovableTensorBuffer() override;
  // Calls gather(allocator, handles, n) with the handles of `group`'s
  // buffers that belong to the first one's allocator.
  template <typename Gather>
  static void GatherHandles(absl::Span<MovableTensorBuffer* const> group,
                            Gather gather);

  Allocator* const allocator_;
  MovableAllocator* const movable_;
  void* const handle_;  // nullptr when the allocation failed
  const size_t num_bytes_;
  // The KernelCreationScope it was allocated in (its id), or 0.
  const uintptr_t creator_;
  std::atomic<bool> creation_pin_;
  std::atomic<bool> unmovable_{false};
  // Set once PinUnowned ran: only then does the destructor consult the
  // registry of unowned pins (a global lock, kept off the common path).
  std::atomic<bool> ever_unowned_{false};

  MovableTensorBuffer(const MovableTensorBuffer&) = delete;
  void operator=(const MovableTensorBuffer&) = delete;
};

// The functions the runtime calls; a friend of Tensor for access to buf_.
class MovableTensorBufferUtil {
 public:
  // True once a movable allocator is registered in this process.
  static bool Enabled() { return enabled_.load(std::memory_order_relaxed); }

  // The movable root buffer of `t`, or nullptr.
  static MovableTensorBuffer* Get(const Tensor& t);

  // For Tensor's constructors: a movable buffer when `a` is a movable
  // allocator and `type` is a plain-bytes type, else nullptr (the caller then
  // allocates as before).
  static TensorBuffer* MaybeAllocate(Allocator* a, DataType type,
                                     int64_t num_elements,
                                     const AllocationAttributes& attr);

  // For SubBuffer: a slice copies the root's address, so the root stays
  // pinned, in place, for as long as the slice lives; once every slice is gone
  // it may move again. REQUIRES: the root is pinned when sliced (slicing
  // happens while its bytes are used). Every PinRootForSlice is matched by
  // one UnpinRootForSlice when the slice is destroyed.
  static void PinRootForSlice(TensorBuffer* root);
  static void UnpinRootForSlice(TensorBuffer* root);

 private:
  friend bool RegisterMovableAllocator(const Allocator*, MovableAllocator*);
  static std::atomic<bool> enabled_;
};

// Pins the movable buffers of tensors and unpins them on destruction (or on
// Release()). Pinning a tensor whose buffer is not movable is a no-op.
//
// Pin() holds no reference: the caller keeps the tensor alive until Release
// (kernel inputs, which the executor holds; a reference would defeat buffer
// forwarding). PinAndHold() also holds a reference until Release, for tensors
// that the kernel may drop while it runs (elements of a list or array it
// rewrites in place). PinUnowned() is for a buffer the kernel may drop while
// it runs but that must not gain a reference (a resource variable's: kernels
// update it in place only while they hold the only reference, and replace it
// on assignment): the pin is recorded in a registry the buffer's destructor
// consults, so a buffer freed while pinned this way releases the pin itself
// and Release() skips it.
class ScopedTensorPins {
 public:
  ScopedTensorPins() = default;
  ~ScopedTensorPins() { Release(); }
  ScopedTensorPins(ScopedTensorPins&& other) noexcept
      : pinned_(std::move(other.pinned_)),
        held_(std::move(other.held_)),
        unowned_(std::move(other.unowned_)) {
    other.pinned_.clear();
    other.held_.clear();
    other.unowned_.clear();
  }
  ScopedTensorPins& operator=(ScopedTensorPins&& other) noexcept;

  absl::Status Pin(const Tensor& t);
  absl::Status PinAndHold(const Tensor& t);
  absl::Status PinUnowned(const Tensor& t);
  void Release();
  bool empty() const { return pinned_.empty() && unowned_.empty(); }

 private:
  absl::InlinedVector<MovableTensorBuffer*, 4> pinned_;
  absl::InlinedVector<Tensor, 1> held_;  // released after the unpins
  absl::InlinedVector<MovableTensorBuffer*, 2> unowned_;  // see PinUnowned

  ScopedTensorPins(const ScopedTensorPins&) = delete;
  void operator=(const ScopedTensorPins&) = delete;
};

// For callers that hand a tensor's raw device address to code TensorFlow
// cannot track (TFE_TensorHandleDevicePointer, DLPack). Returns once the
// bytes are resident at the tensor's address.
absl::Status MakeTensorUnmovable(const Tensor& t);

// For out-of-memory errors: a sentence suggesting Large Model Support when it
// may avoid the failure, that is, when `a` allocates device memory without
// LMS and `num_bytes` alone fits within its limit; else "".
std::string LargeModelSupportHint(Allocator* a, int64_t num_bytes);

}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_FRAMEWORK_MOVABLE_TENSOR_BUFFER_H_
