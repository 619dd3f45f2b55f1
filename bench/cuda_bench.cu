// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The CUDA backend on a real GPU, measured (make bench-cuda; docs/results.md
// "On a GPU"). Five tables, each a side-by-side in one run:
//   1. the card's pinned copy bandwidth (cudaMemcpyAsync on fresh streams),
//      each direction alone and both at once, by copy size;
//   2. the engine's copy streams: ReclaimInactive (page-out) and pins that
//      page in, by buffer size, against table 1 at the same size;
//   3. overlap: a compute kernel and both copy directions, alone and at once;
//   4. CUDA virtual memory (fixed-address mode): map and unmap per page;
//   5. the training workload (core/tests/training_workload.h) with every
//      word checked: step time with no pressure, on demand, with prefetch,
//      and in fixed-address mode, against LB2 (the planner's lower bound), and the
//      planner's prediction for the same workload (the engine over the
//      simulated device with table 1's bandwidths and the kernels' measured
//      times): the planner checked against the hardware it models.
//   6. the balanced workload at 2x, 4x and 6x its device, a finer-grained
//      one, and a 24-step run, measured beside the planner;
//   7. the launch queue: host time per kernel launch and how many kernels
//      the host runs ahead before it blocks (two planner defaults).
// Usage: cuda_bench [--sections 1234567] [results.json]
//        cuda_bench --predict-only D2H_GBPS H2D_GBPS [MAP_US UNMAP_US]
//                   [--sections 56]
// (--predict-only runs the planner side alone, on a machine without a GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

// Results gathered for the JSON file, flat name -> value.
std::vector<std::pair<std::string, double>> g_json;
void Put(const std::string& key, double value) {
  g_json.emplace_back(key, value);
}

std::string SizeName(size_t bytes) {
  return bytes >= kGiB ? std::to_string(bytes / kGiB) + "GiB"
                       : std::to_string(bytes / kMiB) + "MiB";
}

// ---- 1. the card's pinned copy bandwidth ----

struct CopyBuffers {
  void* dev_a = nullptr;  // source of D2H
  void* dev_b = nullptr;  // destination of H2D
  void* host_a = nullptr;
  void* host_b = nullptr;
  size_t bytes = 0;
  bool ok = false;
  explicit CopyBuffers(size_t n) : bytes(n) {
    ok = Check(cudaMalloc(&dev_a, n), "cudaMalloc") &&
         Check(cudaMalloc(&dev_b, n), "cudaMalloc") &&
         Check(cudaHostAlloc(&host_a, n, cudaHostAllocPortable),
               "cudaHostAlloc") &&
         Check(cudaHostAlloc(&host_b, n, cudaHostAllocPortable),
               "cudaHostAlloc") &&
         Check(cudaMemset(dev_a, 0x5a, n), "memset") &&
         Check(cudaMemset(dev_b, 0, n), "memset");
    if (ok) {
      std::memset(host_a, 0, n);
      std::memset(host_b, 0xa5, n);
    }
  }
  ~CopyBuffers() {
    cudaFree(dev_a);
    cudaFree(dev_b);
    cudaFreeHost(host_a);
    cudaFreeHost(host_b);
  }
};

// Bytes per second of `total` bytes moved in `piece`-byte copies, in the
// chosen directions at once (each direction moves `total`): median of 5.
double RawBandwidth(CopyBuffers& b, bool d2h, bool h2d, size_t piece,
                    size_t total) {
  cudaStream_t s[2];
  cudaStreamCreateWithFlags(&s[0], cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s[1], cudaStreamNonBlocking);
  std::vector<double> rates;
  for (int rep = 0; rep < 6; ++rep) {
    const double t0 = Now();
    for (size_t done = 0; done < total; done += piece) {
      const size_t off = done % b.bytes;
      if (d2h) {
        cudaMemcpyAsync(static_cast<char*>(b.host_a) + off,
                        static_cast<char*>(b.dev_a) + off, piece,
                        cudaMemcpyDeviceToHost, s[0]);
      }
      if (h2d) {
        cudaMemcpyAsync(static_cast<char*>(b.dev_b) + off,
                        static_cast<char*>(b.host_b) + off, piece,
                        cudaMemcpyHostToDevice, s[1]);
      }
    }
    cudaStreamSynchronize(s[0]);
    cudaStreamSynchronize(s[1]);
    const double dt = Now() - t0;
    if (rep > 0) rates.push_back(static_cast<double>(total) / dt);  // warm
  }
  Check(cudaGetLastError(), "raw copies");
  cudaStreamDestroy(s[0]);
  cudaStreamDestroy(s[1]);
  return Median(rates);
}

struct RawRates {
  double d2h = 0, h2d = 0, both = 0;  // bytes/s per direction
};

std::vector<std::pair<size_t, RawRates>> CopyBandwidthTable() {
  std::printf("\n1. Pinned copy bandwidth of this card (cudaMemcpyAsync, "
              "median of 5)\n");
  std::printf("%10s %12s %12s %22s\n", "copy size", "D2H GB/s", "H2D GB/s",
              "both at once GB/s each");
  std::vector<std::pair<size_t, RawRates>> table;
  CopyBuffers b(kGiB);
  if (!b.ok) return table;
  for (size_t piece : {4 * kMiB, 64 * kMiB, 256 * kMiB}) {
    RawRates r;
    const size_t total = 2 * kGiB;
    r.d2h = RawBandwidth(b, true, false, piece, total);
    r.h2d = RawBandwidth(b, false, true, piece, total);
    r.both = RawBandwidth(b, true, true, piece, total);
    std::printf("%10s %12.1f %12.1f %22.1f\n", SizeName(piece).c_str(),
                r.d2h / 1e9, r.h2d / 1e9, r.both / 1e9);
    Put("raw_d2h_gbps_" + SizeName(piece), r.d2h / 1e9);
    Put("raw_h2d_gbps_" + SizeName(piece), r.h2d / 1e9);
    Put("raw_both_gbps_" + SizeName(piece), r.both / 1e9);
    table.push_back({piece, r});
  }
  return table;
}

// ---- 2. the engine's copy streams ----

void EngineCopyTable(CudaDevice* device, cudaStream_t stream,
                     const std::vector<std::pair<size_t, RawRates>>& raw) {
  std::printf("\n2. The engine's copy streams against table 1 (4 GiB of "
              "buffers; best of 3 after a warm-up)\n");
  std::printf("%10s %14s %8s %14s %8s %8s\n", "buffer", "page-out GB/s",
              "of raw", "page-in GB/s", "of raw", "wrong");
  for (const auto& row : raw) {
    const size_t size = row.first;
    EngineOptions options;
    options.memory_limit = 6 * kGiB;
    Engine engine(device, options);
    if (!engine.Init().ok()) return;
    workload::CudaKernels kernels(stream);
    const size_t n = 4 * kGiB / size;
    std::vector<Buffer*> bufs;
    Status status;
    for (size_t i = 0; i < n; ++i) {
      void* p = nullptr;
      Buffer* b = engine.AllocateBuffer(size, true, &status, &p);
      if (b == nullptr) break;
      kernels.Fill(p, size, static_cast<uint32_t>(i + 1));
      engine.Unpin(b);
      bufs.push_back(b);
    }
    kernels.Synchronize();
    Stream* h2d = device->GetStream(StreamKind::kHostToDevice);
    double best_out = 0, best_in = 0;
    for (int rep = 0; rep < 4 && bufs.size() == n; ++rep) {
      size_t bytes = 0;
      double t0 = Now();
      status = engine.ReclaimInactive(&bytes);
      const double out_s = Now() - t0;
      t0 = Now();
      for (Buffer* b : bufs) {
        void* p = nullptr;
        engine.Pin(b, &p);  // enqueues the page-in; the host does not wait
      }
      EventRef e = device->RecordEvent(h2d, &status);
      if (e) device->SynchronizeEvent(e);
      const double in_s = Now() - t0;
      for (Buffer* b : bufs) engine.Unpin(b);
      if (rep > 0 && bytes > 0) {  // the first pinned the host pool's memory
        best_out = std::max(best_out, bytes / out_s);
        best_in = std::max(best_in, static_cast<double>(n * size) / in_s);
      }
    }
    // Every word must be what the fill left, after four round trips.
    workload::CudaKernels verify(stream);
    for (size_t i = 0; i < bufs.size(); ++i) {
      void* p = nullptr;
      if (engine.Pin(bufs[i], &p).ok()) {
        verify.Check(p, size, static_cast<uint32_t>(i + 1));
      }
      engine.Unpin(bufs[i]);
    }
    const int64_t wrong = verify.Errors();
    for (Buffer* b : bufs) engine.FreeBuffer(b);
    std::printf("%10s %14.1f %7.0f%% %14.1f %7.0f%% %8lld\n",
                SizeName(size).c_str(), best_out / 1e9,
                100 * best_out / row.second.d2h, best_in / 1e9,
                100 * best_in / row.second.h2d, static_cast<long long>(wrong));
    Put("engine_page_out_gbps_" + SizeName(size), best_out / 1e9);
    Put("engine_page_in_gbps_" + SizeName(size), best_in / 1e9);
    Put("engine_page_out_of_raw_" + SizeName(size), best_out / row.second.d2h);
    Put("engine_page_in_of_raw_" + SizeName(size), best_in / row.second.h2d);
    Put("engine_copy_wrong_words_" + SizeName(size),
        static_cast<double>(wrong));
  }
}

// ---- 3. overlap ----

void OverlapTable(CudaDevice* device, cudaStream_t stream) {
  std::printf("\n3. Overlap: a 150 ms kernel and 2 GiB each way on the "
              "engine's streams (64 MiB copies)\n");
  CopyBuffers b(2 * kGiB);
  if (!b.ok) return;
  workload::CudaKernels kernels(stream);
  Stream* d2h = device->GetStream(StreamKind::kDeviceToHost);
  Stream* h2d = device->GetStream(StreamKind::kHostToDevice);
  auto run = [&](bool compute, bool out, bool in) {
    std::vector<double> times;
    for (int rep = 0; rep < 4; ++rep) {
      const double t0 = Now();
      if (compute) kernels.Busy(0.150);
      for (size_t off = 0; off < b.bytes; off += 64 * kMiB) {
        if (out) {
          device->CopyDeviceToHost(d2h, static_cast<char*>(b.host_a) + off,
                                   static_cast<char*>(b.dev_a) + off,
                                   64 * kMiB);
        }
        if (in) {
          device->CopyHostToDevice(h2d, static_cast<char*>(b.dev_b) + off,
                                   static_cast<char*>(b.host_b) + off,
                                   64 * kMiB);
        }
      }
      Status s;
      for (Stream* st : {d2h, h2d}) {
        EventRef e = device->RecordEvent(st, &s);
        if (e) device->SynchronizeEvent(e);
      }
      kernels.Synchronize();
      if (rep > 0) times.push_back(Now() - t0);
    }
    return Median(times);
  };
  const double c = run(true, false, false);
  const double o = run(false, true, false);
  const double i = run(false, false, true);
  const double oi = run(false, true, true);
  const double all = run(true, true, true);
  const double longest = std::max({c, o, i});
  std::printf("%-34s %8s\n", "", "seconds");
  std::printf("%-34s %8.3f\n", "kernel alone", c);
  std::printf("%-34s %8.3f\n", "device-to-host alone", o);
  std::printf("%-34s %8.3f\n", "host-to-device alone", i);
  std::printf("%-34s %8.3f  (%.2fx the longer alone)\n", "both copies at once",
              oi, oi / std::max(o, i));
  std::printf("%-34s %8.3f  (%.2fx the longest alone; serial would be "
              "%.3f)\n",
              "kernel + both copies at once", all, all / longest, c + o + i);
  Put("overlap_kernel_s", c);
  Put("overlap_d2h_s", o);
  Put("overlap_h2d_s", i);
  Put("overlap_both_copies_s", oi);
  Put("overlap_all_s", all);
  Put("overlap_all_over_longest", all / longest);
}

// ---- 4. CUDA virtual memory ----

struct VmmCost {
  double map_s = 0, unmap_s = 0;  // per page, host time
};

VmmCost VmmTable(CudaDevice* device) {
  if (device->VmGranularity() == 0) {
    std::printf("\n4. CUDA VMM: not supported here\n");
    return {};
  }
  const size_t page = std::max<size_t>(device->VmGranularity(), 2 * kMiB);
  const int pages = 512;
  void* base = nullptr;
  if (!device->ReserveAddressRange(pages * page, page, &base).ok()) return {};
  char* p = static_cast<char*>(base);
  auto per_page = [&](bool map) {
    const double t0 = Now();
    for (int i = 0; i < pages; ++i) {
      const Status s = map ? device->MapPages(p + i * page, page)
                           : device->UnmapPages(p + i * page, page);
      if (!s.ok()) {
        std::fprintf(stderr, "vmm: %s\n", s.ToString().c_str());
        return -1.0;
      }
    }
    return (Now() - t0) / pages;
  };
  const double first_map = per_page(true);  // cuMemCreate + cuMemMap
  const double unmap = per_page(false);
  const double remap = per_page(true);  // handles from the pool
  per_page(false);
  double t0 = Now();
  const bool bulk_ok = device->MapPages(p, pages * page).ok();
  const double bulk_map = (Now() - t0) / pages;
  if (bulk_ok) device->UnmapPages(p, pages * page);
  device->ReleaseAddressRange(base, pages * page);
  std::printf("\n4. CUDA virtual memory, %zu MiB pages (microseconds per "
              "page)\n",
              page / kMiB);
  std::printf("%-44s %8.1f\n", "map, new physical page (cuMemCreate+Map)",
              first_map * 1e6);
  std::printf("%-44s %8.1f\n", "unmap", unmap * 1e6);
  std::printf("%-44s %8.1f\n", "map again, pooled physical page", remap * 1e6);
  std::printf("%-44s %8.1f\n", "map 512 pages in one call, per page",
              bulk_map * 1e6);
  Put("vmm_page_mib", static_cast<double>(page / kMiB));
  Put("vmm_map_new_us", first_map * 1e6);
  Put("vmm_unmap_us", unmap * 1e6);
  Put("vmm_remap_us", remap * 1e6);
  Put("vmm_bulk_map_us", bulk_map * 1e6);
  // The engine maps a buffer's pages in one call and reuses pooled pages.
  return {bulk_map, unmap};
}

// ---- 5. the training workload ----

workload::Shape TrainingShape(bool link_bound) {
  return link_bound
             ? workload::Shape(32, 256 * kMiB, 32 * kMiB, 6, 0.25e-3, 0.5e-3)
             : workload::Shape(32, 256 * kMiB, 32 * kMiB, 6, 2e-3, 4e-3);
}

size_t PeakBytes(const workload::Shape& s) { return s.PeakBytes(); }

struct Mode {
  const char* name;
  bool lms_pressure, prefetch, fixed;
};

struct StepFigures {
  bool ok = false;
  double step = 0;       // median of the steps after the first two
  double out_gb = 0;     // per step, those steps
  double in_gb = 0;
  double hits = 0, misses = 0, stall_ms = 0;
  int64_t wrong = 0;
};

// Median of step_seconds[from, to); 0 when the run has fewer steps.
double MedianOfSteps(const std::vector<double>& steps, size_t from,
                     size_t to) {
  if (steps.size() < to || from >= to) return 0;
  return Median(std::vector<double>(steps.begin() + from, steps.begin() + to));
}

StepFigures Figures(const workload::Result& r) {
  StepFigures f;
  f.ok = r.status.ok() && r.errors == 0;
  f.wrong = r.errors;
  if (!r.status.ok()) {
    std::fprintf(stderr, "workload: %s\n", r.status.ToString().c_str());
  }
  const size_t n = r.step_seconds.size();
  if (n < 3) return f;
  f.step = MedianOfSteps(r.step_seconds, 2, n);
  const EngineStats& a = r.step_stats[1];
  const EngineStats& b = r.step_stats[n - 1];
  const double steps = static_cast<double>(n - 2);
  f.out_gb = (b.bytes_reclaimed - a.bytes_reclaimed) / 1e9 / steps;
  f.in_gb = (b.bytes_paged_in - a.bytes_paged_in) / 1e9 / steps;
  f.hits = (b.prefetch_hits - a.prefetch_hits) / steps;
  f.misses = (b.prefetch_misses - a.prefetch_misses) / steps;
  f.stall_ms = (b.page_in_stall_ns - a.page_in_stall_ns) / 1e6 / steps;
  return f;
}

EngineOptions WorkloadOptions(const Mode& m, size_t page, size_t device) {
  EngineOptions o;
  o.memory_limit = m.lms_pressure ? device : 24 * kGiB;
  o.prefetch_enabled = m.prefetch;
  o.fixed_addresses = m.fixed;
  o.page_size = page;
  o.virtual_address_bytes = 24 * kGiB;  // the whole workload, with room
  // Fixed-address mode has no step plan, only the look-ahead, which skips
  // tensors over its budget (1/8 of the device by default).
  if (m.fixed && m.prefetch) o.prefetch_budget_bytes = device / 2;
  return o;
}

// LB2 (tflms/planner/yardsticks.py) for the workload: with C the kernels'
// time, before_q / after_q the kernel time before and after kernel q, and
// xo_q, xi_q the time the device-to-host and host-to-device links need for
// live_q - M bytes, no schedule that swaps beats
//   C + max over q' <= q of (xo_q' - before_q')+ + (xi_q - after_q)+.
// The kernels and the live bytes at each come from one step of the workload
// on the simulated device with room for everything.
class RecordingKernels : public workload::SimKernels {
 public:
  RecordingKernels(SimDevice* device, double per_byte)
      : SimKernels(device, per_byte), per_byte_(per_byte) {}
  void set_engine(Engine* e) { engine_ = e; }
  void Fill(void* p, size_t bytes, uint32_t seed) override {
    SimKernels::Fill(p, bytes, seed);
    Note(per_byte_ * static_cast<double>(bytes));
  }
  void Check(const void* p, size_t bytes, uint32_t seed) override {
    SimKernels::Check(p, bytes, seed);
    Note(per_byte_ * static_cast<double>(bytes));
  }
  void Busy(double seconds) override {
    SimKernels::Busy(seconds);
    if (seconds > 0) Note(seconds);
  }
  std::vector<std::pair<double, int64_t>> ops;  // kernel seconds, live bytes

 private:
  void Note(double seconds) {
    ops.push_back({seconds, engine_->GetStats().bytes_in_use});
  }
  const double per_byte_;
  Engine* engine_ = nullptr;
};

double Lb2(const workload::Shape& step_shape, size_t device, double d2h_bps,
           double h2d_bps, double per_byte) {
  workload::Shape shape = step_shape;
  shape.steps = 1;
  SimOptions so;
  so.device_memory = 24 * kGiB;
  so.store_data = false;
  SimDevice sim(so);
  EngineOptions eo;
  eo.memory_limit = so.device_memory;
  Engine engine(&sim, eo);
  if (!engine.Init().ok()) return 0;
  RecordingKernels k(&sim, per_byte);
  k.set_engine(&engine);
  workload::Run(&engine, &k, shape);
  double total = 0;
  for (const auto& op : k.ops) total += op.first;
  double before = 0, best_out = 0, bound = total;
  for (const auto& op : k.ops) {
    const double excess =
        std::max<double>(0, static_cast<double>(op.second) - device);
    best_out = std::max(best_out, excess / d2h_bps - before);
    const double after = total - before - op.first;
    bound = std::max(bound, total + best_out +
                                std::max(0.0, excess / h2d_bps - after));
    before += op.first;
  }
  return bound;
}

struct WorkloadContext {
  CudaDevice* device = nullptr;  // null: the planner's side only
  cudaStream_t stream = nullptr;
  double d2h_bps = 0, h2d_bps = 0;
  double per_byte = 1.0 / 1.5e12;  // a Fill or Check kernel, per byte
  VmmCost vmm;
};

// The workload measured on the GPU in mode `m` on `device` bytes; false
// where the mode cannot run there (no CUDA VMM for fixed addresses) or the
// engine refused the options.
bool MeasureOnGpu(const WorkloadContext& ctx, const Mode& m,
                  const workload::Shape& shape, size_t device,
                  workload::Result* r) {
  if (m.fixed && ctx.device->VmGranularity() == 0) return false;
  const size_t page = std::max<size_t>(ctx.device->VmGranularity(), 2 * kMiB);
  Engine engine(ctx.device, WorkloadOptions(m, page, device));
  if (!engine.Init().ok()) return false;
  workload::CudaKernels kernels(ctx.stream);
  *r = workload::Run(&engine, &kernels, shape);
  return true;
}

// The planner's side: the same workload on the simulated device, kernels
// taking what they took on the GPU, links and page maps at the measured
// rates.
workload::Result ReplayInPlanner(const WorkloadContext& ctx, const Mode& m,
                                 const workload::Shape& shape, size_t device) {
  SimOptions so;
  so.map_seconds_per_page = ctx.vmm.map_s;
  so.unmap_seconds_per_page = ctx.vmm.unmap_s;
  so.device_memory = WorkloadOptions(m, 2 * kMiB, device).memory_limit;
  so.store_data = false;
  // The sim has one rate for both directions; each direction of this
  // workload carries the same bytes, so the slower one sets the pace.
  so.link_bytes_per_second = std::min(ctx.d2h_bps, ctx.h2d_bps);
  so.launch_queue_depth = 1000;
  SimDevice sim(so);
  Engine engine(&sim, WorkloadOptions(m, 2 * kMiB, device));
  workload::Result r;
  r.status = engine.Init();
  if (!r.status.ok()) return r;
  workload::SimKernels kernels(&sim, ctx.per_byte);
  return workload::Run(&engine, &kernels, shape);
}

// A Fill or Check kernel's time per byte on this GPU (HBM-bound).
double MeasureFillPerByte(cudaStream_t stream) {
  workload::CudaKernels k(stream);
  void* p = nullptr;
  if (!Check(cudaMalloc(&p, kGiB), "cudaMalloc")) return 1.0 / 1.5e12;
  k.Fill(p, kGiB, 1);
  k.Synchronize();
  const double t0 = Now();
  for (int i = 0; i < 10; ++i) k.Fill(p, kGiB, 2 + i);
  k.Synchronize();
  cudaFree(p);
  return (Now() - t0) / (10.0 * kGiB);
}

// One table: `shape` on `device_bytes` in each of `modes`, measured on the
// GPU (unless ctx.device is null) beside the planner's prediction and LB2.
void WorkloadRows(const WorkloadContext& ctx, const std::string& title,
                  const std::string& key_prefix, const workload::Shape& shape,
                  size_t device_bytes, const std::vector<Mode>& modes) {
  const double lb2 = Lb2(shape, device_bytes, ctx.d2h_bps, ctx.h2d_bps,
                         ctx.per_byte);
  std::printf(
      "\n%s: %d layers, %zu MiB activations, %zu MiB weights, kernels "
      "%.2f/%.2f ms per layer (fwd/bwd), peak about %.1f GiB on %.2f GiB "
      "(%.1fx); medians of steps 3-%d; every word checked\n",
      title.c_str(), shape.layers, shape.activation_bytes / kMiB,
      shape.weight_bytes / kMiB, shape.forward_seconds * 1e3,
      shape.backward_seconds * 1e3,
      PeakBytes(shape) / static_cast<double>(kGiB),
      device_bytes / static_cast<double>(kGiB),
      PeakBytes(shape) / static_cast<double>(device_bytes), shape.steps);
  std::printf("%-28s %8s %8s %7s %7s %6s %6s %8s %8s %9s %6s\n", "mode",
              "step s", "x free", "out GB", "in GB", "hits", "miss",
              "stall ms", "LB2 s", "planner s", "wrong");
  double free_step = 0;
  for (const Mode& m : modes) {
    StepFigures f;
    if (ctx.device != nullptr) {
      workload::Result measured;
      if (!MeasureOnGpu(ctx, m, shape, device_bytes, &measured)) continue;
      f = Figures(measured);
    }
    const StepFigures p =
        Figures(ReplayInPlanner(ctx, m, shape, device_bytes));
    if (ctx.device == nullptr) f = p;
    if (!m.lms_pressure && !m.prefetch) free_step = f.step;
    // No schedule beats the step with room for everything, nor LB2.
    const double bound =
        m.lms_pressure ? std::max(free_step, lb2) : free_step;
    std::printf(
        "%-28s %8.3f %8.2f %7.2f %7.2f %6.0f %6.0f %8.1f %8.3f %9.3f "
        "%6lld%s\n",
        m.name, f.step, free_step > 0 ? f.step / free_step : 0, f.out_gb,
        f.in_gb, f.hits, f.misses, f.stall_ms, bound, p.step,
        static_cast<long long>(f.wrong),
        ctx.device == nullptr || f.ok ? "" : "  FAILED");
    const std::string key = key_prefix + (m.lms_pressure ? "" : "free_") +
                            (m.fixed ? "fixed_" : "") +
                            (m.prefetch ? "prefetch" : "ondemand");
    Put(key + "_step_s", f.step);
    Put(key + "_planner_s", p.step);
    Put(key + "_bound_s", bound);
    Put(key + "_out_gb", f.out_gb);
    Put(key + "_in_gb", f.in_gb);
    Put(key + "_hits", f.hits);
    Put(key + "_misses", f.misses);
    Put(key + "_wrong", static_cast<double>(f.wrong));
  }
}

const Mode kFree = {"no pressure (24 GiB)", false, false, false};
const Mode kFreePrefetch = {"no pressure, prefetch on", false, true, false};
const Mode kOnDemand = {"on demand", true, false, false};
const Mode kPrefetch = {"prefetch", true, true, false};

// 5. The two shapes in every mode, on a third of their peak.
void WorkloadTable(const WorkloadContext& ctx) {
  const std::vector<Mode> modes = {
      kFree, kFreePrefetch, kOnDemand, kPrefetch,
      {"fixed addresses, on demand", true, false, true},
      {"fixed addresses, prefetch", true, true, true}};
  WorkloadRows(ctx, "5a. Training workload, balanced", "bal_",
               TrainingShape(false), 3 * kGiB, modes);
  WorkloadRows(ctx, "5b. Training workload, link-bound", "link_",
               TrainingShape(true), 3 * kGiB, modes);
}

// 6. A long run: does prefetch keep its step time? (Each step's wasted
// prefetch once shortened one more key's look-ahead for good.)
void LongRun(const WorkloadContext& ctx) {
  workload::Shape shape = TrainingShape(false);
  shape.steps = 24;
  const size_t device = PeakBytes(shape) / 3 / (64 * kMiB) * (64 * kMiB);
  std::printf("\n6. Balanced at 3x for 24 steps: median step time of steps "
              "3-6 and 21-24 (GPU; planner)\n");
  for (const Mode& m : {kOnDemand, kPrefetch}) {
    workload::Result r;
    if (ctx.device != nullptr && !MeasureOnGpu(ctx, m, shape, device, &r)) {
      continue;
    }
    const workload::Result p = ReplayInPlanner(ctx, m, shape, device);
    const double early = MedianOfSteps(r.step_seconds, 2, 6);
    const double late = MedianOfSteps(r.step_seconds, 20, 24);
    const double planner_early = MedianOfSteps(p.step_seconds, 2, 6);
    const double planner_late = MedianOfSteps(p.step_seconds, 20, 24);
    std::printf("%-12s steps 3-6 %.3f s, 21-24 %.3f s (%lld wrong words); "
                "planner %.3f s, %.3f s\n",
                m.name, early, late, static_cast<long long>(r.errors),
                planner_early, planner_late);
    const std::string key = std::string("long3x_") +
                            (m.prefetch ? "prefetch" : "ondemand");
    Put(key + "_early_s", early);
    Put(key + "_late_s", late);
    Put(key + "_planner_early_s", planner_early);
    Put(key + "_planner_late_s", planner_late);
    Put(key + "_wrong", static_cast<double>(r.errors));
  }
}

// 6. The balanced shape at 2x, 4x and 6x its device, and a finer-grained
// one (four times the layers, a quarter of the bytes each).
void SweepTable(const WorkloadContext& ctx) {
  const std::vector<Mode> modes = {kFree, kOnDemand, kPrefetch};
  const workload::Shape shape = TrainingShape(false);
  for (int x : {2, 4, 6}) {
    const size_t device = PeakBytes(shape) / x / (64 * kMiB) * (64 * kMiB);
    WorkloadRows(ctx, "6. Balanced at " + std::to_string(x) + "x",
                 "sweep" + std::to_string(x) + "x_", shape, device, modes);
  }
  workload::Shape fine = shape;
  fine.layers = 128;
  fine.activation_bytes = 64 * kMiB;
  fine.weight_bytes = 8 * kMiB;
  fine.forward_seconds = 0.5e-3;
  fine.backward_seconds = 1e-3;
  WorkloadRows(ctx, "6. Fine-grained at 3x", "fine3x_", fine,
               PeakBytes(fine) / 3 / (64 * kMiB) * (64 * kMiB), modes);
  LongRun(ctx);
}

// ---- 7. the launch queue ----

// The planner models the host as spending a launch time per kernel (5 us)
// and blocking once the compute stream holds 1000 unfinished kernels
// (tflms/planner/replay.py, LAUNCH_QUEUE_DEPTH). Measured here: kernels of
// 200 us each are launched back to back; the host's time per launch while
// the queue fills, and how many launches pass before one blocks.
void LaunchQueueTable(cudaStream_t stream) {
  constexpr int kLaunches = 6000;
  workload::CudaKernels k(stream);
  k.Busy(1e-3);
  k.Synchronize();
  std::vector<double> t(kLaunches + 1);
  t[0] = Now();
  for (int i = 0; i < kLaunches; ++i) {
    k.Busy(200e-6);
    t[i + 1] = Now();
  }
  k.Synchronize();
  // The first launch that took longer than half a kernel: the host waited
  // for a slot in the queue.
  int depth = -1;
  for (int i = 1; i <= kLaunches; ++i) {
    if (t[i] - t[i - 1] > 100e-6) {
      depth = i - 1;
      break;
    }
  }
  std::vector<double> before;
  for (int i = 1; i <= (depth > 0 ? depth : kLaunches); ++i) {
    before.push_back(t[i] - t[i - 1]);
  }
  const double launch = Median(before);
  std::printf("\n7. Launch queue: %d kernels of 200 us launched back to back\n",
              kLaunches);
  std::printf("host time per launch while the queue fills: %.2f us (median)\n",
              launch * 1e6);
  if (depth > 0) {
    std::printf("launches before the host first blocked: %d\n", depth);
  } else {
    std::printf("the host never blocked in %d launches\n", kLaunches);
  }
  Put("launch_us", launch * 1e6);
  Put("launch_queue_depth", depth);
}

bool Has(const std::string& sections, char c) {
  return sections.find(c) != std::string::npos;
}

void WriteJson(const char* path, const std::string& device_name) {
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) return;
  std::fprintf(f, "{\n  \"device\": \"%s\"", device_name.c_str());
  for (const auto& kv : g_json) {
    std::fprintf(f, ",\n  \"%s\": %.6g", kv.first.c_str(), kv.second);
  }
  std::fprintf(f, "\n}\n");
  std::fclose(f);
}

}  // namespace
}  // namespace tflms

int main(int argc, char** argv) {
  using namespace tflms;
  const char* json = nullptr;
  bool predict_only = false;
  std::string sections = "1234567";
  double d2h = 0, h2d = 0;
  VmmCost vmm;
  // A number, not the next option: the map costs are optional.
  auto number = [&](int i, double* v) {
    if (i >= argc || argv[i][0] == '-') return false;
    char* end = nullptr;
    *v = std::strtod(argv[i], &end);
    return end != argv[i] && *end == '\0';
  };
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--predict-only") == 0) {
      predict_only = true;
      if (!number(i + 1, &d2h) || !number(i + 2, &h2d) || d2h <= 0 ||
          h2d <= 0) {
        std::fprintf(stderr,
                     "--predict-only needs the device-to-host and "
                     "host-to-device rates in GB/s, both above 0, e.g. "
                     "--predict-only 55.2 55.3 [MAP_US UNMAP_US]\n");
        return 2;
      }
      d2h *= 1e9;
      h2d *= 1e9;
      i += 2;
      double map_us = 0, unmap_us = 0;
      if (number(i + 1, &map_us) && number(i + 2, &unmap_us)) {
        vmm = {map_us * 1e-6, unmap_us * 1e-6};
        i += 2;
      }
    } else if (std::strcmp(argv[i], "--sections") == 0 && i + 1 < argc) {
      sections = argv[++i];
    } else {
      json = argv[i];
    }
  }
  if (predict_only) {
    WorkloadContext ctx;
    ctx.d2h_bps = d2h;
    ctx.h2d_bps = h2d;
    ctx.vmm = vmm;
    if (Has(sections, '5')) WorkloadTable(ctx);
    if (Has(sections, '6')) SweepTable(ctx);
    return 0;
  }
  Status status;
  std::unique_ptr<CudaDevice> device = CudaDevice::Create(0, &status);
  if (!device) {
    std::printf("skipped: %s\n", status.ToString().c_str());
    return 0;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("%s, %d multiprocessors, %.1f GiB, driver %d, runtime %d\n",
              prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / static_cast<double>(kGiB), driver,
              runtime);
  cudaStream_t stream = nullptr;
  if (!Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
             "stream") ||
      !device->UseComputeStream(stream).ok()) {
    return 1;
  }
  const auto raw = CopyBandwidthTable();
  if (raw.empty()) return 1;
  if (Has(sections, '2')) EngineCopyTable(device.get(), stream, raw);
  if (Has(sections, '3')) OverlapTable(device.get(), stream);
  WorkloadContext ctx;
  ctx.device = device.get();
  ctx.stream = stream;
  // The workloads move 64 and 256 MiB buffers: table 1's rates at 256 MiB
  // (the same within 0.1% as at 64 MiB on the H200).
  ctx.d2h_bps = raw.back().second.d2h;
  ctx.h2d_bps = raw.back().second.h2d;
  ctx.vmm = VmmTable(device.get());
  ctx.per_byte = MeasureFillPerByte(stream);
  Put("fill_kernel_gbps", 1e-9 / ctx.per_byte);
  if (Has(sections, '5')) WorkloadTable(ctx);
  if (Has(sections, '6')) SweepTable(ctx);
  if (Has(sections, '7')) LaunchQueueTable(stream);
  if (json != nullptr) WriteJson(json, prop.name);
  device.reset();
  cudaStreamDestroy(stream);
  return 0;
}
