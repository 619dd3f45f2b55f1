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

#include "tensorflow/core/common_runtime/gpu/lms/lms_gpu_allocator.h"

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/log/log.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/device_id_utils.h"
#include "tensorflow/core/common_runtime/lms/lms_allocator.h"
#include "tensorflow/core/common_runtime/lms/lms_options.h"
#include "tensorflow/core/common_runtime/gpu/lms/stream_executor_lms_device.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tflms/engine.h"
#include "xla/stream_executor/gpu/gpu_init.h"
#include "xla/stream_executor/stream_executor.h"
#include "xla/tsl/util/env_var.h"

namespace tensorflow {
namespace lms {
namespace {

// Indexed by TfDeviceId. Entries are written once, when GPUProcessState
// creates the allocator, and never cleared: allocators live as long as the
// process, like the GPUProcessState that owns them.
constexpr int kMaxGpus = 256;
std::array<std::atomic<LmsAllocator*>, kMaxGpus> registry{};
// The StreamExecutor device each allocator owns, for AttachComputeStream.
std::array<std::atomic<StreamExecutorLmsDevice*>, kMaxGpus> devices{};
// One past the highest id registered, so lookups scan only live entries.
std::atomic<int> registry_end{0};

// TF_FORCE_GPU_ALLOW_GROWTH overrides allow_growth, as for GPUBFCAllocator.
bool AllowGrowth(const GPUOptions& options) {
  const char* force = std::getenv("TF_FORCE_GPU_ALLOW_GROWTH");
  if (force == nullptr) return options.allow_growth();
  const std::string value = absl::AsciiStrToLower(force);
  if (value == "true") return true;
  if (value == "false") return false;
  LOG(ERROR) << "The TF_FORCE_GPU_ALLOW_GROWTH environment variable is set but"
             << " could not be parsed: \"" << force << "\". Valid values are "
             << "\"true\" or \"false\". Using original config value of "
             << "allow_growth: " << options.allow_growth() << ".";
  return options.allow_growth();
}

// TF_ENABLE_GPU_GARBAGE_COLLECTION (default true) as for GPUBFCAllocator:
// before failing, wholly free regions go back to the device.
bool GarbageCollection() {
  bool enabled = true;
  absl::Status s = tsl::ReadBoolFromEnvVar("TF_ENABLE_GPU_GARBAGE_COLLECTION",
                                           /*default_val=*/true, &enabled);
  if (!s.ok()) LOG(ERROR) << s;
  return enabled;
}

// GPUOptions.experimental.lms_limit_bytes is one value for every GPU of the
// process, whose memory limits may differ: at or above a GPU's limit it
// means that GPU's whole memory (0), as it does in SetLmsLimit (lms_stats.h).
// Values the engine would refuse fall back to 0 with an error logged, so that
// a bad config leaves LMS working rather than the GPU without an allocator.
size_t LmsLimit(const GPUOptions& options, size_t total_bytes, int id) {
  const GPUOptions::Experimental& experimental = options.experimental();
  const auto* field =
      LmsField(experimental, "lms_limit_bytes",
               google::protobuf::FieldDescriptor::CPPTYPE_INT64);
  if (field == nullptr) return 0;
  const int64_t limit =
      experimental.GetReflection()->GetInt64(experimental, field);
  if (limit < 0 || (limit > 0 && limit < kMinLmsLimit)) {
    LOG(ERROR) << "GPUOptions.experimental.lms_limit_bytes = " << limit
               << " is ignored for GPU " << id << ": it must be 0 (the whole "
               << "device) or at least " << kMinLmsLimit << " bytes.";
    return 0;
  }
  if (static_cast<uint64_t>(limit) >= total_bytes) return 0;
  return static_cast<size_t>(limit);
}

void WarnAboutIgnoredDebugAllocator() {
  const char* debug = std::getenv("TF_GPU_ALLOCATOR");
  if (debug != nullptr && std::strlen(debug) > 0) {
    LOG(WARNING) << "TF_GPU_ALLOCATOR=" << debug << " is ignored: Large Model "
                 << "Support (GPUOptions.experimental.lms_enabled) replaces "
                 << "the GPU allocator.";
  }
}

}  // namespace

LmsAllocator* FindLmsAllocator(int tf_device_id) {
  if (tf_device_id < 0 || tf_device_id >= kMaxGpus) return nullptr;
  return registry[tf_device_id].load(std::memory_order_acquire);
}

LmsAllocator* FindLmsAllocator(const tsl::Allocator* allocator) {
  if (allocator == nullptr) return nullptr;
  const int end = registry_end.load(std::memory_order_acquire);
  for (int i = 0; i < end; ++i) {
    LmsAllocator* lms = registry[i].load(std::memory_order_acquire);
    if (lms != nullptr &&
        static_cast<const tsl::Allocator*>(lms) == allocator) {
      return lms;
    }
  }
  return nullptr;
}

void AttachComputeStream(const tsl::Allocator* allocator,
                         stream_executor::Stream* compute) {
  if (allocator == nullptr) return;
  const int end = registry_end.load(std::memory_order_acquire);
  for (int i = 0; i < end; ++i) {
    LmsAllocator* lms = registry[i].load(std::memory_order_acquire);
    if (lms != nullptr &&
        static_cast<const tsl::Allocator*>(lms) == allocator) {
      StreamExecutorLmsDevice* device =
          devices[i].load(std::memory_order_acquire);
      if (device != nullptr) device->AttachComputeStream(compute);
      return;
    }
  }
}

}  // namespace lms

std::unique_ptr<tsl::Allocator> CreateLmsGpuAllocator(
    const GPUOptions& options, bool defrag_enabled,
    tsl::TfDeviceId tf_device_id, size_t total_bytes,
    std::unique_ptr<tsl::SubAllocator> sub_allocator,
    std::function<tsl::Allocator*()> host_allocator) {
  const int id = tf_device_id.value();
  if (id < 0 || id >= lms::kMaxGpus) {
    LOG(ERROR) << "Large Model Support supports GPU ids below " << lms::kMaxGpus
               << ", not " << id;
    return nullptr;
  }
  lms::WarnAboutIgnoredDebugAllocator();
  absl::StatusOr<stream_executor::StreamExecutor*> executor =
      DeviceIdUtil::ExecutorForTfDeviceId(
          DEVICE_GPU, stream_executor::GPUMachineManager(), tf_device_id);
  if (!executor.ok()) {
    LOG(ERROR) << "Large Model Support for GPU " << id << ": "
               << executor.status();
    return nullptr;
  }
  const std::string name = absl::StrCat("GPU_", id, "_lms");
  absl::StatusOr<std::unique_ptr<lms::StreamExecutorLmsDevice>> device =
      lms::StreamExecutorLmsDevice::Create(
          name, *executor, std::move(sub_allocator), std::move(host_allocator));
  if (!device.ok()) {
    LOG(ERROR) << "Large Model Support for GPU " << id << ": "
               << device.status();
    return nullptr;
  }

  tflms::EngineOptions engine_options;
  engine_options.name = name;
  engine_options.memory_limit = total_bytes;
  engine_options.allow_growth = lms::AllowGrowth(options);
  engine_options.garbage_collection = lms::GarbageCollection();
  engine_options.fragmentation_fraction =
      options.experimental().internal_fragmentation_fraction();
  engine_options.lms_enabled = true;
  engine_options.lms_limit = lms::LmsLimit(options, total_bytes, id);
  // The gpu_host_bfc allocator enforces TF_GPU_HOST_MEM_LIMIT_IN_MB.
  engine_options.host_memory_limit = 0;
  engine_options.defrag_enabled = defrag_enabled;
  const std::string gpu = absl::StrCat("GPU ", id);
  engine_options.prefetch_enabled =
      lms::PrefetchEnabled(options, lms::kPrefetchEnabledDefault, gpu);
  engine_options.prefetch_lookahead = lms::PrefetchLookahead(
      options, engine_options.prefetch_lookahead, gpu);
  engine_options.run_ahead_epochs = lms::RunAheadEpochs(gpu);

  lms::StreamExecutorLmsDevice* device_ptr = device->get();
  absl::StatusOr<std::unique_ptr<lms::LmsAllocator>> allocator =
      lms::LmsAllocator::Create(*std::move(device), engine_options);
  if (!allocator.ok()) {
    LOG(ERROR) << "Large Model Support for GPU " << id << ": "
               << allocator.status();
    return nullptr;
  }
  LOG(INFO) << "Large Model Support enabled for GPU " << id << " ("
            << (total_bytes >> 20) << " MiB, reclaiming from "
            << ((engine_options.lms_limit == 0 ? total_bytes
                                               : engine_options.lms_limit) >>
                20)
            << " MiB in use, defragmentation "
            << (engine_options.defrag_enabled ? "on" : "off") << ", prefetch "
            << (engine_options.prefetch_enabled
                    ? absl::StrCat("on, ", engine_options.prefetch_lookahead,
                                   " tensor uses ahead")
                    : std::string("off"))
            << ")";
  lms::devices[id].store(device_ptr, std::memory_order_release);
  lms::registry[id].store(allocator->get(), std::memory_order_release);
  int end = lms::registry_end.load(std::memory_order_relaxed);
  while (end < id + 1 && !lms::registry_end.compare_exchange_weak(
                             end, id + 1, std::memory_order_acq_rel)) {
  }
  return *std::move(allocator);
}

}  // namespace tensorflow
