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

#include "tensorflow/core/framework/movable_tensor_buffer.h"

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>

#include "absl/base/const_init.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/logging.h"

namespace tensorflow {
namespace {

// The registry of movable allocators: one entry per LMS device, written when
// the device's allocator is created. Lookups (every tensor allocation with
// LMS on) scan the live prefix without a lock; registration is rare and
// takes a free slot with a compare-and-swap.
constexpr int kMaxMovableAllocators = 64;
struct RegistryEntry {
  std::atomic<const Allocator*> allocator{nullptr};
  std::atomic<MovableAllocator*> movable{nullptr};
};
std::array<RegistryEntry, kMaxMovableAllocators> registry;
// One past the highest slot ever used.
std::atomic<int> registry_end{0};

// Outstanding PinUnowned pins per buffer. A buffer in this map is alive: its
// destructor takes its entry out (under the lock) before the memory goes.
// Only pins of resource variables' buffers come here, a few per kernel.
absl::Mutex unowned_mu(absl::kConstInit);
absl::flat_hash_map<const MovableTensorBuffer*, int>& UnownedPins()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(unowned_mu) {
  static auto* pins = new absl::flat_hash_map<const MovableTensorBuffer*, int>;
  return *pins;
}

// This thread's innermost KernelCreationScope (its id; 0 outside kernels)
// and how many movable buffers it has allocated within scopes.
struct ThreadCreations {
  uintptr_t scope = 0;
  int64_t created = 0;
};
thread_local ThreadCreations thread_creations;

}  // namespace

std::atomic<bool> MovableTensorBufferUtil::enabled_{false};

KernelCreationScope::KernelCreationScope()
    : outer_(thread_creations.scope),
      created_before_(thread_creations.created) {
  thread_creations.scope = id();
}

KernelCreationScope::~KernelCreationScope() {
  thread_creations.scope = outer_;
}

bool KernelCreationScope::created_any() const {
  return thread_creations.created != created_before_;
}

bool RegisterMovableAllocator(const Allocator* allocator,
                              MovableAllocator* movable) {
  for (int i = 0; i < kMaxMovableAllocators; ++i) {
    const Allocator* expected = nullptr;
    if (!registry[i].allocator.compare_exchange_strong(
            expected, allocator, std::memory_order_acq_rel)) {
      continue;
    }
    registry[i].movable.store(movable, std::memory_order_release);
    int end = registry_end.load(std::memory_order_relaxed);
    while (end < i + 1 && !registry_end.compare_exchange_weak(
                              end, i + 1, std::memory_order_acq_rel)) {
    }
    // From here on Tensor's constructors look for movable allocators.
    MovableTensorBufferUtil::enabled_.store(true, std::memory_order_relaxed);
    return true;
  }
  return false;
}

void UnregisterMovableAllocator(const Allocator* allocator) {
  const int end = registry_end.load(std::memory_order_acquire);
  for (int i = 0; i < end; ++i) {
    if (registry[i].allocator.load(std::memory_order_acquire) == allocator) {
      registry[i].movable.store(nullptr, std::memory_order_release);
      registry[i].allocator.store(nullptr, std::memory_order_release);
    }
  }
}

MovableAllocator* FindMovableAllocator(const Allocator* allocator) {
  if (allocator == nullptr) return nullptr;
  const int end = registry_end.load(std::memory_order_acquire);
  for (int i = 0; i < end; ++i) {
    if (registry[i].allocator.load(std::memory_order_acquire) == allocator) {
      return registry[i].movable.load(std::memory_order_acquire);
    }
  }
  return nullptr;
}

MovableTensorBuffer* MovableTensorBuffer::Allocate(
    Allocator* allocator, MovableAllocator* movable, size_t num_bytes,
    const AllocationAttributes& attr) {
  void* data = nullptr;
  void* handle = movable->AllocateMovable(Allocator::kAllocatorAlignment,
                                          num_bytes, attr, &data);
  if (handle == nullptr) data = nullptr;
  const uintptr_t creator = thread_creations.scope;
  if (creator != 0) ++thread_creations.created;
  return new MovableTensorBuffer(allocator, movable, handle, data, num_bytes,
                                 creator);
}

MovableTensorBuffer* MovableTensorBuffer::FromBuffer(TensorBuffer* buffer) {
#if defined(__GXX_RTTI) || defined(_CPPRTTI)
  // The class is final and its type_info is emitted once, with its key
  // function below, so this is a comparison of two type_info objects.
  if (buffer != nullptr && typeid(*buffer) == typeid(MovableTensorBuffer)) {
    return static_cast<MovableTensorBuffer*>(buffer);
  }
#endif
  // Without RTTI no movable buffer is ever created (see MaybeAllocate).
  return nullptr;
}

template <typename Gather>
void MovableTensorBuffer::GatherHandles(
    absl::Span<MovableTensorBuffer* const> group, Gather gather) {
  absl::InlinedVector<void*, 32> handles;
  MovableAllocator* movable = nullptr;
  for (MovableTensorBuffer* m : group) {
    if (m == nullptr || m->handle_ == nullptr) continue;
    if (movable == nullptr) movable = m->movable_;
    if (m->movable_ == movable) handles.push_back(m->handle_);
  }
  if (movable != nullptr) gather(movable, handles.data(), handles.size());
}

void MovableTensorBuffer::GatherForPins(
    absl::Span<MovableTensorBuffer* const> group) {
  GatherHandles(group, [](MovableAllocator* a, void* const* h, size_t n) {
    a->GatherMovable(h, n);
  });
}

void MovableTensorBuffer::GatherForConcat(
    absl::Span<MovableTensorBuffer* const> group) {
  GatherHandles(group, [](MovableAllocator* a, void* const* h, size_t n) {
    a->GatherMovableForConcat(h, n);
  });
}

MovableTensorBuffer::MovableTensorBuffer(Allocator* allocator,
                                         MovableAllocator* movable,
                                         void* handle, void* data,
                                         size_t num_bytes, uintptr_t creator)
    : TensorBuffer(data),
      allocator_(allocator),
      movable_(movable),
      handle_(handle),
      num_bytes_(num_bytes),
      creator_(creator),
      creation_pin_(handle != nullptr) {}

MovableTensorBuffer::~MovableTensorBuffer() {
  if (handle_ == nullptr) return;
  // A kernel replaced a variable's buffer it had pinned (PinUnowned): those
  // pins end here, and the pinner's Release will find the buffer gone.
  int unowned = 0;
  if (ever_unowned_.load(std::memory_order_acquire)) {
    absl::MutexLock lock(&unowned_mu);
    auto it = UnownedPins().find(this);
    if (it != UnownedPins().end()) {
      unowned = it->second;
      UnownedPins().erase(it);
    }
  }
  for (int i = 0; i < unowned; ++i) movable_->UnpinMovable(handle_);
  // Freed before any consumer released the creator's pin (temporaries,
  // outputs nobody reads): the allocator frees only unpinned buffers.
  if (creation_pin_.exchange(false, std::memory_order_acq_rel)) {
    movable_->UnpinMovable(handle_);
  }
  movable_->DeallocateMovable(handle_);
}

absl::Status MovableTensorBuffer::Pin() {
  if (handle_ == nullptr) return absl::OkStatus();
  void* data = nullptr;
  absl::Status s = movable_->PinMovable(handle_, &data);
  if (!s.ok()) return s;
  // Every pinner of the same buffer stores the same address: while any pin
  // is held the allocator does not move the buffer.
  set_data(data);
  return absl::OkStatus();
}

void MovableTensorBuffer::Unpin() {
  if (handle_ == nullptr) return;
  movable_->UnpinMovable(handle_);
  // The first consumer is done: the creator's claim on the address ends.
  if (creation_pin_.exchange(false, std::memory_order_acq_rel)) {
    movable_->UnpinMovable(handle_);
  }
}

void MovableTensorBuffer::UnpinForSlice() {
  if (handle_ != nullptr) movable_->UnpinMovable(handle_);
}

void MovableTensorBuffer::ReleaseCreationPin() {
  if (handle_ == nullptr) return;
  if (creation_pin_.exchange(false, std::memory_order_acq_rel)) {
    movable_->UnpinMovable(handle_);
  }
}

void MovableTensorBuffer::ReleaseCreationPinIfCreatedIn(
    const KernelCreationScope& scope) {
  if (creator_ == scope.id()) ReleaseCreationPin();
}

absl::Status MovableTensorBuffer::PinUnowned() {
  // Pinned first, without the registry's lock: a page-in may block.
  absl::Status s = Pin();
  if (!s.ok()) return s;
  absl::MutexLock lock(&unowned_mu);
  ever_unowned_.store(true, std::memory_order_release);
  ++UnownedPins()[this];
  return absl::OkStatus();
}

void MovableTensorBuffer::UnpinUnowned(MovableTensorBuffer* buffer) {
  absl::MutexLock lock(&unowned_mu);
  auto it = UnownedPins().find(buffer);
  if (it == UnownedPins().end()) return;  // destroyed; it released the pin
  if (--it->second == 0) UnownedPins().erase(it);
  // Alive: its destructor waits for this lock before it frees anything.
  buffer->Unpin();
}

absl::Status MovableTensorBuffer::MakeUnmovable() {
  if (handle_ == nullptr || unmovable()) return absl::OkStatus();
  void* data = nullptr;
  absl::Status s = movable_->MakeUnmovable(handle_, &data);
  if (!s.ok()) return s;
  set_data(data);
  unmovable_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

void MovableTensorBuffer::FillAllocationDescription(
    AllocationDescription* proto) const {
  proto->set_requested_bytes(static_cast<int64_t>(num_bytes_));
  proto->set_allocator_name(allocator_->Name());
  if (handle_ != nullptr) {
    proto->set_allocated_bytes(
        static_cast<int64_t>(movable_->MovableSize(handle_)));
  }
  proto->set_ptr(reinterpret_cast<uintptr_t>(data()));
  if (RefCountIsOne()) proto->set_has_single_reference(true);
}

bool MovableTensorBuffer::GetAllocatedBytes(size_t* out_bytes) const {
  if (handle_ == nullptr) return false;
  *out_bytes = movable_->MovableSize(handle_);
  return true;
}

MovableTensorBuffer* MovableTensorBufferUtil::Get(const Tensor& t) {
  if (!Enabled() || t.buf_ == nullptr) return nullptr;
  return MovableTensorBuffer::FromBuffer(t.buf_->root_buffer());
}

TensorBuffer* MovableTensorBufferUtil::MaybeAllocate(
    Allocator* a, DataType type, int64_t num_elements,
    const AllocationAttributes& attr) {
  if (!Enabled() || num_elements <= 0) return nullptr;
#if !defined(__GXX_RTTI) && !defined(_CPPRTTI)
  return nullptr;  // FromBuffer could not recognize the buffer.
#endif
  // Only types whose bytes are their value may move: strings, variants and
  // resource handles hold host pointers and run constructors.
  if (!DataTypeCanUseMemcpy(type)) return nullptr;
  MovableAllocator* movable = FindMovableAllocator(a);
  if (movable == nullptr) return nullptr;
  const size_t num_bytes =
      static_cast<size_t>(num_elements) * DataTypeSize(type);
  return MovableTensorBuffer::Allocate(a, movable, num_bytes, attr);
}

void MovableTensorBufferUtil::PinRootForSlice(TensorBuffer* root) {
  if (!Enabled()) return;
  MovableTensorBuffer* m = MovableTensorBuffer::FromBuffer(root);
  if (m == nullptr) return;
  absl::Status s = m->PinForSlice();
  // The root is pinned by whoever slices it, so it is resident and this
  // cannot fail for want of memory; if it did, the slice would alias memory
  // that may move, which is worse than stopping here.
  CHECK(s.ok()) << "Large Model Support: a sliced tensor's buffer could not "
                << "be kept in place: " << s;  // Crash OK
}

void MovableTensorBufferUtil::UnpinRootForSlice(TensorBuffer* root) {
  // A movable root implies Enabled(), which never turns false again.
  if (!Enabled()) return;
  MovableTensorBuffer* m = MovableTensorBuffer::FromBuffer(root);
  if (m != nullptr) m->UnpinForSlice();
}

ScopedTensorPins& ScopedTensorPins::operator=(
    ScopedTensorPins&& other) noexcept {
  if (this != &other) {
    Release();
    pinned_ = std::move(other.pinned_);
    held_ = std::move(other.held_);
    unowned_ = std::move(other.unowned_);
    other.pinned_.clear();
    other.held_.clear();
    other.unowned_.clear();
  }
  return *this;
}

absl::Status ScopedTensorPins::Pin(const Tensor& t) {
  MovableTensorBuffer* m = MovableTensorBufferUtil::Get(t);
  if (m == nullptr) return absl::OkStatus();
  absl::Status s = m->Pin();
  if (!s.ok()) return s;
  pinned_.push_back(m);
  return absl::OkStatus();
}

absl::Status ScopedTensorPins::PinAndHold(const Tensor& t) {
  MovableTensorBuffer* m = MovableTensorBufferUtil::Get(t);
  if (m == nullptr) return absl::OkStatus();
  absl::Status s = m->Pin();
  if (!s.ok()) return s;
  pinned_.push_back(m);
  held_.push_back(t);
  return absl::OkStatus();
}

absl::Status ScopedTensorPins::PinUnowned(const Tensor& t) {
  MovableTensorBuffer* m = MovableTensorBufferUtil::Get(t);
  if (m == nullptr) return absl::OkStatus();
  absl::Status s = m->PinUnowned();
  if (!s.ok()) return s;
  unowned_.push_back(m);
  return absl::OkStatus();
}

void ScopedTensorPins::Release() {
  for (MovableTensorBuffer* m : pinned_) m->Unpin();
  for (MovableTensorBuffer* m : unowned_) MovableTensorBuffer::UnpinUnowned(m);
  pinned_.clear();
  unowned_.clear();
  held_.clear();
}

absl::Status MakeTensorUnmovable(const Tensor& t) {
  MovableTensorBuffer* m = MovableTensorBufferUtil::Get(t);
  if (m == nullptr) return absl::OkStatus();
  return m->MakeUnmovable();
}

std::string LargeModelSupportHint(Allocator* a, int64_t num_bytes) {
  if (a == nullptr || FindMovableAllocator(a) != nullptr ||
      a->GetMemoryType() != AllocatorMemoryType::kDevice) {
    return "";
  }
  std::optional<AllocatorStats> stats = a->GetStats();
  if (stats.has_value() && stats->bytes_limit.has_value() &&
      num_bytes > *stats->bytes_limit) {
    return "";  // Larger than the whole GPU: moving other tensors cannot help.
  }
  return "\nHint: Large Model Support may avoid this error. It lets tensors "
         "that no running op uses move to host memory: call "
         "tf.config.experimental.set_lms_enabled(True) before the GPU is first "
         "used, or set GPUOptions.experimental.lms_enabled.";
}

}  // namespace tensorflow
