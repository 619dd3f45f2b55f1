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

#include "tensorflow/core/common_runtime/gpu/lms/stream_executor_lms_device.h"

#include <memory>
#include <string>
#include <thread>  // NOLINT(build/c++11): std::this_thread::yield
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/log/log.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "tensorflow/core/common_runtime/lms/lms_status.h"
#include "tflms/device.h"
#include "tflms/status.h"
#include "xla/stream_executor/device_address.h"
#include "xla/stream_executor/event.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"
#include "xla/tsl/framework/allocator.h"

namespace tensorflow {
namespace lms {

namespace se = ::stream_executor;

// One of the three streams the engine sees. Work the engine enqueues on it
// is serialized by `mu`, so that "enqueue, then record the event that proves
// it" is one step; a failed enqueue poisons the events recorded after it, as
// tflms::Device requires.
class StreamExecutorLmsDevice::LmsStream : public tflms::Stream {
 public:
  explicit LmsStream(se::Stream* stream) : stream_(stream) {}

  se::Stream* get() const { return stream_.load(std::memory_order_acquire); }
  bool Attach(se::Stream* stream) {
    se::Stream* expected = nullptr;
    return stream_.compare_exchange_strong(expected, stream,
                                           std::memory_order_acq_rel) ||
           expected == stream;
  }

  absl::Mutex mu;
  tflms::Status error ABSL_GUARDED_BY(mu);

 private:
  std::atomic<se::Stream*> stream_;
};

// An event recorded on an LmsStream. `event` is null when nothing could
// have been enqueued before it (the compute stream not yet attached).
class StreamExecutorLmsDevice::LmsEvent : public tflms::Event {
 public:
  LmsEvent(StreamExecutorLmsDevice* device, std::unique_ptr<se::Event> event,
           tflms::Status error)
      : event(std::move(event)), error(std::move(error)), device_(device) {}
  ~LmsEvent() override {
    // The engine drops its events before the device goes away.
    if (event != nullptr) device_->ReturnEvent(std::move(event));
  }
  std::unique_ptr<se::Event> event;
  const tflms::Status error;

 private:
  StreamExecutorLmsDevice* const device_;
};

namespace {

using LmsEvent = StreamExecutorLmsDevice::LmsEvent;
using LmsStream = StreamExecutorLmsDevice::LmsStream;

const LmsEvent* AsLmsEvent(const tflms::EventRef& event) {
  return static_cast<const LmsEvent*>(event.get());
}

tflms::Status Poisoned(LmsStream* s, absl::Status status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  tflms::Status converted = FromAbslStatus(status);
  if (!converted.ok() && s->error.ok()) s->error = converted;
  return converted;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StreamExecutorLmsDevice>>
StreamExecutorLmsDevice::Create(
    std::string name, se::StreamExecutor* executor,
    std::unique_ptr<tsl::SubAllocator> sub_allocator,
    HostAllocatorFactory host_allocator_factory) {
  if (executor == nullptr || sub_allocator == nullptr ||
      !host_allocator_factory) {
    return absl::InvalidArgumentError(
        "Large Model Support needs a StreamExecutor, a sub-allocator and a "
        "host allocator factory");
  }
  std::unique_ptr<StreamExecutorLmsDevice> device(new StreamExecutorLmsDevice(
      std::move(name), executor, std::move(sub_allocator),
      std::move(host_allocator_factory)));
  absl::StatusOr<std::unique_ptr<se::Stream>> d2h = executor->CreateStream();
  if (!d2h.ok()) return d2h.status();
  absl::StatusOr<std::unique_ptr<se::Stream>> h2d = executor->CreateStream();
  if (!h2d.ok()) return h2d.status();
  device->d2h_stream_ = *std::move(d2h);
  device->h2d_stream_ = *std::move(h2d);
  device->d2h_ = std::make_unique<LmsStream>(device->d2h_stream_.get());
  device->h2d_ = std::make_unique<LmsStream>(device->h2d_stream_.get());
  return device;
}

StreamExecutorLmsDevice::StreamExecutorLmsDevice(
    std::string name, se::StreamExecutor* executor,
    std::unique_ptr<tsl::SubAllocator> sub_allocator,
    HostAllocatorFactory host_allocator_factory)
    : name_(std::move(name)),
      executor_(executor),
      sub_allocator_(std::move(sub_allocator)),
      host_allocator_factory_(std::move(host_allocator_factory)),
      compute_(std::make_unique<LmsStream>(nullptr)) {}

StreamExecutorLmsDevice::~StreamExecutorLmsDevice() {
  // Copies still queued read or write memory this object is about to stop
  // owning; wait for them (errors no longer have anyone to report to).
  for (se::Stream* s : {d2h_stream_.get(), h2d_stream_.get()}) {
    if (s != nullptr) s->BlockHostUntilDone().IgnoreError();
  }
}

void StreamExecutorLmsDevice::AttachComputeStream(se::Stream* compute) {
  if (compute == nullptr || compute_->get() == compute) return;
  if (!compute_->Attach(compute)) {
    LOG_FIRST_N(WARNING, 1)
        << "Large Model Support (" << name_
        << "): a kernel ran on a second compute stream; LMS orders its copies "
           "against the first one only. Use one stream per GPU with LMS.";
  }
}

bool StreamExecutorLmsDevice::HasComputeStream() const {
  return compute_->get() != nullptr;
}

void* StreamExecutorLmsDevice::AllocateDeviceMemory(size_t bytes,
                                                    size_t alignment) {
  size_t received = 0;
  void* ptr = sub_allocator_->Alloc(alignment, bytes, &received);
  if (ptr != nullptr && received < bytes) {
    sub_allocator_->Free(ptr, received);
    return nullptr;
  }
  return ptr;
}

void StreamExecutorLmsDevice::FreeDeviceMemory(void* ptr, size_t bytes) {
  sub_allocator_->Free(ptr, bytes);
}

tsl::Allocator* StreamExecutorLmsDevice::host_allocator() {
  absl::call_once(host_allocator_once_, [this] {
    host_allocator_.store(host_allocator_factory_(), std::memory_order_release);
  });
  return host_allocator_.load(std::memory_order_acquire);
}

tsl::Allocator* StreamExecutorLmsDevice::host_allocator_if_created() const {
  return host_allocator_.load(std::memory_order_acquire);
}

void* StreamExecutorLmsDevice::AllocateHostMemory(size_t bytes) {
  tsl::Allocator* host = host_allocator();
  if (host == nullptr) return nullptr;
  // A full pool is an expected outcome the engine reports with the limit in
  // force, so the host allocator must not wait and retry.
  tsl::AllocationAttributes attr;
  attr.retry_on_failure = false;
  return host->AllocateRaw(tsl::Allocator::kAllocatorAlignment, bytes, attr);
}

void StreamExecutorLmsDevice::FreeHostMemory(void* ptr, size_t bytes) {
  (void)bytes;
  host_allocator()->DeallocateRaw(ptr);
}

tflms::Stream* StreamExecutorLmsDevice::GetStream(tflms::StreamKind kind) {
  switch (kind) {
    case tflms::StreamKind::kCompute:
      return compute_.get();
    case tflms::StreamKind::kDeviceToHost:
      return d2h_.get();
    case tflms::StreamKind::kHostToDevice:
      return h2d_.get();
  }
  return nullptr;
}

namespace {

tflms::Status NoComputeStream(const std::string& name) {
  return tflms::Unavailable(absl::StrCat(
      "Large Model Support (", name,
      "): copy requested on the compute stream before the GPU device "
      "attached it"));
}

}  // namespace

tflms::Status StreamExecutorLmsDevice::CopyDeviceToHost(tflms::Stream* stream,
                                                        void* host_dst,
                                                        const void* device_src,
                                                        size_t bytes) {
  auto* s = static_cast<LmsStream*>(stream);
  se::Stream* se_stream = s->get();
  if (se_stream == nullptr) return NoComputeStream(name_);
  se::DeviceAddressBase src(const_cast<void*>(device_src), bytes);
  absl::MutexLock lock(&s->mu);
  return Poisoned(s, se_stream->Memcpy(host_dst, src, bytes));
}

tflms::Status StreamExecutorLmsDevice::CopyHostToDevice(tflms::Stream* stream,
                                                        void* device_dst,
                                                        const void* host_src,
                                                        size_t bytes) {
  auto* s = static_cast<LmsStream*>(stream);
  se::Stream* se_stream = s->get();
  if (se_stream == nullptr) return NoComputeStream(name_);
  se::DeviceAddressBase dst(device_dst, bytes);
  absl::MutexLock lock(&s->mu);
  return Poisoned(s, se_stream->Memcpy(&dst, host_src, bytes));
}

tflms::Status StreamExecutorLmsDevice::CopyDeviceToDevice(
    tflms::Stream* stream, void* device_dst, const void* device_src,
    size_t bytes) {
  auto* s = static_cast<LmsStream*>(stream);
  se::Stream* se_stream = s->get();
  if (se_stream == nullptr) return NoComputeStream(name_);
  se::DeviceAddressBase dst(device_dst, bytes);
  se::DeviceAddressBase src(const_cast<void*>(device_src), bytes);
  absl::MutexLock lock(&s->mu);
  return Poisoned(s, se_stream->Memcpy(&dst, src, bytes));
}

tflms::EventRef StreamExecutorLmsDevice::RecordEvent(tflms::Stream* stream,
                                                     tflms::Status* status) {
  auto* s = static_cast<LmsStream*>(stream);
  se::Stream* se_stream = s->get();
  *status = tflms::Status::Ok();
  if (se_stream == nullptr) {
    // No kernel has run yet, so there is nothing on the compute stream to
    // wait for: the event is complete from the start.
    return std::make_shared<LmsEvent>(this, nullptr, tflms::Status::Ok());
  }
  absl::StatusOr<std::unique_ptr<se::Event>> event = TakeEvent();
  if (!event.ok()) {
    *status = FromAbslStatus(event.status());
    return nullptr;
  }
  absl::MutexLock lock(&s->mu);
  absl::Status recorded = se_stream->RecordEvent(event->get());
  if (!recorded.ok()) {
    *status = Poisoned(s, recorded);
    return nullptr;
  }
  return std::make_shared<LmsEvent>(this, *std::move(event), s->error);
}

absl::StatusOr<std::unique_ptr<se::Event>>
StreamExecutorLmsDevice::TakeEvent() {
  {
    absl::MutexLock lock(&events_mu_);
    if (!free_events_.empty()) {
      std::unique_ptr<se::Event> event = std::move(free_events_.back());
      free_events_.pop_back();
      return event;
    }
  }
  return executor_->CreateEvent();
}

void StreamExecutorLmsDevice::ReturnEvent(std::unique_ptr<se::Event> event) {
  absl::MutexLock lock(&events_mu_);
  free_events_.push_back(std::move(event));
}

tflms::Status StreamExecutorLmsDevice::WaitEvent(tflms::Stream* stream,
                                                 const tflms::EventRef& event) {
  const LmsEvent* e = AsLmsEvent(event);
  if (e == nullptr || e->event == nullptr) return tflms::Status::Ok();
  auto* s = static_cast<LmsStream*>(stream);
  se::Stream* se_stream = s->get();
  if (se_stream == nullptr) {
    // Nothing runs on the compute stream yet; whatever runs on it later
    // starts after the host has seen the event complete.
    return SynchronizeEvent(event);
  }
  absl::MutexLock lock(&s->mu);
  return Poisoned(s, se_stream->WaitFor(e->event.get()));
}

tflms::Status StreamExecutorLmsDevice::SynchronizeEvent(
    const tflms::EventRef& event) {
  const LmsEvent* e = AsLmsEvent(event);
  if (e == nullptr) return tflms::Internal("null LMS event");
  if (e->event != nullptr) {
    absl::Status s = e->event->Synchronize();
    if (absl::IsUnimplemented(s)) {
      // Platforms without a blocking wait: poll, yielding the core.
      s = absl::OkStatus();
      while (e->event->PollForStatus() == se::Event::Status::kPending) {
        std::this_thread::yield();
      }
    }
    if (!s.ok()) return FromAbslStatus(s);
    if (e->event->PollForStatus() == se::Event::Status::kError) {
      return tflms::Internal(absl::StrCat("Large Model Support (", name_,
                                          "): a copy before this event "
                                          "failed on the GPU"));
    }
  }
  return e->error;
}

bool StreamExecutorLmsDevice::EventDone(const tflms::EventRef& event) {
  const LmsEvent* e = AsLmsEvent(event);
  if (e == nullptr || e->event == nullptr) return true;
  return e->event->PollForStatus() != se::Event::Status::kPending;
}

tflms::Status StreamExecutorLmsDevice::ReadDeviceSync(void* host_dst,
                                                      const void* device_src,
                                                      size_t bytes) {
  se::Stream* compute = compute_->get();
  absl::MutexLock lock(&d2h_->mu);
  if (compute != nullptr) {
    absl::Status s = d2h_stream_->WaitFor(compute);
    if (!s.ok()) return FromAbslStatus(s);
  }
  se::DeviceAddressBase src(const_cast<void*>(device_src), bytes);
  absl::Status s = d2h_stream_->Memcpy(host_dst, src, bytes);
  if (s.ok()) s = d2h_stream_->BlockHostUntilDone();
  return FromAbslStatus(s);
}

tflms::Status StreamExecutorLmsDevice::WriteDeviceSync(void* device_dst,
                                                       const void* host_src,
                                                       size_t bytes) {
  se::Stream* compute = compute_->get();
  absl::MutexLock lock(&h2d_->mu);
  if (compute != nullptr) {
    absl::Status s = h2d_stream_->WaitFor(compute);
    if (!s.ok()) return FromAbslStatus(s);
  }
  se::DeviceAddressBase dst(device_dst, bytes);
  absl::Status s = h2d_stream_->Memcpy(&dst, host_src, bytes);
  if (s.ok()) s = h2d_stream_->BlockHostUntilDone();
  return FromAbslStatus(s);
}

}  // namespace lms
}  // namespace tensorflow
