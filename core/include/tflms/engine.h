// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The LMS engine: a BFC allocator that can move inactive tensor buffers to
// host memory and back.
//
// Two kinds of allocation live in one BFC arena:
//   * raw allocations (AllocateRaw): scratch, workspaces, anything without an
//     owner. Never moved, never reclaimed; always counted as active.
//   * buffers (AllocateBuffer): owned by a tensor. A buffer is
//       active      pinned (pin count > 0) or unmovable (its address escaped);
//       inactive    resident and unpinned, on the LRU list, reclaimable;
//       reclaimed   its bytes live in host memory, no device chunk.
//     Pin() returns the buffer's current device address, paging it in first
//     when needed. The address may change whenever the buffer is unpinned
//     (page-out/page-in, defragmentation), so callers must re-read it after
//     every Pin().
//
// When an allocation does not fit the engine tries, in order: a single
// reclaim, defragmentation (if enabled), a fragments reclaim, a full reclaim,
// and then fails with a message that names the cause (see reclaim.cc for why
// defragmentation runs before the costly reclaims).
//
// Fixed-address mode (EngineOptions::fixed_addresses, for the add-on to the
// stock TensorFlow wheel, which cannot give a live tensor a new address): the
// arena hands out addresses in a reserved virtual range larger than the
// device, and the device backs pages of it with physical memory
// (Device::MapPages). A buffer keeps its address for its whole life: eviction
// copies its bytes to host and unmaps the pages no resident allocation
// shares; page-in maps free physical pages back at the same address and
// copies the bytes in. Pin therefore always returns the same address, a
// touch of an evicted buffer's unmapped pages faults, and physical
// fragmentation does not exist (any page backs any address): defrag_enabled
// is ignored and Defragment() moves nothing. See fixed_address.cc.
//
// Thread safety: every public method may be called from any thread. One
// mutex guards the arena and all buffer state; it is never held across a
// copy or a host-blocking wait (see engine_impl.h).
#ifndef TFLMS_CORE_ENGINE_H_
#define TFLMS_CORE_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tflms/device.h"
#include "tflms/stats.h"
#include "tflms/status.h"

namespace tflms {

// The most EngineOptions::run_ahead_epochs may be. The engine keeps the event
// of each of the last kMaxRunAheadEpochs + 1 closed epochs (Impl's ring), and
// the host waits for the event of the epoch that many closes back, which must
// still be in the ring. Every layer that takes the setting (the patch's
// TF_LMS_RUN_AHEAD_EPOCHS, tflms.Engine, `tflms simulate`) checks it against
// this one constant.
inline constexpr int kMaxRunAheadEpochs = 63;

// EngineOptions::unfragmented: the arena manages this many times
// memory_limit in addresses; the device the engine runs on must hold them.
inline constexpr size_t kUnfragmentedAddressFactor = 4;

struct EngineOptions {
  std::string name = "lms";
  // Device bytes the allocator may take from the device (TF's memory limit).
  size_t memory_limit = 0;
  // Grow regions on demand (TF's allow_growth) instead of one big region.
  bool allow_growth = true;
  // TF's GPUOptions.Experimental.internal_fragmentation_fraction; 0 keeps
  // TF's default of 128 MiB of tolerated padding.
  double fragmentation_fraction = 0.0;
  // Before failing, return regions that hold no allocation to the device
  // and grow one big enough (TF's BFC garbage_collection; TensorFlow's GPU
  // allocator enables it unless TF_ENABLE_GPU_GARBAGE_COLLECTION=false).
  bool garbage_collection = true;

  bool lms_enabled = true;
  // Reclaim once this many device bytes are in use (PyTorch LMS's
  // set_limit_lms). 0 means memory_limit.
  size_t lms_limit = 0;
  // Bytes of host memory reclaimed buffers may occupy. 0 = no limit of the
  // engine's own (inside TensorFlow the host allocator enforces
  // TF_GPU_HOST_MEM_LIMIT_IN_MB).
  size_t host_memory_limit = 0;

  bool defrag_enabled = false;
  // Compare source and destination after every defragmentation move. Costs a
  // device-to-host copy of both; on by default in tests.
  bool verify_moves = false;
  // Check that a buffer holds, when a pin makes it active again, the bytes
  // its last unpin left (verify_pins.cc). Reads and hashes the buffer twice
  // per pin cycle: for tests and for hunting stale reads, not for speed.
  bool verify_pins = false;

  // Step-pattern prefetch: learn the pin order of one step (StepBegin marks
  // steps) and page in the next buffers ahead of use.
  bool prefetch_enabled = false;
  size_t prefetch_budget_bytes = 0;  // 0 = memory_limit / 8
  // Pins looked ahead. 128 runs every planner point that 256 runs and beats
  // paging on demand at each; 64 ran one out of memory (docs/how-it-works.md,
  // "The default has been 128").
  int prefetch_lookahead = 128;
  // Keep prefetch only while it is faster: once a step is learned, time
  // steps with and without it and keep the faster, trying the other again
  // now and then (prefetch_guard.cc). Off (the default): prefetch runs in
  // every step. Experimental: a switch between the modes can leave a layout
  // that neither mode makes, and at the memory edge that can run out of
  // memory (prefetch_guard.cc says where).
  bool prefetch_guard = false;
  // With prefetch, how far the host may run ahead of the compute stream
  // while tensors are on the host, in last-use epochs (32 unpins each): at
  // every epoch close the host waits until the GPU has done the kernels
  // unpinned `run_ahead_epochs` epochs before. 0 (the default here): no limit
  // beyond the device's own launch queue; at most kMaxRunAheadEpochs.
  // TensorFlow's adapters set 8 unless TF_LMS_RUN_AHEAD_EPOCHS says
  // otherwise. The engine decides on the host's clock which chunk a copy
  // goes into, and with the host a launch queue ahead a free chunk may still
  // be in use on the GPU's; a closer host makes those decisions nearer to the
  // GPU's clock (residency.cc, ThrottleRunAhead, says what the planner
  // measured).
  int run_ahead_epochs = 0;

  // Fixed-address mode (see above). Off: everything behaves as without it.
  bool fixed_addresses = false;
  // Physical page size in that mode: a multiple of the device's
  // VmGranularity() (CUDA: 2 MiB; the sim backend: the OS page size, so
  // tests may use 64 KiB). memory_limit / page_size pages are the budget.
  size_t page_size = size_t{2} << 20;
  // Bytes of virtual address range to reserve; 0 = 4 x memory_limit. The
  // range holds resident and evicted buffers alike (an evicted buffer keeps
  // its addresses), so it bounds device plus host bytes of live buffers.
  size_t virtual_address_bytes = 0;

  // A yardstick for the planner (sim backend), not a mode to run: the arena
  // manages kUnfragmentedAddressFactor x memory_limit of addresses while the
  // bytes in use stay within the LMS limit (a hard limit here), and every
  // chunk is split to the request's size, so a request whose bytes are free
  // never finds them in pieces. What the address-only mechanisms do (large
  // requests placed beside what cannot leave, stranded buffers relocated,
  // defragmentation and slides) is left out, the two prefetch checks that
  // judge room by a hole judge it by bytes too, and so do the places that
  // take a chunk they chose themselves (a due group's members, a host
  // exchange, the staging piece of a swap in place). A replay with it is the
  // engine's own eviction and prefetch with addresses taken out: the
  // difference to a normal replay is what addresses cost the engine.
  // Needs lms_enabled; refused with fixed_addresses (no fragmentation there
  // to take out).
  bool unfragmented = false;
  // Experimental, off by default, not set by the patch: planned copies in
  // (the step plan's page-ins) are placed by a look-ahead over the learned
  // step rather than held back by the plan's slack. Each goes to a free
  // chunk where every allocation and page-in the step makes before the
  // copy's use, through the outputs of the kernel that uses it, still finds
  // room in a model of the arena (layout_lookahead.cc), chunks the GPU is
  // done with first; the plan then keeps no slack for holes. Costs host time
  // at the pins where a planned copy waits (some 50 us a look on the
  // planner's machine). No effect with fixed_addresses or unfragmented
  // (no addresses to plan) or without prefetch (no plan).
  bool layout_lookahead = false;
};

class Buffer;  // Opaque; owned by the engine between AllocateBuffer and Free.

enum class BufferState { kResident, kPagingOut, kReclaimed, kPagingIn, kMoving };

class Engine {
 public:
  // `device` is not owned and must outlive the engine.
  Engine(Device* device, const EngineOptions& options);
  ~Engine();

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates options against the device; call before using the engine.
  // Until it has returned OK, allocations fail and ReclaimInactive,
  // Defragment and CheckInvariants return kFailedPrecondition naming why
  // (GetStats and GetFreeSpace report zeros) instead of touching an arena
  // that does not exist.
  Status Init();

  const EngineOptions& options() const;

  // ---- Raw allocations (never moved) ----
  // A request larger than options().memory_limit (after rounding to 256
  // bytes), here and in AllocateBuffer, fails at once with
  // kResourceExhausted: no reclaim could ever make room for it, so nothing is
  // paged out and nothing but num_ooms changes.
  void* AllocateRaw(size_t bytes, Status* status);
  void DeallocateRaw(void* ptr);
  size_t RequestedSize(const void* ptr) const;
  size_t AllocatedSize(const void* ptr) const;

  // ---- Buffers ----
  // Returns a new buffer, pinned if `pinned`. nullptr with *status set when
  // no memory could be made available. With `device_ptr`, also returns the
  // buffer's address (valid while it stays pinned), saving the Pin/Unpin
  // pair an adapter would otherwise need to learn it.
  Buffer* AllocateBuffer(size_t bytes, bool pinned, Status* status,
                         void** device_ptr = nullptr);
  // Frees a buffer in any state; waits for copies in flight.
  Status FreeBuffer(Buffer* buffer);
  // Makes the buffer active and resident; *device_ptr is its address until
  // the matching Unpin.
  Status Pin(Buffer* buffer, void** device_ptr);
  Status Unpin(Buffer* buffer);
  // The buffer's address escaped (C API, DLPack): it is paged in if needed
  // and never moved or reclaimed again.
  Status MarkUnmovable(Buffer* buffer, void** device_ptr);
  // The caller is about to pin these buffers together (a kernel reading
  // every element of a list). If, pinned where they are, they would leave no
  // gap as large as all of them, the engine pages them out and back into
  // one run first (gather.cc). Best effort: nothing fails, the pins follow.
  // Groups of fewer than kMinGatherGroup buffers are left alone: they pin no
  // more than a kernel's ordinary inputs do.
  static constexpr size_t kMinGatherGroup = 16;
  void GatherForPins(Buffer* const* buffers, size_t n);
  // The caller's kernel is about to pin these buffers and then allocate one
  // output as large as all of them (ConcatV2, Pack). If, pinned where they
  // are, with those still on the host paged in next to what cannot leave,
  // they would leave no gap for that output, the engine pages them out and
  // back into one run first; otherwise it only places the ones on the host.
  // Any group of two or more; best effort, as GatherForPins.
  void GatherForConcat(Buffer* const* buffers, size_t n);

  // Host access for callers outside kernels: pins for the duration.
  Status ReadBuffer(Buffer* buffer, size_t offset, void* dst, size_t bytes);
  Status WriteBuffer(Buffer* buffer, size_t offset, const void* src,
                     size_t bytes);

  size_t BufferSize(const Buffer* buffer) const;
  BufferState GetBufferState(const Buffer* buffer) const;
  int PinCount(const Buffer* buffer) const;

  // ---- Control ----
  // Moves every inactive buffer to host now. *bytes: bytes reclaimed.
  Status ReclaimInactive(size_t* bytes);
  // Compacts: moves inactive buffers toward low addresses so free space
  // coalesces. *bytes_moved: bytes copied device->device. In fixed-address
  // mode a no-op (nothing may move; no physical fragmentation exists).
  Status Defragment(size_t* bytes_moved);
  // Marks a training-step boundary (prefetch learns per step).
  void StepBegin();
  // A kernel of the framework's step `step_id` is about to pin its inputs
  // on this thread: the id applies to this thread's pins from the next one
  // on (no lock taken; call it for every kernel). Inside TensorFlow nothing
  // calls StepBegin: the engine finds boundaries itself from these ids
  // (step_finding.cc says how it copes with eager ops, several functions per
  // step and the first, tracing step).
  void NoteStepId(int64_t step_id);
  // Lock-free: the calling thread's next allocations are made by the kernel
  // `site` names (a hash of its op name; 0: none known). Prefetch then knows
  // a buffer by its size and site rather than its size alone, so kernels
  // that allocate a size in another order from step to step (an optimizer's
  // copy-on-write updates) do not shift each other's keys (prefetch.cc).
  void NoteAllocationSite(uint64_t site);
  // Changes the reclaim threshold at run time (0 = memory_limit).
  Status SetLmsLimit(size_t bytes);

  // ---- Observation ----
  EngineStats GetStats() const;
  // Starts a new measurement period; it is what tsl::Allocator::ClearStats
  // (behind tf.config.experimental.reset_memory_stats) should forward to:
  //   * peaks restart from the current value: peak_bytes_in_use,
  //     peak_bytes_reserved, peak_bytes_active, peak_bytes_reclaimed,
  //     host_peak_bytes_in_use;
  //   * num_allocs and largest_alloc_size become 0, as in
  //     tsl::BFCAllocator::ClearStats;
  //   * every other counter is cumulative (reclaims, page-ins, bytes moved,
  //     prefetch hits, stall times, allocation sources, OOMs) and becomes 0;
  //   * current values and limits (bytes_in_use, bytes_reserved,
  //     bytes_active, bytes_inactive, current_bytes_reclaimed,
  //     host_bytes_in_use, *_limit) are state, not statistics, and stay.
  // tsl's ClearStats leaves peak_bytes_reserved alone; resetting it too keeps
  // every peak a maximum over the same period. The invariants of stats.h hold
  // right after the call. Buffers, chunks and prefetch state are untouched.
  void ClearStats();
  // Largest free chunk and total free bytes in the arena.
  void GetFreeSpace(size_t* largest_free, size_t* total_free) const;
  // Walks every chunk and buffer and checks the invariants the statistics
  // promise. For tests; O(number of chunks).
  Status CheckInvariants() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tflms

#endif  // TFLMS_CORE_ENGINE_H_
