// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The training workload's kernels (training_workload.h) on the sim backend.
// With store_data they are host code on the sim's compute worker: they run
// when the stream reaches them, concurrently with the copy workers, so a
// missing stream wait shows as a wrong word, as it would on a GPU. Without
// store_data (the planner's mode) they only advance the modelled clock, by
// the seconds a GPU measured for them, so the same workload predicts a step.
#ifndef TFLMS_CORE_TESTS_SIM_KERNELS_H_
#define TFLMS_CORE_TESTS_SIM_KERNELS_H_

#include <atomic>
#include <cstdint>

#include "sim_device.h"
#include "training_workload.h"

namespace tflms {
namespace workload {

class SimKernels : public Kernels {
 public:
  // `seconds_per_byte`: modelled time of a Fill or a Check per byte.
  explicit SimKernels(SimDevice* device, double seconds_per_byte = 0)
      : device_(device), per_byte_(seconds_per_byte) {}

  void Fill(void* p, size_t bytes, uint32_t seed) override {
    std::function<void()> body;
    if (device_->store_data()) {
      body = [p, bytes, seed] {
        uint32_t* w = static_cast<uint32_t*>(p);
        for (size_t i = 0; i < bytes / 4; ++i) w[i] = Pattern(seed, i);
      };
    }
    device_->Launch(std::move(body), per_byte_ * static_cast<double>(bytes));
  }
  void Check(const void* p, size_t bytes, uint32_t seed) override {
    std::function<void()> body;
    if (device_->store_data()) {
      body = [this, p, bytes, seed] {
        const uint32_t* w = static_cast<const uint32_t*>(p);
        int64_t bad = 0;
        for (size_t i = 0; i < bytes / 4; ++i) bad += w[i] != Pattern(seed, i);
        errors_ += bad;
      };
    }
    device_->Launch(std::move(body), per_byte_ * static_cast<double>(bytes));
  }
  void Busy(double seconds) override { device_->Compute(seconds); }
  void Synchronize() override { device_->SynchronizeAll(); }
  int64_t Errors() override { return errors_.load(); }
  double Now() override { return device_->GetTimeline().host_time; }

 private:
  SimDevice* device_;
  const double per_byte_;
  std::atomic<int64_t> errors_{0};
};

}  // namespace workload
}  // namespace tflms

#endif  // TFLMS_CORE_TESTS_SIM_KERNELS_H_
