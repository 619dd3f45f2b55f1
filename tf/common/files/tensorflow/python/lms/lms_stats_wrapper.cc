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

// Python binding of the Large Model Support statistics and controls
// (tensorflow/python/framework/config.py loads it on first use).
//
// Counters cross as a dict of name -> int so that the engine can add counters
// without a change here or in the Python API (tf.experimental.get_lms_stats
// returns them all).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pybind11/pybind11.h"  // from @pybind11
#include "tensorflow/core/common_runtime/gpu/lms/lms_stats.h"
#include "tensorflow/python/lib/core/pybind11_status.h"

namespace py = pybind11;

namespace {

py::dict ToDict(const std::vector<std::pair<std::string, int64_t>>& items) {
  py::dict out;
  for (const auto& [name, value] : items) {
    out[py::str(name)] = py::int_(value);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_pywrap_lms_stats, m) {
  m.doc() = "Large Model Support statistics and controls of GPU allocators.";

  m.def(
      "get_lms_stats",
      [](int tf_gpu_id) {
        absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> items;
        {
          // Reading the counters takes the allocator's lock; let other Python
          // threads run meanwhile.
          py::gil_scoped_release release;
          items = tensorflow::GetLmsStatsItems(tf_gpu_id);
        }
        tensorflow::MaybeRaiseRegisteredFromStatus(items.status());
        return ToDict(*items);
      },
      py::arg("tf_gpu_id"),
      "Returns the LMS counters of the allocator of GPU `tf_gpu_id`.");

  m.def(
      "get_gpu_host_stats",
      [](int numa_node) {
        absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> items;
        {
          py::gil_scoped_release release;
          items = tensorflow::GetGpuHostStats(numa_node);
        }
        tensorflow::MaybeRaiseRegisteredFromStatus(items.status());
        return ToDict(*items);
      },
      py::arg("numa_node"),
      "Returns the counters of the GPU host allocator of `numa_node`.");

  m.def(
      "set_lms_limit",
      [](int tf_gpu_id, int64_t bytes) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = tensorflow::SetLmsLimit(tf_gpu_id, bytes);
        }
        tensorflow::MaybeRaiseRegisteredFromStatus(s);
      },
      py::arg("tf_gpu_id"), py::arg("bytes"),
      "Makes GPU `tf_gpu_id` reclaim once `bytes` are in use (0: all).");

  m.def(
      "reclaim_inactive",
      [](int tf_gpu_id) {
        absl::StatusOr<int64_t> bytes;
        {
          // Waits for device-to-host copies; other Python threads may run.
          py::gil_scoped_release release;
          bytes = tensorflow::ReclaimInactive(tf_gpu_id);
        }
        tensorflow::MaybeRaiseRegisteredFromStatus(bytes.status());
        return *bytes;
      },
      py::arg("tf_gpu_id"),
      "Moves every inactive tensor of GPU `tf_gpu_id` to host memory; "
      "returns the bytes moved.");
}
