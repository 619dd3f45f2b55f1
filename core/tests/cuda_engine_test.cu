// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The engine over CudaDevice on a real GPU:
//   * round trip: an oversubscribed working set written and read back by the
//     host (synchronous access), paged out and in, defragmented;
//   * fixed-address round trip: the same over CUDA virtual memory
//     management, every buffer back at its own address;
//   * scattered host copy: a page-out into a host pool whose free bytes lie
//     in two holes, DMA'd in two pieces and paged back in from them;
//   * gathered group: small buffers strewn over the device, named as a group
//     before their pins, paged out and back into one run (gather.cc);
//   * slide with the host full: a buffer copied down over its own range in
//     pieces (defrag.cc, SlideFor), so the holes around it join;
//   * training workload (training_workload.h): CUDA kernels on the engine's
//     compute stream write and check every word while the engine pages,
//     prefetches, defragments or remaps behind them, the host running ahead
//     of the GPU as TensorFlow's executor does. Any missing stream order
//     (a copy before its writer, a kernel before its page-in, a chunk reused
//     under a queued reader) shows as wrong words.
// Without a GPU it prints why and exits 0 ("skipped"), so `make cuda-test`
// builds and links everywhere nvcc exists.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_device.h"
#include "cuda_kernels.cuh"
#include "tflms/engine.h"
#include "training_workload.h"

namespace tflms {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
int g_failed = 0;

void Report(const char* name, bool ok, const std::string& detail) {
  std::printf("[%s] %s: %s\n", ok ? " OK " : "FAIL", name, detail.c_str());
  if (!ok) ++g_failed;
}

EngineOptions BaseOptions() {
  EngineOptions options;
  options.memory_limit = 64 * kMiB;
  options.host_memory_limit = size_t{1} << 30;
  options.defrag_enabled = true;
  options.verify_moves = true;
  return options;
}

// A 1 MiB device taken as one region up front (TensorFlow's default), so that
// buffers lie in the order they were made.
EngineOptions OneRegionOptions(size_t host_memory_limit) {
  EngineOptions options;
  options.memory_limit = kMiB;
  options.host_memory_limit = host_memory_limit;
  options.allow_growth = false;
  return options;
}

void RoundTrip(CudaDevice* device) {
  Engine engine(device, BaseOptions());
  Status status = engine.Init();
  if (!status.ok()) return Report("round trip", false, status.ToString());
  const size_t size = 4 * kMiB;
  std::vector<Buffer*> buffers;
  std::vector<std::string> data;
  int corrupt = 0;
  for (int i = 0; i < 128; ++i) {  // 512 MiB live on a 64 MiB device
    Buffer* b = engine.AllocateBuffer(size, false, &status);
    if (b == nullptr) return Report("round trip", false, status.ToString());
    data.emplace_back(size, static_cast<char>(i * 7 + 1));
    if (!engine.WriteBuffer(b, 0, data.back().data(), size).ok()) ++corrupt;
    buffers.push_back(b);
  }
  std::string got(size, '\0');
  for (size_t i = 0; i < buffers.size(); ++i) {
    status = engine.ReadBuffer(buffers[i], 0, &got[0], size);
    if (!status.ok() || got != data[i]) ++corrupt;
  }
  size_t moved = 0;
  if (!engine.Defragment(&moved).ok()) ++corrupt;
  for (size_t i = 0; i < buffers.size(); ++i) {
    status = engine.ReadBuffer(buffers[i], 0, &got[0], size);
    if (!status.ok() || got != data[i]) ++corrupt;
  }
  const EngineStats st = engine.GetStats();
  const bool invariants_ok = engine.CheckInvariants().ok();
  for (Buffer* b : buffers) engine.FreeBuffer(b);
  Report("round trip", corrupt == 0 && invariants_ok && st.bytes_reclaimed > 0,
         std::to_string(corrupt) + " corrupt, " +
             std::to_string(st.bytes_reclaimed) + " bytes reclaimed, " +
             std::to_string(st.bytes_paged_in) + " paged in, " +
             std::to_string(moved) + " defragmented");
}

void ScatteredHostCopy(CudaDevice* device) {
  // A, B, C go to the host in that order and A and C are freed: the 1 MiB
  // host pool's free 824 KiB are two holes, and D (700 KiB) needs both.
  EngineOptions options;
  options.memory_limit = kMiB;
  options.host_memory_limit = kMiB;
  options.verify_pins = true;
  Engine engine(device, options);
  Status status = engine.Init();
  if (!status.ok()) return Report("scattered host copy", false, status.ToString());
  std::vector<Buffer*> abc;
  std::vector<std::string> data;
  int corrupt = 0;
  for (size_t size : {400 * 1024, 200 * 1024, 400 * 1024}) {
    abc.push_back(engine.AllocateBuffer(size, false, &status));
    if (abc.back() == nullptr) return Report("scattered host copy", false, status.ToString());
    data.emplace_back(size, static_cast<char>(size / 1024));
    if (!engine.WriteBuffer(abc.back(), 0, data.back().data(), size).ok()) ++corrupt;
  }
  size_t reclaimed = 0;
  if (!engine.ReclaimInactive(&reclaimed).ok()) ++corrupt;
  engine.FreeBuffer(abc[0]);
  engine.FreeBuffer(abc[2]);
  Buffer* d = engine.AllocateBuffer(700 * 1024, false, &status);
  if (d == nullptr) return Report("scattered host copy", false, status.ToString());
  std::string dbytes(700 * 1024, '\0');
  for (size_t i = 0; i < dbytes.size(); ++i) dbytes[i] = static_cast<char>(i * 131 + 7);
  if (!engine.WriteBuffer(d, 0, dbytes.data(), dbytes.size()).ok()) ++corrupt;
  status = engine.ReclaimInactive(&reclaimed);
  const bool paged_out = status.ok() &&
                         engine.GetBufferState(d) == BufferState::kReclaimed &&
                         engine.GetStats().host_bytes_in_use == 900 * 1024;
  std::string got(dbytes.size(), '\0');
  if (!engine.ReadBuffer(d, 0, &got[0], got.size()).ok() || got != dbytes) ++corrupt;
  got.assign(data[1].size(), '\0');
  if (!engine.ReadBuffer(abc[1], 0, &got[0], got.size()).ok() || got != data[1]) ++corrupt;
  const bool invariants_ok = engine.CheckInvariants().ok();
  engine.FreeBuffer(d);
  engine.FreeBuffer(abc[1]);
  Report("scattered host copy",
         paged_out && corrupt == 0 && invariants_ok &&
             engine.GetStats().host_bytes_in_use == 0,
         std::string(paged_out ? "paged out in pieces" : "NOT paged out: " + status.ToString()) +
             ", " + std::to_string(corrupt) + " corrupt");
}

void GatheredGroup(CudaDevice* device) {
  // 31 buffers of 4 KiB lie between 28 KiB ones over a 1 MiB device; pinned
  // where they lie they leave no gap for their 124 KiB together. Named as a
  // group first, they are paged out and back into one run over the DMA
  // engines, every byte intact, and the 124 KiB allocation fits.
  constexpr size_t kSmall = 4 * 1024, kBig = 28 * 1024, kCount = 31;
  EngineOptions options = OneRegionOptions(4 * kMiB);
  options.verify_pins = true;
  Engine engine(device, options);
  Status status = engine.Init();
  if (!status.ok()) return Report("gathered group", false, status.ToString());
  std::vector<Buffer*> bigs, smalls;
  std::vector<std::string> data;
  int corrupt = 0;
  for (size_t i = 0; i < kCount; ++i) {
    bigs.push_back(engine.AllocateBuffer(kBig, false, &status));
    smalls.push_back(engine.AllocateBuffer(kSmall, false, &status));
    if (bigs.back() == nullptr || smalls.back() == nullptr) {
      return Report("gathered group", false, status.ToString());
    }
    data.emplace_back(kSmall, static_cast<char>(i * 37 + 1));
    if (!engine.WriteBuffer(smalls.back(), 0, data.back().data(), kSmall).ok()) ++corrupt;
  }
  engine.GatherForPins(smalls.data(), smalls.size());
  std::vector<char*> at;
  for (Buffer* b : smalls) {
    void* p = nullptr;
    if (!engine.Pin(b, &p).ok()) ++corrupt;
    at.push_back(static_cast<char*>(p));
  }
  Buffer* out = engine.AllocateBuffer(kCount * kSmall, true, &status);
  const auto [lo, hi] = std::minmax_element(at.begin(), at.end());
  const bool together = static_cast<size_t>(*hi - *lo) == (kCount - 1) * kSmall;
  if (out != nullptr) {
    engine.Unpin(out);
    engine.FreeBuffer(out);
  }
  for (Buffer* b : smalls) engine.Unpin(b);
  std::string got(kSmall, '\0');
  for (size_t i = 0; i < kCount; ++i) {
    if (!engine.ReadBuffer(smalls[i], 0, &got[0], kSmall).ok() || got != data[i]) ++corrupt;
  }
  const EngineStats st = engine.GetStats();
  const bool invariants_ok = engine.CheckInvariants().ok();
  for (Buffer* b : smalls) engine.FreeBuffer(b);
  for (Buffer* b : bigs) engine.FreeBuffer(b);
  Report("gathered group",
         out != nullptr && together && st.num_group_gathers == 1 && corrupt == 0 &&
             invariants_ok,
         std::string(out != nullptr ? "output fits" : "NO room: " + status.ToString()) +
             ", " + std::to_string(st.bytes_group_gathered) + " bytes gathered, " +
             (together ? "in one run" : "NOT in one run") + ", " + std::to_string(corrupt) +
             " corrupt");
}

void SlideWithTheHostFull(CudaDevice* device) {
  // A 256, B 256 and C 192 KiB lie between holes of 160 KiB on a 1 MiB
  // device, and the 128 KiB host pool takes none of them: the 288 KiB
  // request fits once B slides down into the hole below it, copied in two
  // pieces whose destination overlaps B's own range, each after the last on
  // the compute stream. Every byte of A, B and C is read back.
  constexpr size_t kK = 1024;
  EngineOptions options = OneRegionOptions(128 * kK);
  options.verify_moves = true;
  Engine engine(device, options);
  Status status = engine.Init();
  if (!status.ok()) return Report("slide with the host full", false, status.ToString());
  std::vector<Buffer*> all;
  for (size_t size : {256 * kK, 160 * kK, 256 * kK, 160 * kK, 192 * kK}) {
    all.push_back(engine.AllocateBuffer(size, false, &status));
    if (all.back() == nullptr) return Report("slide with the host full", false, status.ToString());
  }
  Buffer* const kept[] = {all[0], all[2], all[4]};
  std::vector<std::string> data;
  int corrupt = 0;
  for (Buffer* b : kept) {
    const size_t size = b == all[4] ? 192 * kK : 256 * kK;
    data.emplace_back(size, '\0');
    for (size_t i = 0; i < size; ++i) data.back()[i] = static_cast<char>(i * 131 + data.size());
    if (!engine.WriteBuffer(b, 0, data.back().data(), size).ok()) ++corrupt;
  }
  engine.FreeBuffer(all[1]);
  engine.FreeBuffer(all[3]);
  Buffer* out = engine.AllocateBuffer(288 * kK, false, &status);
  std::string got;
  for (size_t i = 0; i < 3; ++i) {
    got.assign(data[i].size(), '\0');
    if (!engine.ReadBuffer(kept[i], 0, &got[0], got.size()).ok() || got != data[i]) ++corrupt;
  }
  const EngineStats st = engine.GetStats();
  const bool invariants_ok = engine.CheckInvariants().ok();
  if (out != nullptr) engine.FreeBuffer(out);
  for (Buffer* b : kept) engine.FreeBuffer(b);
  Report("slide with the host full",
         out != nullptr && st.num_host_full_defrags == 1 && st.bytes_reclaimed == 0 &&
             corrupt == 0 && invariants_ok,
         std::string(out != nullptr ? "output fits" : "NO room: " + status.ToString()) +
             ", " + std::to_string(st.bytes_defragged) + " bytes slid, " +
             std::to_string(corrupt) + " corrupt");
}

void SwapInPlace(CudaDevice* device) {
  // X (512 KiB) on the host fills the 512 KiB pool; V 512 KiB inactive and
  // P 256 KiB pinned on the 1 MiB device, 256 KiB free. No whole copy
  // brings X in; pinning X trades it with V through the free 256 KiB (two
  // pieces of device-to-device, host-to-device and device-to-host copies,
  // in order on the compute stream). Then pinning V swaps them back. Every
  // byte of X, V and P is read back.
  constexpr size_t kK = 1024;
  const char* name = "swap in place";
  EngineOptions options = OneRegionOptions(512 * kK);
  options.verify_moves = true;
  Engine engine(device, options);
  Status status = engine.Init();
  if (!status.ok()) return Report(name, false, status.ToString());
  Buffer* x = engine.AllocateBuffer(512 * kK, false, &status);
  Buffer* p = x != nullptr ? engine.AllocateBuffer(256 * kK, true, &status) : nullptr;
  if (p == nullptr) return Report(name, false, status.ToString());
  std::vector<std::string> data;
  for (size_t size : {512 * kK, 256 * kK, 512 * kK}) {
    data.emplace_back(size, '\0');
    for (size_t i = 0; i < size; ++i) data.back()[i] = static_cast<char>(i * 131 + data.size());
  }
  int corrupt = 0;
  if (!engine.WriteBuffer(x, 0, data[0].data(), data[0].size()).ok()) ++corrupt;
  if (!engine.WriteBuffer(p, 0, data[1].data(), data[1].size()).ok()) ++corrupt;
  Buffer* v = engine.AllocateBuffer(512 * kK, false, &status);  // X leaves
  if (v == nullptr) return Report(name, false, status.ToString());
  if (!engine.WriteBuffer(v, 0, data[2].data(), data[2].size()).ok()) ++corrupt;
  void* ptr = nullptr;
  Status pin_x = engine.Pin(x, &ptr);
  if (pin_x.ok()) engine.Unpin(x);
  Status pin_v = engine.Pin(v, &ptr);
  if (pin_v.ok()) engine.Unpin(v);
  std::string got;
  Buffer* const all[] = {x, p, v};
  for (size_t i = 0; i < 3; ++i) {
    got.assign(data[i].size(), '\0');
    if (!engine.ReadBuffer(all[i], 0, &got[0], got.size()).ok() || got != data[i]) ++corrupt;
  }
  const EngineStats st = engine.GetStats();
  engine.Unpin(p);
  const bool invariants_ok = engine.CheckInvariants().ok();
  for (Buffer* b : all) engine.FreeBuffer(b);
  Report(name,
         pin_x.ok() && pin_v.ok() && st.num_swaps_in_place >= 2 && corrupt == 0 &&
             invariants_ok,
         (pin_x.ok() && pin_v.ok() ? std::string("both pins fit")
                                   : "pin failed: " + (pin_x.ok() ? pin_v : pin_x).ToString()) +
             ", " + std::to_string(st.num_swaps_in_place) + " swaps, " +
             std::to_string(corrupt) + " corrupt");
}

void FixedAddressRoundTrip(CudaDevice* device) {
  if (device->VmGranularity() == 0) {
    std::printf("fixed-address round trip skipped: no CUDA VMM here\n");
    return;
  }
  EngineOptions fo = BaseOptions();
  fo.fixed_addresses = true;
  fo.page_size = std::max<size_t>(device->VmGranularity(), 2 * kMiB);
  Engine fixed(device, fo);
  Status status = fixed.Init();
  if (!status.ok()) {
    return Report("fixed-address round trip", false, status.ToString());
  }
  const size_t size = 4 * kMiB;
  std::vector<Buffer*> fb;
  std::vector<void*> addrs;
  std::vector<std::string> data;
  int bad = 0;
  for (int i = 0; i < 64; ++i) {  // 256 MiB live on 64 MiB of pages
    void* addr = nullptr;
    Buffer* b = fixed.AllocateBuffer(size, false, &status, &addr);
    if (b == nullptr) {
      return Report("fixed-address round trip", false, status.ToString());
    }
    data.emplace_back(size, static_cast<char>(i * 5 + 3));
    if (!fixed.WriteBuffer(b, 0, data.back().data(), size).ok()) ++bad;
    fb.push_back(b);
    addrs.push_back(addr);
  }
  std::string got(size, '\0');
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < fb.size(); ++i) {
      void* p = nullptr;
      if (!fixed.Pin(fb[i], &p).ok() || p != addrs[i]) ++bad;
      fixed.Unpin(fb[i]);
      status = fixed.ReadBuffer(fb[i], 0, &got[0], size);
      if (!status.ok() || got != data[i]) ++bad;
    }
  }
  const EngineStats fs = fixed.GetStats();
  if (!fixed.CheckInvariants().ok()) ++bad;
  for (Buffer* b : fb) fixed.FreeBuffer(b);
  Report("fixed-address round trip", bad == 0 && fs.num_pages_unmapped > 0,
         std::to_string(bad) + " bad, " + std::to_string(fs.num_pages_mapped) +
             " pages mapped, " + std::to_string(fs.num_pages_unmapped) +
             " unmapped, " + std::to_string(fs.bytes_reclaimed) +
             " bytes reclaimed");
}

// The workload in one engine mode: 24 layers of 32 MiB activations and
// 4 MiB weights (about 0.9 GiB at the peak) on 256 MiB, kernels spinning
// 1 ms forward and 2 ms backward per layer so the host runs ahead of them.
void Workload(CudaDevice* device, cudaStream_t stream, const char* name,
              bool prefetch, bool defrag, bool fixed) {
  if (fixed && device->VmGranularity() == 0) return;
  EngineOptions options = BaseOptions();
  options.memory_limit = 256 * kMiB;
  options.host_memory_limit = size_t{4} << 30;
  options.prefetch_enabled = prefetch;
  options.defrag_enabled = defrag;
  options.fixed_addresses = fixed;
  options.page_size = std::max<size_t>(device->VmGranularity(), 2 * kMiB);
  options.virtual_address_bytes = size_t{2} << 30;  // room for the 0.9 GiB
  // Fixed-address mode has no step plan, only the look-ahead, which skips
  // tensors over its budget (1/8 of the device by default).
  if (fixed) options.prefetch_budget_bytes = 96 * kMiB;
  Engine engine(device, options);
  Status status = engine.Init();
  if (!status.ok()) return Report(name, false, status.ToString());
  workload::Shape shape(24, 32 * kMiB, 4 * kMiB, 4, 1e-3, 2e-3);
  shape.defragment = defrag;
  workload::CudaKernels kernels(stream);
  const workload::Result r = workload::Run(&engine, &kernels, shape);
  const EngineStats& st = r.stats;
  bool ok = r.status.ok() && r.errors == 0 &&
            r.checked == shape.steps * (5 * shape.layers - 2) &&
            st.bytes_reclaimed > 0 && st.num_page_ins > 0 &&
            engine.CheckInvariants().ok();
  if (prefetch) ok = ok && st.prefetch_hits > 0;
  if (defrag) ok = ok && st.num_defragmentations > 0;
  char detail[512];
  std::snprintf(
      detail, sizeof(detail),
      "%s, %lld wrong words in %lld checks; %.2f GB out, %.2f GB in, "
      "%lld prefetch hits, %lld misses, %lld defragmentations; last step "
      "%.3f s",
      r.status.ToString().c_str(), static_cast<long long>(r.errors),
      static_cast<long long>(r.checked), st.bytes_reclaimed / 1e9,
      st.bytes_paged_in / 1e9, static_cast<long long>(st.prefetch_hits),
      static_cast<long long>(st.prefetch_misses),
      static_cast<long long>(st.num_defragmentations),
      r.step_seconds.empty() ? 0.0 : r.step_seconds.back());
  Report(name, ok, detail);
}

}  // namespace
}  // namespace tflms

int main() {
  using namespace tflms;
  Status status;
  std::unique_ptr<CudaDevice> device = CudaDevice::Create(0, &status);
  if (!device) {
    std::printf("skipped: %s\n", status.ToString().c_str());
    return 0;
  }
  // Kernels run on a stream the test owns, as TensorFlow's do on its own.
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) !=
          cudaSuccess ||
      !(status = device->UseComputeStream(stream)).ok()) {
    std::printf("compute stream: %s\n", status.ToString().c_str());
    return 1;
  }
  RoundTrip(device.get());
  ScatteredHostCopy(device.get());
  GatheredGroup(device.get());
  SlideWithTheHostFull(device.get());
  SwapInPlace(device.get());
  FixedAddressRoundTrip(device.get());
  Workload(device.get(), stream, "workload, on demand", false, false, false);
  Workload(device.get(), stream, "workload, prefetch", true, false, false);
  Workload(device.get(), stream, "workload, defragmentation", false, true,
           false);
  Workload(device.get(), stream, "workload, fixed addresses", false, false,
           true);
  Workload(device.get(), stream, "workload, fixed addresses + prefetch", true,
           false, true);
  device.reset();  // synchronizes its streams before ours goes
  cudaStreamDestroy(stream);
  std::printf("%s\n", g_failed == 0 ? "all passed" : "FAILED");
  return g_failed == 0 ? 0 : 1;
}
