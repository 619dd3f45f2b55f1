// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// HostComputeDevice: the engine's simulated device for kernels that run on
// the host thread (the tflms.tfcpu harness).
//
// On a GPU, "the compute stream waits for a page-in" orders kernels that are
// enqueued later; the host thread does not wait. A CPU kernel runs on the host
// thread the moment its inputs are pinned, so here waiting on the compute
// stream blocks the calling thread until the event has completed. Everything
// else is forwarded to the SimDevice (device memory is a host arena that CPU
// kernels read and write directly; copies run on worker threads).
//
// Thread safety: the SimDevice is thread-safe; the one counter of its own is
// atomic.
#ifndef TFLMS_TFCPU_HOST_COMPUTE_DEVICE_H_
#define TFLMS_TFCPU_HOST_COMPUTE_DEVICE_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "forwarding_device.h"
#include "sim_device.h"
#include "tflms/device.h"

namespace tflms_tfcpu {

class HostComputeDevice : public tflms::ForwardingDevice {
 public:
  explicit HostComputeDevice(std::unique_ptr<tflms::SimDevice> sim)
      : ForwardingDevice(sim.get()), sim_(std::move(sim)) {}

  tflms::SimDevice* sim() const { return sim_.get(); }
  // Wall time kernels spent blocked on copies they were ordered after.
  int64_t kernel_wait_ns() const { return kernel_wait_ns_.load(); }

  const char* Name() const override { return "tfcpu-sim"; }
  // Kernels run here on the host in real time, which the simulated
  // device's modelled clock does not see: steps are timed on the real one.
  double NowSeconds() override { return tflms::Device::NowSeconds(); }
  tflms::Status WaitEvent(tflms::Stream* stream,
                          const tflms::EventRef& event) override {
    if (stream == sim_->GetStream(tflms::StreamKind::kCompute)) {
      // The next "kernel on the compute stream" is the caller's own code.
      // The time it blocks is what a GPU's compute stream would sit idle
      // waiting for a copy (a page-in): no engine counter sees it there.
      const auto start = std::chrono::steady_clock::now();
      tflms::Status s = sim_->SynchronizeEvent(event);
      kernel_wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start)
                             .count();
      return s;
    }
    return sim_->WaitEvent(stream, event);
  }
  // Fixed-address mode forwards too: the sim's host virtual memory, so a
  // kernel touching an evicted buffer faults instead of reading stale bytes.

 private:
  const std::unique_ptr<tflms::SimDevice> sim_;
  std::atomic<int64_t> kernel_wait_ns_{0};
};

}  // namespace tflms_tfcpu

#endif  // TFLMS_TFCPU_HOST_COMPUTE_DEVICE_H_
