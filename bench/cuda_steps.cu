// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Step by step: the balanced training workload (core/tests/training_workload.h,
// cuda_bench's tables 5a and 6) at 3x its device, one line per step with the
// step's time and what the engine did in it (bytes out and in, prefetch hits
// and misses, planned page-ins, early page-outs, reclaims, host waits). Made to
// tell a drift over a long run from noise: cuda_bench gives medians of steps
// 3-6 and 21-24 only, and one such run on the H200 read 0.317 and 0.329 s where
// 12 runs of this program read flat lines (docs/gpu/*-run5-steps.txt).
//
// Usage: cuda_steps [--steps N] [--on-demand] [--label TEXT] [--sim GBPS]
//   --steps      steps to run (default 32)
//   --on-demand  prefetch off (default on)
//   --label      first word of every line, to tell runs apart in one log
//   --sim        the simulated device (no GPU needed) with a host link of GBPS
//                each way, kernels as timed there: the planner's side
// Without a GPU and without --sim it prints "skipped" and exits 0.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "cuda_device.h"
#include "cuda_kernels.cuh"
#include "sim_device.h"
#include "sim_kernels.h"
#include "tflms/engine.h"
#include "training_workload.h"

namespace tflms {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

struct Args {
  int steps = 32;
  bool prefetch = true;
  std::string label = "run";
  double sim_gbps = 0;  // 0: the GPU
};

bool Parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (std::strcmp(argv[i], "--steps") == 0 && has_value) {
      a->steps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--on-demand") == 0) {
      a->prefetch = false;
    } else if (std::strcmp(argv[i], "--label") == 0 && has_value) {
      a->label = argv[++i];
    } else if (std::strcmp(argv[i], "--sim") == 0 && has_value) {
      a->sim_gbps = std::atof(argv[++i]);
      if (a->sim_gbps <= 0) return false;
    } else {
      return false;
    }
  }
  return a->steps >= 1;
}

void PrintSteps(const Args& a, const workload::Result& r) {
  std::printf("%s prefetch=%d status=%s wrong=%lld\n", a.label.c_str(),
              a.prefetch ? 1 : 0, r.status.ToString().c_str(),
              static_cast<long long>(r.errors));
  std::printf(
      "%s step     s  outMB  inMB hits miss npf plan early canc clean sglr "
      "frgr stall_ms pwait_ms trimMB\n",
      a.label.c_str());
  EngineStats prev;
  for (size_t i = 0; i < r.step_seconds.size(); ++i) {
    const EngineStats& s = r.step_stats[i];
    auto d = [](int64_t now, int64_t before) {
      return static_cast<long long>(now - before);
    };
    std::printf(
        "%s %3zu %.4f %6.0f %5.0f %4lld %4lld %3lld %4lld %5lld %4lld %5lld "
        "%4lld %4lld %8.1f %8.1f %6.0f\n",
        a.label.c_str(), i, r.step_seconds[i],
        (s.bytes_reclaimed - prev.bytes_reclaimed) / 1e6,
        (s.bytes_paged_in - prev.bytes_paged_in) / 1e6,
        d(s.prefetch_hits, prev.prefetch_hits),
        d(s.prefetch_misses, prev.prefetch_misses),
        d(s.num_prefetches, prev.num_prefetches),
        d(s.num_planned_prefetches, prev.num_planned_prefetches),
        d(s.num_early_page_outs, prev.num_early_page_outs),
        d(s.num_early_page_outs_cancelled, prev.num_early_page_outs_cancelled),
        d(s.num_clean_evictions, prev.num_clean_evictions),
        d(s.num_single_reclaims, prev.num_single_reclaims),
        d(s.num_fragment_reclaims, prev.num_fragment_reclaims),
        (s.page_in_stall_ns - prev.page_in_stall_ns) / 1e6,
        (s.page_out_wait_ns - prev.page_out_wait_ns) / 1e6,
        (s.bytes_padding_trimmed - prev.bytes_padding_trimmed) / 1e6);
    prev = s;
  }
}

}  // namespace
}  // namespace tflms

int main(int argc, char** argv) {
  using namespace tflms;
  Args a;
  if (!Parse(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: cuda_steps [--steps N>=1] [--on-demand] "
                 "[--label TEXT] [--sim GBPS>0]\n");
    return 2;
  }
  workload::Shape shape(32, 256 * kMiB, 32 * kMiB, a.steps, 2e-3, 4e-3);
  const size_t device = shape.PeakBytes() / 3 / (64 * kMiB) * (64 * kMiB);
  EngineOptions o;
  o.memory_limit = device;
  o.prefetch_enabled = a.prefetch;
  o.page_size = 2 * kMiB;
  o.virtual_address_bytes = 24 * kGiB;
  workload::Result r;
  if (a.sim_gbps > 0) {
    SimOptions so;
    so.device_memory = device;
    so.store_data = false;
    so.link_bytes_per_second = a.sim_gbps * 1e9;
    so.launch_queue_depth = 1000;  // as measured (cuda_bench table 7)
    SimDevice sim(so);
    Engine engine(&sim, o);
    r.status = engine.Init();
    workload::SimKernels kernels(&sim, 1.0 / 1.5e12);
    if (r.status.ok()) r = workload::Run(&engine, &kernels, shape);
    PrintSteps(a, r);
    return r.status.ok() && r.errors == 0 ? 0 : 1;
  }
  Status status;
  std::unique_ptr<CudaDevice> device_ptr = CudaDevice::Create(0, &status);
  if (!device_ptr) {
    std::printf("skipped: %s\n", status.ToString().c_str());
    return 0;
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) !=
          cudaSuccess ||
      !device_ptr->UseComputeStream(stream).ok()) {
    std::fprintf(stderr, "cannot set up the compute stream\n");
    return 1;
  }
  o.page_size = std::max<size_t>(device_ptr->VmGranularity(), 2 * kMiB);
  {
    Engine engine(device_ptr.get(), o);
    r.status = engine.Init();
    workload::CudaKernels kernels(stream);
    if (r.status.ok()) r = workload::Run(&engine, &kernels, shape);
  }
  PrintSteps(a, r);
  device_ptr.reset();
  cudaStreamDestroy(stream);
  return r.status.ok() && r.errors == 0 ? 0 : 1;
}
