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

// The LMS engine's Device over StreamExecutor.
//
// Device memory comes from the sub-allocator TensorFlow would have given its
// BFC allocator. Page-out and page-in run on two streams of their own, created
// from the GPU's StreamExecutor, and are ordered against the GPU device's
// compute stream with events, so copies overlap kernels. Host memory for
// paged-out buffers comes from the pinned gpu_host_bfc allocator of the GPU's
// NUMA node, whose limit is TF_GPU_HOST_MEM_LIMIT_IN_MB.
#ifndef TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_STREAM_EXECUTOR_LMS_DEVICE_H_
#define TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_STREAM_EXECUTOR_LMS_DEVICE_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tflms/device.h"
#include "tflms/status.h"
#include "xla/stream_executor/event.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"
#include "xla/tsl/framework/allocator.h"

namespace tensorflow {
namespace lms {

class StreamExecutorLmsDevice : public tflms::Device {
 public:
  // Returns the host allocator for paged-out bytes. Called once, on the
  // first page-out: the GPU host allocator can only be created after the GPU
  // allocators exist, and the LMS allocator is one of them.
  using HostAllocatorFactory = std::function<tsl::Allocator*()>;

  // Creates the device-to-host and host-to-device streams.
  static absl::StatusOr<std::unique_ptr<StreamExecutorLmsDevice>> Create(
      std::string name, stream_executor::StreamExecutor* executor,
      std::unique_ptr<tsl::SubAllocator> sub_allocator,
      HostAllocatorFactory host_allocator_factory);

  ~StreamExecutorLmsDevice() override;

  // The stream the GPU device runs kernels on. TensorFlow hands allocators
  // only the platform handle (SetStreamAndPreallocateMemory), and events need
  // the se::Stream, so the GPU device attaches it before its first kernel.
  // Later calls with the same stream are free; another stream is ignored
  // with a warning (LMS orders copies against one compute stream).
  void AttachComputeStream(stream_executor::Stream* compute);
  bool HasComputeStream() const;

  // tflms::Device
  const char* Name() const override { return name_.c_str(); }
  void* AllocateDeviceMemory(size_t bytes, size_t alignment) override;
  void FreeDeviceMemory(void* ptr, size_t bytes) override;
  void* AllocateHostMemory(size_t bytes) override;
  void FreeHostMemory(void* ptr, size_t bytes) override;
  tflms::Stream* GetStream(tflms::StreamKind kind) override;
  tflms::Status CopyDeviceToHost(tflms::Stream* stream, void* host_dst,
                                 const void* device_src, size_t bytes) override;
  tflms::Status CopyHostToDevice(tflms::Stream* stream, void* device_dst,
                                 const void* host_src, size_t bytes) override;
  tflms::Status CopyDeviceToDevice(tflms::Stream* stream, void* device_dst,
                                   const void* device_src,
                                   size_t bytes) override;
  tflms::EventRef RecordEvent(tflms::Stream* stream,
                              tflms::Status* status) override;
  tflms::Status WaitEvent(tflms::Stream* stream,
                          const tflms::EventRef& event) override;
  tflms::Status SynchronizeEvent(const tflms::EventRef& event) override;
  bool EventDone(const tflms::EventRef& event) override;
  tflms::Status ReadDeviceSync(void* host_dst, const void* device_src,
                               size_t bytes) override;
  tflms::Status WriteDeviceSync(void* device_dst, const void* host_src,
                                size_t bytes) override;

  // The host allocator, or nullptr before the first page-out.
  tsl::Allocator* host_allocator_if_created() const;

  class LmsStream;
  class LmsEvent;

 private:
  // The engine records an event at every unpin; creating a platform event
  // each time would cost more than the unpin, so they are reused.
  absl::StatusOr<std::unique_ptr<stream_executor::Event>> TakeEvent();
  void ReturnEvent(std::unique_ptr<stream_executor::Event> event);

  StreamExecutorLmsDevice(std::string name,
                          stream_executor::StreamExecutor* executor,
                          std::unique_ptr<tsl::SubAllocator> sub_allocator,
                          HostAllocatorFactory host_allocator_factory);
  tsl::Allocator* host_allocator();

  const std::string name_;
  stream_executor::StreamExecutor* const executor_;  // not owned
  const std::unique_ptr<tsl::SubAllocator> sub_allocator_;
  HostAllocatorFactory host_allocator_factory_;
  absl::once_flag host_allocator_once_;
  std::atomic<tsl::Allocator*> host_allocator_{nullptr};

  std::unique_ptr<stream_executor::Stream> d2h_stream_;
  std::unique_ptr<stream_executor::Stream> h2d_stream_;
  std::unique_ptr<LmsStream> compute_;
  std::unique_ptr<LmsStream> d2h_;
  std::unique_ptr<LmsStream> h2d_;

  absl::Mutex events_mu_;
  std::vector<std::unique_ptr<stream_executor::Event>> free_events_
      ABSL_GUARDED_BY(events_mu_);
};

}  // namespace lms
}  // namespace tensorflow

#endif  // TENSORFLOW_CORE_COMMON_RUNTIME_GPU_LMS_STREAM_EXECUTOR_LMS_DEVICE_H_
