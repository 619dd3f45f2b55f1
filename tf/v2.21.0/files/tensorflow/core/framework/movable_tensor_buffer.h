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
// An allocator that implements tsl::MovableAllocator (the LMS GPU allocator)
// may page a buffer out to host memory, page it back in at another address,
// or move it within device memory, whenever the buffer is not pinned. Code
// that reads or writes a tensor's bytes therefore pins it first and unpins it
// when the access (including GPU work it enqueued) no longer needs the
// address. The pin sites are few and fixed: the GPU device around every
// kernel (inputs), the GPU device context around every copy, and the C API
// when a raw device pointer escapes (which makes the buffer unmovable).
//
// A new buffer starts pinned by its creator (the kernel that writes it, or a
// copy that fills it). That creation pin is released by the first unpin from
// a pin site, that is, once a consumer has finished with the buffer; until
// then the buffer never moves, whoever holds its address.
//
// Buffers that other code reaches without going through a pin site stay put:
//   * a slice (Tensor::Slice, SubSlice) keeps its own copy of the address, so
//     slicing makes the root buffer unmovable;
//   * a resource variable's buffer is read by kernels through the variable,
//     not as an input, so Var::tensor() makes it unmovable.
//
// With no movable allocator in the process (LMS off) every function here
// returns after one relaxed atomic load.
#ifndef TENSORFLOW_CORE_FRAMEWORK_MOVABLE_TENSOR_BUFFER_H_
#define TENSORFLOW_CORE_FRAMEWORK_MOVABLE_TENSOR_BUFFER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/platform/macros.h"

namespace tensorflow {

// A root tensor buffer allocated from a tsl::MovableAllocator.
class MovableTensorBuffer : public TensorBuffer {
 public:
  // Returns a buffer of `num_bytes`, pinned by its creator; data() is nullptr
  // when the allocator could not provide the memory.
  static MovableTensorBuffer* Allocate(Allocator* allocator,
                                       tsl::MovableAllocator* movable,
                                       size_t num_bytes,
                                       const AllocationAttributes& attr);

  // Makes the buffer resident and keeps it at data() until Unpin().
  absl::Status Pin();
  void Unpin();
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
  MovableTensorBuffer* AsMovable() override { return this; }

 private:
  MovableTensorBuffer(Allocator* allocator, tsl::MovableAllocator* movable,
                      void* handle, void* data, size_t num_bytes);
  ~MovableTensorBuffer() override;

  Allocator* const allocator_;
  tsl::MovableAllocator* const movable_;
  void* const handle_;  // nullptr when the allocation failed
  const size_t num_bytes_;
  std::atomic<bool> creation_pin_;
  std::atomic<bool> unmovable_{false};

  MovableTensorBuffer(const MovableTensorBuffer&) = delete;
  void operator=(const MovableTensorBuffer&) = delete;
};

// The functions the runtime calls; a friend of Tensor for access to buf_.
class MovableTensorBufferUtil {
 public:
  // True once a movable allocator exists in this process.
  static bool Enabled() { return enabled_.load(std::memory_order_relaxed); }
  // Called by a movable allocator when it is created.
  static void Enable() { enabled_.store(true, std::memory_order_relaxed); }

  // The movable root buffer of `t`, or nullptr.
  static MovableTensorBuffer* Get(const Tensor& t);

  // For Tensor's constructors: a movable buffer when `a` is a movable
  // allocator and `type` is a plain-bytes type, else nullptr (the caller then
  // allocates as before).
  static TensorBuffer* MaybeAllocate(Allocator* a, DataType type,
                                     int64_t num_elements,
                                     const AllocationAttributes& attr);

  // For SubBuffer: a slice copies the root's address, so the root must stay.
  // REQUIRES: the root is pinned (slicing happens while its bytes are used).
  static void KeepRootInPlace(TensorBuffer* root);

  // For Var::tensor(): the buffer stays where it is from now on.
  static void KeepInPlace(const Tensor& t) {
    if (TF_PREDICT_FALSE(Enabled())) KeepInPlaceSlow(t);
  }

 private:
  static void KeepInPlaceSlow(const Tensor& t);
  static std::atomic<bool> enabled_;
};

// Pins the movable buffers of tensors and unpins them on destruction (or on
// Release()). Pinning a tensor whose buffer is not movable is a no-op.
class ScopedTensorPins {
 public:
  ScopedTensorPins() = default;
  ~ScopedTensorPins() { Release(); }
  ScopedTensorPins(ScopedTensorPins&& other) noexcept
      : pinned_(std::move(other.pinned_)) {
    other.pinned_.clear();
  }
  ScopedTensorPins& operator=(ScopedTensorPins&& other) noexcept;

  absl::Status Pin(const Tensor& t);
  void Release();
  bool empty() const { return pinned_.empty(); }

 private:
  // Each entry holds a reference, so a buffer outlives its pin.
  absl::InlinedVector<MovableTensorBuffer*, 4> pinned_;

  ScopedTensorPins(const ScopedTensorPins&) = delete;
  void operator=(const ScopedTensorPins&) = delete;
};

// For callers that hand a tensor's raw device address to code TensorFlow
// cannot track (TFE_TensorHandleDevicePointer, DLPack).
absl::Status MakeTensorUnmovable(const Tensor& t);

// For out-of-memory errors: a sentence suggesting Large Model Support when it
// may avoid the failure, that is, when `a` allocates device memory without
// LMS and `num_bytes` alone fits within its limit; else "".
std::string LargeModelSupportHint(Allocator* a, int64_t num_bytes);

}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_FRAMEWORK_MOVABLE_TENSOR_BUFFER_H_
