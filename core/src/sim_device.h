// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// SimDevice: a Device whose "GPU memory" is a host arena.
//
// Two jobs, one backend:
//   * Correctness (tests): with store_data, device and host memory are real
//     bytes; each stream is a worker thread running its queue in order;
//     events complete when a worker reaches them; WaitEvent blocks a worker,
//     never the host. Races between streams are real races, which is what
//     the engine's ordering must prevent.
//   * Prediction (planner): every operation also advances a modelled clock.
//     A stream operation starts at max(the stream's clock, the host's clock,
//     the events it waits for) and takes latency + bytes / bandwidth (copies)
//     or the given seconds (Compute). Host-blocking waits advance the host's
//     clock. Without store_data no bytes exist (addresses are synthetic and
//     never dereferenced) and streams run inline, so 80 GiB GPUs can be
//     modelled on a laptop with the same engine code.
//     The host thread is modelled as CUDA runs it: it blocks exactly where a
//     real host blocks. SynchronizeEvent waits for the event's modelled
//     completion; EventDone answers by the modelled clock too (an event is
//     done only once the host's clock has reached it, however the inline
//     streams ran, and once it has, after the stream's worker thread caught
//     up, unless a test injects real-time copy delays or pacing), so the
//     engine takes the same branch it would on a GPU;
//     and with launch_queue_depth set, a kernel enqueued on the compute
//     stream while that many are still unfinished blocks the host until the
//     oldest finishes (CUDA's per-stream launch queue): the host runs ahead
//     of the GPU by a bounded amount of work, not by a whole step.
// Fault injection makes copies, device allocations or host allocations fail
// on demand, to prove that the engine loses nothing when they do.
//
// Virtual memory (fixed-address mode): one reserved range at a time, made
// with mmap(PROT_NONE) (no access, no memory); MapPages makes pages
// accessible (mprotect), UnmapPages discards their bytes and protects them
// again (mmap MAP_FIXED PROT_NONE over them), so a kernel -- any host code
// in the sim -- touching an evicted buffer faults at once instead of reading
// stale bytes. Mapped pages count against device_memory, as physical pages
// do on a GPU; map and unmap failures can be injected. Copies and
// synchronous accesses to the range are checked against the mapped pages
// when enqueued (an engine bug shows as an error, not only as a crash).
// Without store_data the range is synthetic: only the bookkeeping runs.
// The VM methods are all or nothing.
//
// Thread safety: all methods are thread-safe. clock_mu_ guards the modelled
// clocks; each stream's queue has its own lock; arena_mu_ guards the
// sub-allocation maps; vm_mu_ the virtual range's page map. No two of these
// are held at once.
#ifndef TFLMS_CORE_SRC_SIM_DEVICE_H_
#define TFLMS_CORE_SRC_SIM_DEVICE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tflms/device.h"

namespace tflms {

struct SimOptions {
  size_t device_memory = 0;
  bool store_data = true;
  double link_bytes_per_second = 24e9;    // host link, each direction
  double link_latency_seconds = 10e-6;    // per copy
  double device_bytes_per_second = 1.5e12;  // device-to-device copies
  // Modelled host time of MapPages / UnmapPages per page: driver calls
  // (cuMemMap + cuMemSetAccess, cuMemUnmap) that block the calling thread.
  // 0 = free; the planner states what it assumes until a GPU measures it.
  double map_seconds_per_page = 0;
  double unmap_seconds_per_page = 0;
  // Modelled host time of a layout look (NoteLayoutLook) per step event it
  // models and per free range it scans: the engine's own work at a pin,
  // which holds back the kernels the host launches after it. 0 = free.
  double layout_look_seconds_per_event = 0;
  double layout_look_seconds_per_range = 0;
  // Kernels and copies the compute stream may hold unfinished before the
  // next one enqueued blocks the host until the oldest completes (CUDA's
  // launch queue; no documented size, about 1000 measured). 0 = unlimited.
  int launch_queue_depth = 0;
};

struct SimTimeline {
  double host_time = 0;
  double compute_time = 0;   // compute stream clock
  double d2h_time = 0;       // device-to-host stream clock
  double h2d_time = 0;
  double d2h_busy = 0;       // seconds of link time used
  double h2d_busy = 0;
  double compute_busy = 0;
  double compute_stall = 0;  // compute stream waiting for page-ins
  double host_sync_wait = 0;    // host blocked in SynchronizeEvent
  double host_launch_wait = 0;  // host blocked on a full launch queue
  int64_t d2h_bytes = 0;
  int64_t h2d_bytes = 0;
  int64_t d2d_bytes = 0;
};

// One host link copy as the modelled GPU runs it (SimDevice::TakeCopies).
struct SimCopy {
  StreamKind stream = StreamKind::kDeviceToHost;  // or kHostToDevice
  double start = 0;  // modelled seconds, on SimTimeline's clock
  double end = 0;
  size_t bytes = 0;
};

class SimDevice : public Device {
 public:
  explicit SimDevice(const SimOptions& options);
  ~SimDevice() override;

  const char* Name() const override { return "sim"; }
  void* AllocateDeviceMemory(size_t bytes, size_t alignment) override;
  void FreeDeviceMemory(void* ptr, size_t bytes) override;
  void* AllocateHostMemory(size_t bytes) override;
  void FreeHostMemory(void* ptr, size_t bytes) override;
  Stream* GetStream(StreamKind kind) override;
  Status CopyDeviceToHost(Stream* stream, void* host_dst,
                          const void* device_src, size_t bytes) override;
  Status CopyHostToDevice(Stream* stream, void* device_dst,
                          const void* host_src, size_t bytes) override;
  Status CopyDeviceToDevice(Stream* stream, void* device_dst,
                            const void* device_src, size_t bytes) override;
  EventRef RecordEvent(Stream* stream, Status* status) override;
  Status WaitEvent(Stream* stream, const EventRef& event) override;
  Status SynchronizeEvent(const EventRef& event) override;
  bool EventDone(const EventRef& event) override;
  Status ReadDeviceSync(void* host_dst, const void* device_src,
                        size_t bytes) override;
  Status WriteDeviceSync(void* device_dst, const void* host_src,
                         size_t bytes) override;

  size_t VmGranularity() const override;
  Status ReserveAddressRange(size_t bytes, size_t page_size,
                             void** base) override;
  Status ReleaseAddressRange(void* base, size_t bytes) override;
  void NoteLayoutLook(int64_t events, int64_t ranges_scanned) override;
  Status MapPages(void* addr, size_t bytes) override;
  Status UnmapPages(void* addr, size_t bytes) override;
  // Bytes of the virtual range currently backed (tests check the engine's
  // page accounting against it).
  int64_t mapped_bytes() const;
  // True if every page of [ptr, ptr + bytes) is mapped.
  bool IsMapped(const void* ptr, size_t bytes) const;

  // ---- fault injection ----
  // The next `n` MapPages / UnmapPages calls fail, changing nothing.
  void FailNextMaps(int n) { fail_maps_ = n; }
  void FailNextUnmaps(int n) { fail_unmaps_ = n; }
  // The next `n` copies enqueued on streams of `kind` fail asynchronously.
  void FailNextCopies(StreamKind kind, int n);
  // Every later copy on streams of `kind` first sleeps this long (really, not
  // on the modelled clock), so tests can catch readers that do not wait.
  void DelayCopies(StreamKind kind, int microseconds);
  // Every later copy on streams of `kind` also sleeps bytes / bytes_per_second
  // (0: no pacing): a link of that bandwidth in real time, so code that runs
  // on real threads against store_data memory (the tfcpu harness) waits for
  // copies as it would on a GPU instead of seeing them land at memcpy speed.
  void PaceCopies(StreamKind kind, double bytes_per_second);
  void RefuseDeviceAllocations(bool refuse) { refuse_device_ = refuse; }
  void RefuseHostAllocations(bool refuse) { refuse_host_ = refuse; }

  // ---- modelled time ----
  void Compute(double seconds);
  // A kernel: `body` runs on the compute stream after everything enqueued
  // there before it (with store_data, on the stream's worker thread, so it
  // races with the copy streams exactly as a GPU kernel would), and the
  // modelled compute clock advances by `seconds` as Compute does.
  void Launch(std::function<void()> body, double seconds);
  void HostAdvance(double seconds);
  // The modelled host clock (SimTimeline::host_time).
  double NowSeconds() override;
  // Host waits for every stream (real and modelled).
  void SynchronizeAll();
  SimTimeline GetTimeline() const;
  // From now on keeps every host link copy's modelled start and end, for a
  // timeline of the links on the GPU's clock (off by default: a replay
  // makes hundreds of thousands).
  void RecordCopies(bool on);
  // The copies recorded since the last call, in the order they were
  // enqueued (not the order they ran).
  std::vector<SimCopy> TakeCopies();

  // Host bytes currently allocated through AllocateHostMemory (leak checks).
  int64_t host_bytes_allocated() const { return host_bytes_allocated_; }
  bool store_data() const { return options_.store_data; }

  class SimStream;
  class SimEvent;

 private:
  Status EnqueueCopy(Stream* stream, void* dst, const void* src, size_t bytes,
                     double bytes_per_second);
  bool InArena(const void* ptr, size_t bytes) const;
  // InArena, or wholly inside mapped pages of the virtual range.
  bool InDevice(const void* ptr, size_t bytes) const;
  static bool TakeFault(std::atomic<int>* counter);
  // Whether any stream's copies are delayed or paced in real time.
  bool RealTimeCopiesInjected() const;

  const SimOptions options_;
  char* arena_ = nullptr;  // owned when store_data (a mapping of arena_bytes_)
  size_t arena_bytes_ = 0;
  char* base_ = nullptr;   // device addresses start here

  mutable std::mutex arena_mu_;
  std::map<size_t, size_t> free_ranges_;  // offset -> size; guarded

  std::atomic<bool> refuse_device_{false};
  std::atomic<bool> refuse_host_{false};
  std::atomic<int> fail_copies_[3];
  std::atomic<int> copy_delay_us_[3] = {0, 0, 0};
  std::atomic<double> copy_pace_bps_[3] = {0.0, 0.0, 0.0};
  // When each stream's paced link is next free; touched only by that
  // stream's worker thread (one stream per kind), so it needs no lock.
  std::chrono::steady_clock::time_point link_free_at_[3];
  std::atomic<int64_t> host_bytes_allocated_{0};
  std::atomic<uintptr_t> next_fake_host_{uintptr_t{1} << 44};

  std::unique_ptr<SimStream> streams_[3];

  // [p, p + bytes) as whole pages of the reserved range: first page, count.
  // REQUIRES: vm_mu_ held.
  Status PageSpan(const char* what, const char* p, size_t bytes, size_t* lo,
                  size_t* n) const;

  mutable std::mutex vm_mu_;
  char* vm_base_ = nullptr;          // guarded by vm_mu_
  size_t vm_bytes_ = 0;              // guarded by vm_mu_
  size_t vm_page_ = 0;               // guarded by vm_mu_
  std::vector<uint8_t> vm_mapped_;   // per page; guarded by vm_mu_
  size_t vm_mapped_pages_ = 0;       // guarded by vm_mu_
  std::atomic<int> fail_maps_{0};
  std::atomic<int> fail_unmaps_{0};

  // Makes room in the launch queue for one more compute-stream operation:
  // the host waits for the oldest unfinished one if the queue is full.
  // REQUIRES: clock_mu_ held.
  void WaitForLaunchSlotLocked();

  mutable std::mutex clock_mu_;
  SimTimeline clock_;  // guarded by clock_mu_
  // Modelled completion times of the compute-stream operations enqueued and
  // not known finished at the host's clock, oldest first; guarded by
  // clock_mu_. Only kept with a launch_queue_depth.
  std::deque<double> launched_;
  bool record_copies_ = false;    // guarded by clock_mu_
  std::vector<SimCopy> copies_;   // guarded by clock_mu_
};

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_SIM_DEVICE_H_
