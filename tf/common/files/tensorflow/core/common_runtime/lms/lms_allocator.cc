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

#include "tensorflow/core/common_runtime/lms/lms_allocator.h"

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/log/log.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensorflow/core/common_runtime/lms/lms_status.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tflms/engine.h"
#include "tflms/stats.h"
#include "tflms/status.h"
#include "xla/tsl/framework/allocator.h"
#include "xla/tsl/util/env_var.h"

namespace tensorflow {
namespace lms {

namespace {

// The engine hands out 256-byte aligned chunks, as tsl::BFCAllocator does.
constexpr size_t kEngineAlignment = 256;
// tsl::BFCAllocator's kMaxMillisToWait for allocations that allow retry.
constexpr std::chrono::milliseconds kRetryTimeout(10000);
// Allocations that succeeded only after waiting are logged this many times
// per allocator: enough to show which requests wait and why, without a line
// per step in a run that waits every step.
constexpr int kMaxWaitLogs = 3;
// tsl::BFCAllocator's cap on its lines for optional allocations that failed.
constexpr int kMaxOptionalFailureLogs = 10;

tflms::Buffer* AsBuffer(void* handle) {
  return static_cast<tflms::Buffer*>(handle);
}
const tflms::Buffer* AsBuffer(const void* handle) {
  return static_cast<const tflms::Buffer*>(handle);
}

std::vector<tflms::Buffer*> AsBuffers(void* const* handles, size_t n) {
  std::vector<tflms::Buffer*> buffers(n);
  for (size_t i = 0; i < n; ++i) buffers[i] = AsBuffer(handles[i]);
  return buffers;
}

}  // namespace

absl::Status VerifyPinsFromEnv(bool* verify_pins) {
  const char* env = std::getenv("TF_LMS_VERIFY_PINS");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  bool value = *verify_pins;
  if (!tsl::ReadBoolFromEnvVar("TF_LMS_VERIFY_PINS", *verify_pins, &value)
           .ok()) {
    return absl::InvalidArgumentError(
        "TF_LMS_VERIFY_PINS=" + std::string(env) +
        " is not a boolean: set it to true or 1 to check every pin, false or "
        "0 (or leave it unset) not to");
  }
  *verify_pins = value;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LmsAllocator>> LmsAllocator::Create(
    std::unique_ptr<tflms::Device> device,
    const tflms::EngineOptions& engine_options) {
  if (device == nullptr) {
    return absl::InvalidArgumentError("LmsAllocator needs a device");
  }
  tflms::EngineOptions options = engine_options;
  absl::Status verify = VerifyPinsFromEnv(&options.verify_pins);
  if (!verify.ok()) return verify;
  if (options.verify_pins && !engine_options.verify_pins) {
    LOG(WARNING) << "Large Model Support (" << options.name
                 << "): every pin checks that the tensor holds the bytes its "
                    "last unpin left (TF_LMS_VERIFY_PINS). Each check reads "
                    "the tensor and waits for the GPU: for finding a stale "
                    "read, not for training.";
  }
  auto engine = std::make_unique<tflms::Engine>(device.get(), options);
  absl::Status s = ToAbslStatus(engine->Init());
  if (!s.ok()) return s;
  std::unique_ptr<LmsAllocator> allocator(
      new LmsAllocator(std::move(device), std::move(engine), options.name));
  // From here on Tensor's constructors give this allocator's tensors movable
  // buffers.
  if (!RegisterMovableAllocator(allocator.get(), allocator.get())) {
    return absl::ResourceExhaustedError(
        "too many Large Model Support allocators in one process");
  }
  return allocator;
}

LmsAllocator::LmsAllocator(std::unique_ptr<tflms::Device> device,
                           std::unique_ptr<tflms::Engine> engine,
                           std::string name)
    : device_(std::move(device)),
      engine_(std::move(engine)),
      name_(std::move(name)) {}

LmsAllocator::~LmsAllocator() { UnregisterMovableAllocator(this); }

bool LmsAllocator::AlignmentSupported(size_t alignment) const {
  if (alignment <= kEngineAlignment) return true;
  LOG(ERROR) << "Allocator (" << name_ << ") cannot align to " << alignment
             << " bytes; Large Model Support aligns to " << kEngineAlignment;
  return false;
}

void* LmsAllocator::AllocateRaw(size_t alignment, size_t num_bytes) {
  return AllocateRaw(alignment, num_bytes, tsl::AllocationAttributes());
}

void* LmsAllocator::AllocateRaw(size_t alignment, size_t num_bytes,
                                const tsl::AllocationAttributes& attr) {
  if (!AlignmentSupported(alignment)) return nullptr;
  return AllocateWithRetry<void>(num_bytes, attr, "allocate",
                                 [&](tflms::Status* s) {
                                   return engine_->AllocateRaw(num_bytes, s);
                                 });
}

template <typename T, typename Attempt>
T* LmsAllocator::AllocateWithRetry(size_t num_bytes,
                                   const tsl::AllocationAttributes& attr,
                                   const char* what, Attempt attempt) {
  tflms::Status status;
  uint64_t seen = frees_.load();
  T* result = attempt(&status);
  if (result != nullptr) return result;
  // Only memory can come free: any other failure (a device fault, a stale
  // page-in) is the caller's to report.
  if (status.code() != tflms::Code::kResourceExhausted) return nullptr;
  if (!attr.retry_on_failure) {
    // An optional allocation (a scratch space, say): the caller does without
    // it. Said the first few times, as tsl::BFCAllocator says it.
    if (optional_failure_logs_.fetch_add(1) < kMaxOptionalFailureLogs) {
      LOG(WARNING) << "Allocator (" << name_ << ") ran out of memory trying "
                   << "to " << what << " " << num_bytes << " bytes. The caller "
                   << "indicates that this is not a failure, but this may "
                   << "mean that there could be performance gains if more "
                   << "memory were available: " << status.message();
    }
    return nullptr;
  }
  if (num_bytes <= engine_->options().memory_limit) {
    // Only then can anything other threads free make room for it.
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + kRetryTimeout;
    // Why the first attempt failed: the engine's message names what held
    // the memory, which a later successful attempt no longer says.
    const std::string first_failure = status.message();
    {
      std::unique_lock<std::mutex> lock(retry_mu_);
      ++waiters_;
      while (result == nullptr &&
             status.code() == tflms::Code::kResourceExhausted) {
        if (!retry_cv_.wait_until(lock, deadline,
                                  [&] { return frees_.load() != seen; })) {
          break;  // timed out; status holds the last failure
        }
        seen = frees_.load();
        lock.unlock();
        result = attempt(&status);
        lock.lock();
      }
      --waiters_;
    }
    if (result != nullptr) {
      // TensorFlow's BFC allocator waits the same way without a word; with
      // LMS a wait means tensors in use (pinned by running kernels, or by
      // producers whose consumers have not run) held the memory, which no
      // reclaim can move: the kernel stalled instead of failing.
      if (wait_logs_.fetch_add(1) < kMaxWaitLogs) {
        const auto waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::steady_clock::now() - start);
        LOG(WARNING) << "Allocator (" << name_ << ") could " << what << " "
                     << num_bytes << " bytes only after waiting "
                     << waited.count()
                     << " ms for other threads to free or unpin memory; the "
                     << "first attempt failed: " << first_failure;
      }
      return result;
    }
  }
  if (status.code() == tflms::Code::kResourceExhausted) {
    LOG(WARNING) << "Allocator (" << name_ << ") ran out of memory trying to "
                 << what << " " << num_bytes
                 << " bytes: " << status.message();
  }
  return nullptr;
}

void LmsAllocator::NotifyFreed() {
  frees_.fetch_add(1);
  if (waiters_.load() > 0) {
    std::lock_guard<std::mutex> lock(retry_mu_);
    retry_cv_.notify_all();
  }
}

void LmsAllocator::DeallocateRaw(void* ptr) {
  if (ptr == nullptr) return;
  engine_->DeallocateRaw(ptr);
  NotifyFreed();
}

size_t LmsAllocator::RequestedSize(const void* ptr) const {
  return engine_->RequestedSize(ptr);
}

size_t LmsAllocator::AllocatedSize(const void* ptr) const {
  return engine_->AllocatedSize(ptr);
}

std::optional<tsl::AllocatorStats> LmsAllocator::GetStats() {
  const tflms::EngineStats e = engine_->GetStats();
  tsl::AllocatorStats s;
  s.num_allocs = e.num_allocs;
  s.bytes_in_use = e.bytes_in_use;
  s.peak_bytes_in_use = e.peak_bytes_in_use;
  s.largest_alloc_size = e.largest_alloc_size;
  s.bytes_limit = e.bytes_limit;
  s.bytes_reserved = e.bytes_reserved;
  s.peak_bytes_reserved = e.peak_bytes_reserved;
  s.bytes_reservable_limit = e.bytes_reservable_limit;
  size_t largest_free = 0;
  size_t total_free = 0;
  engine_->GetFreeSpace(&largest_free, &total_free);
  s.largest_free_block_bytes = static_cast<int64_t>(largest_free);
  s.pool_bytes = e.bytes_reserved;
  s.peak_pool_bytes = e.peak_bytes_reserved;
  return s;
}

bool LmsAllocator::ClearStats() {
  engine_->ClearStats();
  return true;
}

tflms::EngineStats LmsAllocator::GetLmsStats() const {
  return engine_->GetStats();
}

absl::Status LmsAllocator::SetLmsLimit(size_t bytes) {
  return ToAbslStatus(engine_->SetLmsLimit(bytes));
}

absl::StatusOr<size_t> LmsAllocator::ReclaimInactive() {
  size_t bytes = 0;
  absl::Status s = ToAbslStatus(engine_->ReclaimInactive(&bytes));
  if (!s.ok()) return s;
  return bytes;
}

absl::StatusOr<size_t> LmsAllocator::Defragment() {
  size_t bytes = 0;
  absl::Status s = ToAbslStatus(engine_->Defragment(&bytes));
  if (!s.ok()) return s;
  return bytes;
}

void* LmsAllocator::AllocateMovable(size_t alignment, size_t num_bytes,
                                    const tsl::AllocationAttributes& attr,
                                    void** data) {
  *data = nullptr;
  if (!AlignmentSupported(alignment)) return nullptr;
  // Allocated pinned: its creator holds it until the first consumer unpins.
  return AllocateWithRetry<tflms::Buffer>(
      num_bytes, attr, "allocate", [&](tflms::Status* s) {
        return engine_->AllocateBuffer(num_bytes, /*pinned=*/true, s, data);
      });
}

void LmsAllocator::DeallocateMovable(void* handle) {
  // The engine refuses to free a pinned buffer, and says so: that would be a
  // pin site that outlived its tensor, never something to paper over here.
  tflms::Status s = engine_->FreeBuffer(AsBuffer(handle));
  if (!s.ok()) {
    LOG(ERROR) << "Allocator (" << name_
               << ") freeing a buffer: " << s.ToString();
  }
  NotifyFreed();
}

absl::Status LmsAllocator::PinMovable(void* handle, void** data) {
  return PageInWithRetry(handle, data, [&](void** d) {
    return engine_->Pin(AsBuffer(handle), d);
  });
}

template <typename Attempt>
absl::Status LmsAllocator::PageInWithRetry(void* handle, void** data,
                                           Attempt attempt) {
  // Paging a tensor back in is an allocation: it waits for other threads'
  // frees and unpins as one does, where failing at once would fail a kernel
  // that TensorFlow without LMS would have run (its memory was held only by
  // kernels running beside it).
  tflms::Status last = attempt(data);
  if (last.code() != tflms::Code::kResourceExhausted) {
    return ToAbslStatus(last);  // the common case costs no size lookup
  }
  void* ptr = AllocateWithRetry<void>(
      engine_->BufferSize(AsBuffer(handle)), tsl::AllocationAttributes(),
      "page in", [&](tflms::Status* s) -> void* {
        void* d = nullptr;
        *s = attempt(&d);
        last = *s;
        return s->ok() ? d : nullptr;
      });
  if (ptr == nullptr) return ToAbslStatus(last);
  *data = ptr;
  return absl::OkStatus();
}

bool LmsAllocator::LearnsStepOrder() const {
  return engine_->options().prefetch_enabled;
}

void LmsAllocator::NoteStepId(int64_t step_id) {
  // Every kernel's: the engine keeps it for the calling thread without a
  // lock. Passing on only changes of one id shared by all threads lost ids
  // where two threads' kernels interleaved (engine.h).
  engine_->NoteStepId(step_id);
}

void LmsAllocator::NoteAllocationSite(uint64_t site) {
  engine_->NoteAllocationSite(site);
}

void LmsAllocator::GatherMovable(void* const* handles, size_t n) {
  // Most kernels that read a list read a few elements: those cost no lock.
  if (n < tflms::Engine::kMinGatherGroup) return;
  engine_->GatherForPins(AsBuffers(handles, n).data(), n);
}

void LmsAllocator::GatherMovableForConcat(void* const* handles, size_t n) {
  // The engine returns before its lock for a group of one.
  engine_->GatherForConcat(AsBuffers(handles, n).data(), n);
}

void LmsAllocator::UnpinMovable(void* handle) {
  tflms::Status s = engine_->Unpin(AsBuffer(handle));
  if (!s.ok()) {
    LOG(ERROR) << "Allocator (" << name_
               << ") unpinning a buffer: " << s.ToString();
  }
  NotifyFreed();  // an unpinned buffer can be moved out of the way
}

absl::Status LmsAllocator::MakeUnmovable(void* handle, void** data) {
  return PageInWithRetry(handle, data, [&](void** d) {
    return engine_->MarkUnmovable(AsBuffer(handle), d);
  });
}

size_t LmsAllocator::MovableSize(const void* handle) const {
  return engine_->BufferSize(AsBuffer(handle));
}

}  // namespace lms
}  // namespace tensorflow
