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

// Large Model Support statistics, for the Python bindings
// (tf.experimental.get_lms_stats and the get_<counter> functions).
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_STATS_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_STATS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tflms/stats.h"

namespace tensorflow {

// Every counter of the LMS allocator of TensorFlow GPU `tf_gpu_id`.
// NotFound when that GPU has no LMS allocator (LMS off, GPU not yet used,
// or no such GPU).
absl::StatusOr<tflms::EngineStats> GetLmsStats(int tf_gpu_id);

// The same, as (name, value) pairs in a stable order; the names are those of
// tflms::EngineStats (bytes_in_use, num_single_reclaims, ...).
absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> GetLmsStatsItems(
    int tf_gpu_id);

// The pinned host (gpu_host_bfc) allocator of NUMA node `numa_node`, which
// holds paged-out bytes: bytes_in_use, peak_bytes_in_use, bytes_limit,
// num_allocs, largest_alloc_size. NotFound before any GPU exists,
// Unavailable when that allocator keeps no statistics.
absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> GetGpuHostStats(
    int numa_node);

// Controls (tf.config.experimental.set_lms_limit, tf.experimental.
// reclaim_inactive) share the allocator lookup and its NotFound error.

// Makes the LMS allocator of TensorFlow GPU `tf_gpu_id` reclaim once `bytes`
// of device memory are in use. 0, or a value at or above the GPU's memory
// limit, means the whole limit, as GPUOptions.experimental.lms_limit_bytes
// does. InvalidArgument for a negative value or one below 256 bytes.
absl::Status SetLmsLimit(int tf_gpu_id, int64_t bytes);

// Moves every inactive tensor of GPU `tf_gpu_id` to host memory now and
// returns the bytes moved.
absl::StatusOr<int64_t> ReclaimInactive(int tf_gpu_id);

}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_LMS_STATS_H_
