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

#include "tensorflow/core/common_runtime/gpu/lms/lms_stats.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/gpu/gpu_process_state.h"
#include "tensorflow/core/common_runtime/lms/lms_allocator.h"
#include "tensorflow/core/common_runtime/gpu/lms/lms_gpu_allocator.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tflms/stats.h"
#include "xla/tsl/framework/allocator.h"

namespace tensorflow {

namespace {

absl::StatusOr<lms::LmsAllocator*> RequireLmsAllocator(int tf_gpu_id) {
  lms::LmsAllocator* allocator = lms::FindLmsAllocator(tf_gpu_id);
  if (allocator == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "GPU ", tf_gpu_id,
        " has no Large Model Support allocator: enable LMS "
        "(tf.config.experimental.set_lms_enabled(True) or "
        "GPUOptions.experimental.lms_enabled) before the GPU is first used"));
  }
  return allocator;
}

}  // namespace

absl::StatusOr<tflms::EngineStats> GetLmsStats(int tf_gpu_id) {
  absl::StatusOr<lms::LmsAllocator*> allocator = RequireLmsAllocator(tf_gpu_id);
  if (!allocator.ok()) return allocator.status();
  return (*allocator)->GetLmsStats();
}

absl::Status SetLmsLimit(int tf_gpu_id, int64_t bytes) {
  if (bytes < 0 || (bytes > 0 && bytes < lms::kMinLmsLimit)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the LMS limit must be 0 (the whole device) or at least ",
                     lms::kMinLmsLimit, " bytes, got ", bytes));
  }
  absl::StatusOr<lms::LmsAllocator*> allocator = RequireLmsAllocator(tf_gpu_id);
  if (!allocator.ok()) return allocator.status();
  const int64_t device_limit = (*allocator)->GetLmsStats().bytes_limit;
  // One value serves GPUs of different sizes; above this one's limit it
  // means all of it.
  if (bytes >= device_limit) bytes = 0;
  return (*allocator)->SetLmsLimit(static_cast<size_t>(bytes));
}

absl::StatusOr<int64_t> ReclaimInactive(int tf_gpu_id) {
  absl::StatusOr<lms::LmsAllocator*> allocator = RequireLmsAllocator(tf_gpu_id);
  if (!allocator.ok()) return allocator.status();
  absl::StatusOr<size_t> bytes = (*allocator)->ReclaimInactive();
  if (!bytes.ok()) return bytes.status();
  return static_cast<int64_t>(*bytes);
}

absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> GetLmsStatsItems(
    int tf_gpu_id) {
  absl::StatusOr<tflms::EngineStats> stats = GetLmsStats(tf_gpu_id);
  if (!stats.ok()) return stats.status();
  return stats->Items();
}

absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> GetGpuHostStats(
    int numa_node) {
  if (numa_node < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("numa_node must be >= 0, got ", numa_node));
  }
  GPUProcessState* state = GPUProcessState::singleton();
  if (!state->HasGPUDevice()) {
    return absl::NotFoundError(
        "no GPU device has been created, so there is no GPU host allocator");
  }
  // The options are read only by the call that creates the allocator; by now
  // the GPU device has created it with the session's options.
  tsl::Allocator* host = state->GetGpuHostAllocator(GPUOptions(), numa_node);
  std::optional<tsl::AllocatorStats> s =
      host == nullptr ? std::nullopt : host->GetStats();
  if (!s.has_value()) {
    return absl::UnavailableError(
        absl::StrCat("the GPU host allocator of NUMA node ", numa_node,
                     " keeps no statistics"));
  }
  return std::vector<std::pair<std::string, int64_t>>{
      {"bytes_in_use", s->bytes_in_use},
      {"peak_bytes_in_use", s->peak_bytes_in_use},
      {"bytes_limit", s->bytes_limit.value_or(0)},
      {"num_allocs", s->num_allocs},
      {"largest_alloc_size", s->largest_alloc_size},
  };
}

}  // namespace tensorflow
