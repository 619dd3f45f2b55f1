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

// The Large Model Support allocator: the LMS engine (gpu/lms/core) as a
// tsl::Allocator, over any tflms::Device. On a GPU it takes the place of
// GPUBFCAllocator when GPUOptions.experimental.lms_enabled is set, over a
// StreamExecutor device (gpu/lms/stream_executor_lms_device.h); the CPU test
// harness runs the same class over the engine's simulated device.
//
// AllocateRaw serves workspaces and anything else without a tensor buffer:
// those never move. Tensor buffers come through the MovableAllocator
// interface (framework/movable_tensor_buffer.h) and may be paged out to host
// memory, paged back in and moved while unpinned; see docs in engine.h.
// The allocator registers itself as movable on creation and unregisters
// before it is destroyed.
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_ALLOCATOR_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_ALLOCATOR_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensorflow/core/framework/movable_tensor_buffer.h"
#include "tflms/device.h"
#include "tflms/engine.h"
#include "tflms/stats.h"
#include "xla/tsl/framework/allocator.h"

namespace tensorflow {
namespace lms {

// The smallest nonzero LMS limit: the engine's allocation granularity.
inline constexpr int64_t kMinLmsLimit = 256;

// TF_LMS_VERIFY_PINS, when set, overrides *verify_pins (EngineOptions): true
// or 1 checks at every pin that a tensor holds the bytes its last unpin left
// (slow; for finding a stale read on a GPU), false or 0 does not. An error
// names any other value.
absl::Status VerifyPinsFromEnv(bool* verify_pins);

class LmsAllocator : public tsl::Allocator, public MovableAllocator {
 public:
  // `options.name` names the allocator in logs and statistics. The
  // environment may turn options.verify_pins on (VerifyPinsFromEnv).
  static absl::StatusOr<std::unique_ptr<LmsAllocator>> Create(
      std::unique_ptr<tflms::Device> device,
      const tflms::EngineOptions& options);
  ~LmsAllocator() override;

  LmsAllocator(const LmsAllocator&) = delete;
  void operator=(const LmsAllocator&) = delete;

  // tsl::Allocator
  std::string Name() override { return name_; }
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  void* AllocateRaw(size_t alignment, size_t num_bytes,
                    const tsl::AllocationAttributes& attr) override;
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return true; }
  size_t RequestedSize(const void* ptr) const override;
  size_t AllocatedSize(const void* ptr) const override;
  std::optional<tsl::AllocatorStats> GetStats() override;
  // tf.config.experimental.reset_memory_stats: peaks restart from the current
  // values and cumulative counters from zero (tflms::Engine::ClearStats).
  bool ClearStats() override;
  tsl::AllocatorMemoryType GetMemoryType() const override {
    return tsl::AllocatorMemoryType::kDevice;
  }
  // TensorFlow passes the platform stream handle here; on a GPU, LMS needs
  // the se::Stream and gets it from lms::AttachComputeStream instead.
  void SetStreamAndPreallocateMemory(void* stream) override {}

  // MovableAllocator
  void* AllocateMovable(size_t alignment, size_t num_bytes,
                        const tsl::AllocationAttributes& attr,
                        void** data) override;
  void DeallocateMovable(void* handle) override;
  absl::Status PinMovable(void* handle, void** data) override;
  void UnpinMovable(void* handle) override;
  absl::Status MakeUnmovable(void* handle, void** data) override;
  size_t MovableSize(const void* handle) const override;
  bool LearnsStepOrder() const override;
  void NoteStepId(int64_t step_id) override;
  void NoteAllocationSite(uint64_t site) override;
  void GatherMovable(void* const* handles, size_t n) override;
  void GatherMovableForConcat(void* const* handles, size_t n) override;

  // Every engine counter (statistics for tf.experimental.get_lms_*).
  tflms::EngineStats GetLmsStats() const;
  // Reclaim once `bytes` of device memory are in use (0: the whole memory
  // limit). InvalidArgument above the memory limit or below 256 bytes.
  absl::Status SetLmsLimit(size_t bytes);
  // Moves every inactive tensor to host memory now; returns the bytes moved.
  absl::StatusOr<size_t> ReclaimInactive();
  // Compacts device memory now; returns the bytes moved.
  absl::StatusOr<size_t> Defragment();
  // The device the engine runs on (owned by this allocator).
  tflms::Device* device() const { return device_.get(); }

 private:
  LmsAllocator(std::unique_ptr<tflms::Device> device,
               std::unique_ptr<tflms::Engine> engine, std::string name);
  bool AlignmentSupported(size_t alignment) const;
  // What tsl::BFCAllocator does: an allocation that allows retry waits,
  // after the engine's reclaim ladder failed, up to kRetryTimeout for other
  // threads to free or unpin memory, retrying after each; one that does not
  // fails at once. Logs what ran out of memory ("allocate" or "page in"
  // `num_bytes`), and an allocation that had to wait.
  template <typename T, typename Attempt>
  T* AllocateWithRetry(size_t num_bytes, const tsl::AllocationAttributes& attr,
                       const char* what, Attempt attempt);
  // A pin or MakeUnmovable, which may page the buffer in: retried as an
  // allocation that allows retry. `attempt(void** data)` returns its status.
  template <typename Attempt>
  absl::Status PageInWithRetry(void* handle, void** data, Attempt attempt);
  // Memory was freed or became movable: wake waiting allocations.
  void NotifyFreed();

  // Declared before engine_: the engine uses the device until destroyed.
  const std::unique_ptr<tflms::Device> device_;
  const std::unique_ptr<tflms::Engine> engine_;
  const std::string name_;

  // Retry: frees_ counts frees and unpins; waiters_ lets them skip the lock
  // when nobody waits. retry_mu_ guards nothing but the condition wait.
  std::atomic<uint64_t> frees_{0};
  std::atomic<int> waiters_{0};
  std::mutex retry_mu_;
  std::condition_variable retry_cv_;
  // Lines logged so far, counted to cap them: allocations that succeeded
  // after waiting, and optional ones that failed.
  std::atomic<int> wait_logs_{0};
  std::atomic<int> optional_failure_logs_{0};
};

}  // namespace lms
}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_LMS_LMS_ALLOCATOR_H_
