// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Engine internals shared by the mechanism files:
//   engine.cc     public API, raw allocations, the allocation path
//   residency.cc  pin/unpin, page-out, page-in
//   reclaim.cc    victim choice: single, fragments, full
//   defrag.cc     defragmentation (moves within the device)
//   prefetch.cc   step-pattern prefetch: keys, order following, look-ahead
//   step_finding.cc  step boundaries from step ids, the recordings' library
//   step_plan.cc  the Belady plan of a finished step, planned copies
//   stats.cc      statistics snapshot, invariants, out-of-memory messages
//   fixed_address.cc  fixed-address mode: page table, map/unmap, its ladder
//
// Locking discipline:
//   * mu_ guards the arena, every Buffer field, the LRU, the counters and
//     the prefetch state.
//   * mu_ is NEVER held across a device copy or a host-blocking wait
//     (SynchronizeEvent, HostPool allocation). A thread that needs to copy
//     marks the buffers it copies with a transient state (kPagingOut,
//     kPagingIn, kMoving) under mu_, drops mu_, copies, retakes mu_ and
//     settles the state. Other threads that need such a buffer wait on cv_.
//   * host_pool_ has its own lock; it is taken with mu_ released.
//
// Ownership: the engine owns every Buffer from AllocateBuffer until
// FreeBuffer (or until the copy in flight when FreeBuffer was called has
// settled: see Buffer::free_requested).
#ifndef TFLMS_CORE_SRC_ENGINE_IMPL_H_
#define TFLMS_CORE_SRC_ENGINE_IMPL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bfc_arena.h"
#include "host_pool.h"
#include "tflms/engine.h"

namespace tflms {

class Buffer {
 public:
  int64_t id = 0;
  size_t size = 0;  // bytes requested
  BfcArena::ChunkHandle chunk = BfcArena::kInvalidChunk;  // when resident
  char* device_ptr = nullptr;                              // when resident
  void* host_ptr = nullptr;  // the host copy while reclaimed
  size_t host_bytes = 0;
  int pin_count = 0;
  // Fixed-address mode: the buffer's virtual chunk for its whole life
  // (`chunk` equals it while resident, kInvalidChunk while evicted).
  BfcArena::ChunkHandle vchunk = BfcArena::kInvalidChunk;
  BufferState state = BufferState::kResident;
  bool unmovable = false;
  bool free_requested = false;  // freed while a copy was in flight
  bool prefetched = false;      // paged in ahead of use, not pinned since
  // While prefetched: paged in by the step's plan (StartPlannedPageInsLocked)
  // rather than by the look-ahead, whose byte budget it does not count in.
  bool prefetch_planned = false;
  // While prefetched and not pinned since: the host copy it was paged in
  // from, whose bytes it still holds (nothing writes a buffer unpinned), so
  // that an eviction before the pin needs no copy (TryEvictCleanLocked).
  void* clean_host = nullptr;
  size_t clean_host_bytes = 0;
  // While prefetched: how many pins ahead of its use it was paged in.
  size_t prefetch_distance = 0;
  // Its prefetch was evicted again before the pin (NotePrefetchWastedLocked)
  // and no pin has come since: a miss now follows from that, not from a
  // distance too short.
  bool prefetch_wasted = false;
  // Paged out ahead of pressure (kPagingOut with no thread waiting on the
  // copy): in Impl::early_outs_ once its copy is enqueued. See
  // StartEarlyPageOut.
  bool early_out = false;
  // The last-use epoch stamped by its last Unpin (0: no use to wait for).
  // Every kernel that used the buffer was enqueued on the compute stream
  // before that Unpin, so a compute-stream event recorded after the epoch
  // closed (Impl::LastUseEventLocked) follows all of them. See "Last-use
  // epochs" in Engine::Impl.
  uint64_t last_use_epoch = 0;
  // The event every kernel's use must follow (the copy that filled the
  // chunk). Kept until the device says it completed, not until the first
  // pin: a kernel pinned on another thread may reach the compute stream
  // before the first pinner has ordered it after the copy.
  EventRef ready;
  // verify_pins (verify_pins.cc): the hash of the bytes its last holder
  // left, valid once a pin cycle ended with no other pin held.
  uint64_t pin_hash = 0;
  bool pin_hash_valid = false;
  // Intrusive LRU of inactive buffers (oldest at head).
  Buffer* lru_prev = nullptr;
  Buffer* lru_next = nullptr;
  bool in_lru = false;
  // Intrusive list of every live buffer (iteration without a hash map).
  Buffer* all_prev = nullptr;
  Buffer* all_next = nullptr;
  // Prefetch identity: allocation ordinal within the step that created it,
  // or -1 for buffers that outlive steps (keyed by id then). A buffer of the
  // current or the previous step is known by its `key_size` (its size, mixed
  // with the site that allocated it where one was noted) and `size_rank`,
  // its rank among the allocations of that key size in its step
  // (prefetch.cc).
  int64_t step_ordinal = -1;
  int64_t step_created = -1;
  uint64_t key_size = 0;
  int64_t size_rank = 0;
  // Its rank among the allocations of its key size since a candidate step
  // began (valid while step_ordinal >= PrefetchState::candidate.ordinal),
  // and since the challenger's first pin (PrefetchState::challenger).
  int64_t candidate_rank = 0;
  int64_t challenger_rank = 0;

  bool resident() const { return chunk != BfcArena::kInvalidChunk; }
  // Counted in bytes_active (not reclaimable).
  bool active() const { return pin_count > 0 || unmovable; }
};

// An allocation step of the escalation ladder; also where a chunk came from.
enum class AllocSource {
  kFree,
  kNewRegion,
  kSingleReclaim,
  kDefrag,
  kFragmentReclaim,
  kFullReclaim,
};

class Engine::Impl {
 public:
  // One memory event of a recorded step (step_plan.cc, PlanStepLocked).
  struct StepEvent {
    enum Kind : uint8_t { kAlloc, kAllocPinned, kPin, kUnpin, kFree };
    Kind kind;
    int64_t key;   // PrefetchKey at the time, renumbered like the recording
    size_t at;     // pins recorded before it (its position in the pin order)
    size_t bytes;  // BFC-rounded size
    // Noted while a candidate step was open: its key as that step's
    // (CandidateKey), which it takes if the candidate is confirmed.
    bool in_candidate = false;
    int64_t candidate_key = 0;
  };
  // A step id that may begin the next step: where its first pin came (in
  // `recording`, `events` and the allocation ordinals), when (NowSeconds),
  // how many pins it made, its position in `learned`, and its allocations
  // and pins since, keyed as they will be if its step begins there
  // (CandidateKey, ChallengerKey).
  struct OpenStep {
    int64_t id = 0;
    size_t pins = 0;
    size_t index = 0;
    size_t events = 0;
    int64_t ordinal = 0;
    double time = 0;
    size_t cursor = 0;
    std::unordered_map<int64_t, Buffer*> by_key;
    std::unordered_map<uint64_t, int64_t> size_counts;
    std::vector<int64_t> keys;  // its pins since
    // The keys, as its step's, of the events noted since its first pin
    // (events[events + i]); kept for the challenger only, whose events take
    // them as their candidate keys if it takes over. A few events at most:
    // a field of every StepEvent would cost every step's events 8 bytes.
    std::vector<int64_t> event_keys;
  };

  Impl(Device* device, const EngineOptions& options);
  ~Impl();

  // ---- engine.cc ----
  Status Init();
  void* AllocateRaw(size_t bytes, Status* status);
  void DeallocateRaw(void* ptr);
  size_t RequestedSize(const void* ptr) const;
  size_t AllocatedSize(const void* ptr) const;
  // *device_ptr (when not null): the new buffer's address, read under the
  // same lock acquisition.
  Buffer* AllocateBuffer(size_t bytes, bool pinned, Status* status,
                         void** device_ptr);
  Status FreeBuffer(Buffer* b);
  Status SetLmsLimit(size_t bytes);
  // True, with *status set and num_ooms counted, when `bytes` can never fit
  // in the device: it exceeds memory_limit once rounded to 256-byte units.
  // Checked before anything else, so that such a request neither pages out
  // the inactive buffers for nothing nor wraps RoundedBytes around.
  // Takes mu_.
  bool RejectLargerThanDevice(size_t bytes, Status* status);
  // Obtains a chunk for `owner` climbing the ladder up to `max_source`.
  // Called with `lock` held; may release and retake it while copying.
  // A single-reclaim victim must not be needed at or before pin position
  // `protect_until` of the learned step order (0: no constraint).
  // A failure at kFullReclaim is counted in num_ooms unless `count_oom` is
  // false: PageIn has a last resort of its own (swap.cc) and counts only
  // once that fails too.
  BfcArena::ChunkHandle AllocateChunk(std::unique_lock<std::mutex>& lock,
                                      size_t bytes, Buffer* owner,
                                      AllocSource max_source, Status* status,
                                      size_t protect_until = 0,
                                      bool count_oom = true);
  // Frees the chunk and buffer bookkeeping of a buffer that is settled.
  void DestroyBufferLocked(Buffer* b);

  // ---- residency.cc ----
  Status Pin(Buffer* b, void** device_ptr);
  Status Unpin(Buffer* b);
  Status MarkUnmovable(Buffer* b, void** device_ptr);
  Status Access(Buffer* b, size_t offset, void* host, size_t bytes,
                bool write);
  // Pages `victims` out (all must be inactive and marked kPagingOut by the
  // caller, off the LRU). Returns with `lock` held. *bytes: bytes reclaimed.
  Status PageOut(std::unique_lock<std::mutex>& lock,
                 const std::vector<Buffer*>& victims, size_t* bytes);
  // Brings a reclaimed buffer back. `for_prefetch` limits the ladder to
  // cheap steps so prefetch never causes a full reclaim.
  // `into`: a free range already taken for it (gather.cc), else the ladder
  // finds one.
  Status PageIn(std::unique_lock<std::mutex>& lock, Buffer* b,
                bool for_prefetch, size_t protect_until = 0,
                bool no_reclaim = false,
                BfcArena::ChunkHandle into = BfcArena::kInvalidChunk);
  void LruPush(Buffer* b);
  void LruRemove(Buffer* b);
  // ---- residency.cc: page-out ahead of pressure ----
  // Enqueues the copy of inactive buffer `v` to the host and returns without
  // waiting for it (mu_ released while enqueueing): the learned step says
  // the room is needed before its next use, and a copy started now runs
  // while the compute stream works, instead of when an allocation fails and
  // the host must wait for it. Its chunk is freed when the copy is settled
  // (SettleEarlyPageOutsLocked). Returns with `lock` held.
  void StartEarlyPageOut(std::unique_lock<std::mutex>& lock, Buffer* v);
  // Settles the `max` oldest early page-outs (frees their chunks): a copy
  // known complete is settled at once, the compute stream ordered after it
  // before the freed chunk's next user runs; otherwise the host waits for
  // it (mu_ released meanwhile). Returns with `lock` held.
  void SettleEarlyPageOutsLocked(std::unique_lock<std::mutex>& lock,
                                 size_t max);
  // Takes back an early page-out of `b` whose copy is enqueued: `b` stays
  // resident (its next user waits for the copy, which may still read it),
  // the host copy is freed once the copy is done. False if `b` has none
  // enqueued (its copy is still being enqueued: wait on cv_).
  bool CancelEarlyPageOutLocked(Buffer* b);
  // Frees host copies whose page-in has landed. With `wait`, first waits
  // (mu_ released meanwhile) for the ones still in flight. Inline because
  // every pin asks and there is rarely one (make bench, tensor lifecycle).
  void ReleaseSettledHostCopies(std::unique_lock<std::mutex>* lock,
                                bool wait) {
    if (!pending_host_frees_.empty()) FreeSettledHostCopies(lock, wait);
  }
  void FreeSettledHostCopies(std::unique_lock<std::mutex>* lock, bool wait);
  // Waits for the compute/copy events a buffer's bytes depend on, on `stream`.
  Status OrderAfterUses(Stream* stream, const EventRef& last_use,
                        const EventRef& ready);

  // ---- residency.cc: last-use epochs ----
  // Ends the open epoch: later unpins stamp the next one. *free_seq: free_seq_
  // now, i.e. before the caller records the epoch's event (fixed-address
  // mode's unmap safety). Returns the closed epoch. REQUIRES: mu_ held.
  uint64_t CloseEpochLocked(uint64_t* free_seq);
  // Keeps `event`, recorded on the compute stream after `epoch` closed, as
  // the proof for that epoch. REQUIRES: mu_ held.
  void PublishEpochEventLocked(uint64_t epoch, EventRef event,
                               uint64_t free_seq);
  // How work after the uses stamped `epoch` is ordered after them. Returns
  // true with *event null when nothing need be waited for (no use, or known
  // complete); true with *event set to a kept event recorded after `epoch`
  // closed, *covers and *free_seq describing it; false when no kept event
  // covers it (the epoch is open, or its event is not published): the caller
  // must close the open epoch and record a fresh event. REQUIRES: mu_ held.
  bool LastUseEventLocked(uint64_t epoch, EventRef* event, uint64_t* covers,
                          uint64_t* free_seq) const;
  // An event covering `epoch` was synchronized without error: every epoch up
  // to it is complete, and so is every free numbered up to `free_seq`.
  // REQUIRES: mu_ held.
  void NoteEpochCompleteLocked(uint64_t epoch, uint64_t free_seq);
  // Non-blocking: whether the uses stamped `epoch` are proven complete (an
  // event covering them has completed). REQUIRES: mu_ held.
  bool LastUseDoneLocked(uint64_t epoch) const;
  // The reuse_after stamp (BfcArena::Chunk) of a device chunk freed now: the
  // open epoch, whose event follows every kernel and every stream wait
  // enqueued on the compute stream before the free. A page-in into the
  // chunk, on the host-to-device stream, waits for that event (PageIn)
  // rather than for all compute enqueued when it starts. REQUIRES: mu_ held.
  uint64_t ReuseAfterNowLocked() const { return open_epoch_; }
  // The stamp of a chunk whose last reader was a copy already complete (a
  // synchronized or settled page-out, a page-in that landed with no pin
  // since): it ordered itself after every earlier use.
  static constexpr uint64_t kReusableAtOnce = 0;
  // Makes every use stamped so far provably complete: closes the open epoch
  // if it has stamps, records a compute-stream event and waits for it with
  // `lock` released. For defragmentation, which moves only buffers whose
  // last use is complete and drains the compute stream for its own copies
  // anyway. Returns with `lock` held.
  Status SyncLastUses(std::unique_lock<std::mutex>& lock);
  // With options_.run_ahead_epochs > 0 and bytes on the host, called once
  // `closed` has closed: waits, with `lock` released, until the compute
  // stream has done the kernels before epoch closed - run_ahead_epochs.
  // Returns with `lock` held.
  void ThrottleRunAhead(std::unique_lock<std::mutex>& lock, uint64_t closed);

  // ---- verify_pins.cc ----
  // *hash of `bytes` at `device_ptr`, read after all enqueued compute work.
  Status HashDeviceBytes(const void* device_ptr, size_t bytes, uint64_t* hash);
  // Called by Unpin before the last pin ends: records the bytes its holder
  // leaves. REQUIRES: mu_ held (kept while it reads).
  void NoteUnpinnedBytes(Buffer* b);
  // Called by Pin, without mu_, once the pin that made `b` active has
  // ordered the compute stream: the bytes must hash to `expected`.
  // On a mismatch, ends the pin and returns kInternal.
  Status VerifyPinnedBytes(Buffer* b, const void* device_ptr,
                           uint64_t expected);

  // ---- reclaim.cc ----
  // Choose victims for a request of `rounded` bytes; empty if none.
  std::vector<Buffer*> ChooseSingleVictim(size_t rounded,
                                          size_t protect_until);
  // Whether `b` may be the single victim for `rounded` bytes: reclaimable,
  // its span (BfcArena::SpanOf) holds the request, and, under an LMS limit
  // below the device size, freeing it brings the bytes in use (`in_use`)
  // back under the limit. The exchange (exchange.cc) takes its victims by
  // the same test.
  bool SingleVictimHolds(const Buffer* b, size_t rounded, size_t in_use) const;
  std::vector<Buffer*> ChooseFragmentVictims(size_t rounded);
  // The fewest bytes to page out, all of buffers the learned step pins
  // after `after` (a pin position), so that sliding one run of chunks
  // (defrag.cc, SlideFor) then opens `rounded` bytes within the LMS limit;
  // *cost is their bytes. Empty where no run can, or a slide alone would.
  // Reads Movable(), so the caller synchronizes last uses first.
  std::vector<Buffer*> ChooseTopUpVictims(size_t rounded, size_t after,
                                          size_t* cost);
  std::vector<Buffer*> ChooseAllInactive();
  bool Reclaimable(const Buffer* b) const;
  Status ReclaimInactive(size_t* bytes);

  // ---- gather.cc ----
  // The buffers one kernel is about to pin together: if, pinned where they
  // are, they would leave no gap as large as all of them, they are paged out
  // and back into one run. kConcat: the kernel then allocates an output as
  // large as all of them, and the members on the host are placed first
  // (gather.cc). Best effort; takes mu_.
  enum class GatherKind { kList, kConcat };
  void GatherForPins(Buffer* const* buffers, size_t n, GatherKind kind);

  // ---- padding.cc ----
  // While the engine follows a step's plan: gives back the padding of the
  // chunks of resident buffers (BfcArena::TrimInUse). True if any.
  bool TrimPaddingLocked();

  // ---- placement.cc ----
  // Where a large request made under pressure should go: a range at one end
  // of the tightest gap between chunks that cannot leave (active buffers, raw
  // allocations), so that what is pinned together packs together.
  struct ClusterPlan {
    const char* lo = nullptr;  // start of the range; nullptr: no plan
    std::vector<Buffer*> victims;  // reclaimable buffers overlapping it
  };
  // `stay`: buffers that count as unable to leave although they may (a
  // group about to be pinned); none if null.
  ClusterPlan PlanClusterPlacement(
      size_t rounded, const std::unordered_set<const Buffer*>* stay = nullptr);
  // True when LMS has bytes on the host (placement.cc).
  bool PlacementPressure() const;
  // True when LMS has bytes on the host (the device is under pressure) and a
  // request of `rounded` bytes is large enough for cluster placement.
  bool UnderPlacementPressure(size_t rounded) const;
  // The same for a resident buffer's chunk.
  bool UnderPlacementPressure(const Buffer& b) const;
  // Whether a request of `rounded` bytes is large enough (a quarter of the
  // device) that placing it may page other buffers out.
  bool WorthPagingOutToPlace(size_t rounded) const {
    return rounded >= options_.memory_limit / 4;
  }
  // The cluster plan an allocation of `rounded` bytes takes first
  // (AllocateChunk), or none (lo null) where it would not use one: no
  // pressure, over the LMS limit, or victims to page out for a request
  // under a quarter of the device. Decides only; pages nothing out.
  ClusterPlan AllocationClusterPlan(size_t rounded);
  // Takes the planned range once it is free; kInvalidChunk if it is not.
  BfcArena::ChunkHandle TakeClusterRange(const ClusterPlan& plan,
                                         size_t rounded, size_t bytes,
                                         Buffer* owner);
  // Before a resident buffer is pinned under pressure: if it sits inside a
  // gap between chunks that cannot leave, away from both ends, moves it
  // (device to device) to an end, when it is a quarter of the device or
  // more, or when where it is it would leave the learned step's coming
  // allocation no room (placement.cc). True if it moved. May release and
  // retake `lock`.
  bool RelocateStrandedLocked(std::unique_lock<std::mutex>& lock, Buffer* b);
  // Pages resident, unpinned `b` out and back in next to what cannot leave
  // (PlanClusterPlacement), for a stranded buffer that overlaps both ends of
  // its own gap. True if it came back there. May release and retake `lock`.
  bool RoundTripStrandedLocked(std::unique_lock<std::mutex>& lock, Buffer* b);

  // ---- due_group.cc ----
  // At the pin of `b`, the first of the buffers the learned step pins for a
  // kernel that then allocates a large output: if, pinned where they are,
  // they would leave that output no gap, moves those in the way (and brings
  // those on the host back) so that a window as large as the output stays
  // clear. Best effort. True if any member was placed. May release and
  // retake `lock`.
  bool PlaceDueGroupLocked(std::unique_lock<std::mutex>& lock, Buffer* b);
  // Whether, the group's resident members pinned where they lie, its
  // members on the host and the `output` bytes each find a gap. If so,
  // *places gets each member on the host that the fit put in a gap between
  // chunks, with its address (not those it put beyond the arena's regions).
  // `wall`, when not empty, is a range that counts as pinned too (where a
  // member on the host would land if its pin paged it in).
  bool DueGroupFitsLocked(
      const std::unordered_set<const Buffer*>& in_group,
      const std::vector<Buffer*>& on_host, size_t output,
      std::vector<std::pair<Buffer*, const char*>>* places,
      std::pair<const char*, const char*> wall = {nullptr, nullptr}) const;
  // Puts each member at its destination: resident ones move (device to
  // device, else through the host), those on the host are paged in there;
  // whatever inactive buffers lie in a destination are paged out first and
  // early page-outs in flight settled. Skips a member whose destination
  // cannot be cleared. True if any member was placed.
  bool MoveDueGroupLocked(
      std::unique_lock<std::mutex>& lock,
      const std::vector<std::pair<Buffer*, const char*>>& moves);
  // When no window clears with whole moves: slides inactive buffers down
  // (SlideFor) until a free chunk of `need` bytes exists, or else packs the
  // resident `members` together (PackDueGroupLocked), and brings the
  // members on the host back into the free chunk. True if anything moved.
  bool SlideDueGroupLocked(std::unique_lock<std::mutex>& lock,
                           const std::vector<Buffer*>& members,
                           const std::vector<Buffer*>& on_host, size_t need);
  // Slides the resident, unpinned `members` down against each other, and
  // pages out whatever else lies where they and `need` bytes above them
  // go, so that a free chunk of `need` bytes follows them. *moved: bytes
  // slid. False if nothing moved.
  bool PackDueGroupLocked(std::unique_lock<std::mutex>& lock,
                          const std::vector<Buffer*>& members, size_t need,
                          size_t* moved);
  // What lies in [lo, hi) besides the `staying` buffers: the inactive
  // buffers that a page-out would clear (`leaving`), the bytes of every
  // such chunk, and whether one may not leave now (`blocked`; `in_flight`
  // when an early page-out in flight is among those, which settling frees).
  struct Occupants {
    std::vector<Buffer*> leaving;
    size_t bytes = 0;
    bool blocked = false;
    bool in_flight = false;
  };
  Occupants OccupantsLocked(const char* lo, const char* hi,
                            const std::vector<Buffer*>& staying) const;
  // The runs of adjacent chunks that may_leave accepts, as [lo, hi).
  template <typename MayLeave>
  std::vector<std::pair<const char*, const char*>> LeavableRunsLocked(
      MayLeave may_leave) const;
  // A page-in the kernel pinning `b` waits for (prefetch_misses,
  // bytes_paged_in_on_demand): on its pin, or just before it (the stranded
  // round trip, a group's gather).
  void CountPageInAtPinLocked(const Buffer* b) {
    ++counters_.prefetch_misses;
    counters_.bytes_paged_in_on_demand += static_cast<int64_t>(b->size);
  }
  // The largest run of adjacent chunks that may_leave accepts, `pinned`'s
  // own chunk counted as staying (none if null), or the memory not reserved
  // yet if larger.
  template <typename MayLeave>
  size_t LargestGapBesideLocked(const Buffer* pinned, MayLeave may_leave) const;
  // As LargestGapBesideLocked, with [lo, lo + size) counted as staying: the
  // gap left once a range planned there is taken.
  template <typename MayLeave>
  size_t LargestGapOutsideLocked(const char* lo, size_t size,
                                 MayLeave may_leave) const;

  // ---- defrag.cc ----
  // Makes a free chunk of `rounded` bytes by moving inactive buffers.
  Status DefragFor(std::unique_lock<std::mutex>& lock, size_t rounded,
                   size_t* moved);
  // Makes a free chunk of `rounded` bytes by sliding the inactive buffers
  // of one run of chunks toward its low end, each within its own run: for
  // when no buffer finds a destination elsewhere (DefragFor) and the host
  // is full. Never in fixed-address mode (AllocateChunkFixed).
  Status SlideFor(std::unique_lock<std::mutex>& lock, size_t rounded,
                  size_t* moved);
  // Whether the single reclaim's victim (`victim`, ChooseSingleVictim's
  // choice) is as large as the request and memory_limit /
  // kSlideRatherThanReclaimDivisor or more, and the learned step (followed
  // now) pins it again within kSlideRatherThanReclaimPins pins, at
  // *next_use: a page-out of it would come straight back.
  bool ReclaimVictimDueSoon(const std::vector<Buffer*>& victim, size_t rounded,
                            size_t* next_use) const;
  // Before such a single reclaim, with the bytes free: slides (SlideFor),
  // so that the victim stays if that makes room. True when it tried (mu_
  // was released: the victim must be chosen again).
  bool SlideRatherThanReclaimLocked(std::unique_lock<std::mutex>& lock,
                                    size_t rounded,
                                    const std::vector<Buffer*>& victim);
  // Before such a single reclaim, where a slide alone makes no room: pages
  // out buffers due later than the victim and fewer bytes than it
  // (ChooseTopUpVictims), then slides. True when it tried (mu_ was
  // released: the victim must be chosen again).
  bool TopUpAndSlideLocked(std::unique_lock<std::mutex>& lock, size_t rounded,
                           const std::vector<Buffer*>& victim);
  static constexpr size_t kSlideRatherThanReclaimPins = 16;
  // ... and whose victim holds memory_limit / this or more.
  static constexpr size_t kSlideRatherThanReclaimDivisor = 5;
  // A slide copies in pieces as long as the distance it moves: a buffer
  // moved less than 1/kMaxSlidePieces of its size stays where it is.
  static constexpr size_t kMaxSlidePieces = 64;
  // Moves `b` down into the free chunk `below` that ends where it starts.
  Status SlideDownLocked(std::unique_lock<std::mutex>& lock, Buffer* b,
                         BfcArena::ChunkHandle below);
  // A move or slide of `b` to `chunk` completed: its new address.
  void NoteMovedLocked(Buffer* b, BfcArena::ChunkHandle chunk);
  // A move or slide of `b` ended, done or not (kMoving -> kResident).
  void EndMoveLocked(Buffer* b);
  // An allocation's page-out was refused by the full host pool: SlideFor is
  // its last resort (engine.cc), and defragmentation would add nothing.
  bool HostRefused(const Status& host_status) const {
    return options_.lms_enabled &&
           host_status.code() == Code::kResourceExhausted;
  }
  Status Defragment(size_t* bytes_moved);
  bool Movable(const Buffer* b) const;
  Status MoveBuffers(std::unique_lock<std::mutex>& lock,
                     const std::vector<std::pair<Buffer*, BfcArena::ChunkHandle>>&
                         moves,
                     size_t* moved);

  // ---- exchange.cc ----
  // The host pool refused every victim of a `rounded` request: for one
  // victim whose chunk with its free neighbours holds the request, pages
  // reclaimed buffers back into free chunks outside that span, enough that
  // the pool takes the victim, then pages it out. True if it was paged
  // out; *host_status: the pool's refusal if it was not. Not in
  // fixed-address mode.
  bool ExchangeForVictimLocked(std::unique_lock<std::mutex>& lock,
                               size_t rounded, size_t protect_until,
                               Status* host_status);

  // ---- swap.cc ----
  // `x` (kPagingIn, its host copy in one piece) found no room however much
  // was reclaimed: it trades places with one inactive buffer whose chunk
  // holds it and which its host allocation holds, piece by piece through
  // the largest free device chunk. Ok: x is resident, the victim on the
  // host. kResourceExhausted: no such victim or staging chunk, nothing
  // changed. Another error: a device fault (bytes may be lost if it came
  // after the first piece was written). Releases mu_ while copying.
  Status SwapInLocked(std::unique_lock<std::mutex>& lock, Buffer* x);
  static constexpr size_t kMaxSwapPieces = 64;

  // ---- step_finding.cc ----
  void StepBegin();
  void StepBeginLocked();
  // Ends the step being recorded at recording[index]: what was pinned from
  // there on, and the buffers allocated from ordinal `ordinal_base` on,
  // belong to the new step.
  // `at`: when the new step began (Device::NowSeconds), for the guard.
  void SplitStepLocked(size_t index, int64_t ordinal_base, double at);
  // Lock-free: notes the calling thread's step id, which its next pin
  // takes (TakeNotedStepLocked, at the top of Pin).
  void NoteStepId(int64_t step_id);
  void TakeNotedStepLocked();
  // Lock-free: the site of the calling thread's next allocations, and the
  // one it noted last for this engine (0: none).
  void NoteAllocationSite(uint64_t site);
  uint64_t CallerSite() const;
  void NoteStepIdLocked(int64_t step_id);
  // Makes library[index] the order this step follows.
  void FollowRecording(size_t index);
  // The library recording a step whose first pin has `key` follows.
  size_t RecordingStartingWith(int64_t key) const;
  // After kSwitchPins pins in a row that took the cursor no further than it
  // had been: the other recording in which those pins come in order, if one
  // does better than the followed one; it is then followed from there
  // (`*cursor` set) and true returned.
  bool SwitchRecordingLocked(size_t* cursor);
  // The library slot the finished step's recording takes: that of the
  // recording it followed if it is another step of that kind, else the
  // oldest's once the library is full (SIZE_MAX: a new slot).
  size_t LibrarySlotFor(const std::vector<int64_t>& recording) const;
  // Forgets the candidate step and its allocation ranks (and any challenge).
  void DropCandidateLocked();
  // `open` begins at this pin, for `step_id`; Clear forgets its keys.
  void StartOpenStepLocked(OpenStep* open, int64_t step_id);
  static void ClearOpenStep(OpenStep* open);
  // A candidate's pins are not all in a row: kernels of other ids come
  // between them (a validation step's and its input pipeline's). Another id
  // opens a challenge rather than replacing the candidate; the challenger
  // takes the candidate's place from its own first pin once it pins
  // kTakeoverPins in a row (TakeOverCandidateLocked), and the candidate's id
  // pinning again ends the challenge, its pins forgotten as an
  // interruption's are (ForgetChallengeLocked).
  void OpenChallengeLocked(int64_t step_id);
  void TakeOverCandidateLocked();
  void ForgetChallengeLocked();
  void DropChallengeLocked();
  // Pins from `at` on were another id's, dropped from the recording: events
  // noted since `from_event` and page-outs noted after `at` move to `at`.
  void ClampPositionsLocked(size_t at, size_t from_event);
  // The step's own id pinned again after other ids did: their pins were
  // work running beside the step, not part of its order (ForgetInterruption)
  // or, once one of them began a step or the step was marked, kept (Keep).
  void ForgetInterruptionLocked();
  void KeepInterruptionLocked();
  // A pin of the step being recorded: into the recording, and into an open
  // candidate's and challenger's keys; a challenger may take over
  // (TakeOverCandidateLocked) and a candidate be confirmed.
  void NoteStepPinLocked(const Buffer* b, int64_t key);
  // The candidate pinned kMinStepPins in a row: its step begins at its first
  // pin, and follows the recording its first pin chooses, from where its
  // pins so far lead.
  void ConfirmCandidateLocked();
  // While the step's first pins still choose its recording (`choosing`):
  // the one in which `key` comes earliest.
  void ChooseRecordingLocked(int64_t key);
  // After a pin moved `*cursor` (the candidate's if `in_candidate`): a step
  // that stopped getting further in its order for kSwitchPins pins, then
  // twice as many, looks for a recording that explains its last pins
  // (SwitchRecordingLocked).
  void NoteCursorProgressLocked(bool in_candidate, size_t* cursor);
  // The cursor got as far as `high`: the stall count starts again.
  void ResetStallLocked(size_t high);

  // ---- prefetch.cc ----
  // Moves *cursor past the occurrence of `key` in the learned order nearest
  // to it (beyond the resync window only where a lost cursor relocates);
  // true when that occurrence is close enough to count as in order.
  bool AdvanceCursorLocked(int64_t key, size_t* cursor);
  // Records the pin and returns buffers worth paging in ahead of use.
  std::vector<Buffer*> NotePinAndPlan(Buffer* b);
  void RunPrefetch(std::unique_lock<std::mutex>& lock,
                   const std::vector<Buffer*>& plan);
  void ForgetBufferForPrefetch(Buffer* b);
  // Gives a new buffer its prefetch identity (engine.cc's allocation path).
  void NoteAllocationLocked(Buffer* b);
  // Key under which prefetch knows `b` across steps: its size and rank in
  // its step for buffers of this or the previous step, -id for older ones.
  int64_t PrefetchKey(const Buffer* b) const;
  // The key `b` will have once the candidate step is confirmed, and once the
  // challenger's is (after taking over); both are SpanKey's for a step that
  // begins at allocation ordinal `ordinal_base`, where `b` has `rank`
  // among the allocations of its key size if it came since.
  int64_t CandidateKey(const Buffer* b) const;
  int64_t ChallengerKey(const Buffer* b) const;
  int64_t SpanKey(const Buffer* b, int64_t ordinal_base, int64_t rank) const;
  // The live buffer a learned key names now (candidate keys while matching
  // a candidate step's pins); nullptr if none.
  Buffer* BufferForKeyLocked(int64_t key, bool in_candidate) const;
  // Counts a pin's match in the order's trust and the statistics.
  void NoteMatchLocked(bool found);
  // Whether inactive `b`, just unpinned, should be paged out now: following
  // the learned order, the previous step paged it out between here and its
  // next use. Not in fixed-address mode.
  bool ShouldPageOutEarlyLocked(const Buffer* b) const;
  // Whether `b` is larger than the prefetch budget: the look-ahead pages
  // such a tensor in only first in line and only into free memory, which is
  // also why the plan's page-out of it stands within the look-ahead.
  bool OverPrefetchBudget(const Buffer* b) const {
    return b->size > options_.prefetch_budget_bytes;
  }
  // Whether paging `b` out by the plan leaves the host pool room for the
  // planned step's largest buffer (the plan knows no host limit).
  bool PlannedPageOutLeavesRoomLocked(const Buffer* b) const;
  // A victim paged out now (single, fragment or full reclaim, or early):
  // the next step pages it out early at its last use before this point.
  // A page-out that did not complete (copy, sync or unmap failed): the chunk
  // still holds the bytes, so `v` is resident again, or released if its owner
  // freed it meanwhile; `host`, if any, goes back to the pool.
  // REQUIRES: mu_ held.
  void AbandonPageOutLocked(Buffer* v, void* host);
  // A page-out whose copy is proven complete, its chunk already released (or,
  // in fixed-address mode, unmapped) by the caller: the bytes live only at
  // `host` from now on. REQUIRES: mu_ held.
  // `copied`: false for a clean eviction, which bytes_reclaimed leaves out.
  // Callers release the chunk first (ReleaseEvictedChunkLocked).
  void CompletePageOutLocked(Buffer* v, void* host, bool copied = true);
  // The device bytes of `v`, evicted with no copy still reading or writing
  // its chunk (the copy out is complete, or the clean page-in landed),
  // leave the byte counts; the chunk goes back to the arena with nothing
  // for a page-in to wait for (kReusableAtOnce), except in fixed-address
  // mode, where v keeps its virtual chunk. REQUIRES: mu_ held.
  void ReleaseEvictedChunkLocked(Buffer* v);
  // Frees a buffer's clean host copy (Buffer::clean_host) once the page-in
  // that read it has landed. Inline for the same reason as
  // ReleaseSettledHostCopies: every pin and free asks.
  void ReleaseCleanCopyLocked(Buffer* b) {
    if (b->clean_host != nullptr) FreeCleanCopyLocked(b);
  }
  void FreeCleanCopyLocked(Buffer* b);
  // Every clean host copy, for a page-out that found the host pool full.
  void ReleaseAllCleanCopiesLocked();
  // Evicts `v` without a copy if it has a clean host copy and the page-in
  // that brought it has landed: its chunk is freed and the host copy is its
  // own again. False, changing nothing, otherwise.
  bool TryEvictCleanLocked(Buffer* v);
  void NoteVictimLocked(const Buffer* v);
  // A prefetched buffer is paged out again before its pin: the memory it
  // took was needed first. Its key is paged in closer to its use from now.
  void NotePrefetchWastedLocked(Buffer* b);
  // A pin found its buffer still on the host although no prefetch of it
  // was wasted since its last pin: where a wasted prefetch had moved its
  // key closer to the use, that distance was too short.
  void NotePrefetchMissLocked(Buffer* b);
  // The largest allocation the planned step makes before the pin at
  // position `to` and at or after `from`; 0 without a plan.
  size_t LargestAllocationBetween(size_t from, size_t to) const;
  // The largest allocation the planned step makes within the next `pins`
  // pins; 0 while no plan is followed.
  size_t LargestAllocationDueLocked(size_t pins) const;
  // The largest request the device could still take once a free chunk took
  // `rounded`: the largest hole left (BfcArena::LargestFreeAfterTaking),
  // and unfragmented also no more than the bytes the LMS limit leaves.
  size_t RoomAfterTakingLocked(size_t rounded) const;
  // Whether EngineOptions::layout_lookahead applies; and the free chunk
  // taken for planned copy in `b` (from pin position `from`, pinned at
  // `need_at`) beside which every allocation and page-in of that stretch
  // still finds room in a model of the arena, or kInvalidChunk where no
  // place tried has it (layout_lookahead.cc).
  bool LayoutLookAhead() const {
    return options_.layout_lookahead && !options_.unfragmented && !fixed_;
  }
  BfcArena::ChunkHandle TakeChunkForPlannedInLocked(Buffer* b, size_t from,
                                                    size_t need_at,
                                                    bool in_candidate);
  // Counts a look's work and tells the device, which may charge it to its
  // host clock (Device::NoteLayoutLook).
  void NoteLookLocked(size_t events, size_t ranges_scanned);
  // The device bytes a chunk may still take. Unfragmented, the arena's
  // addresses outnumber the device's bytes, and every place that takes a
  // chunk it chose itself (not through the allocation ladder's find) asks
  // this first: the LMS limit less the bytes in use. SIZE_MAX otherwise,
  // where the arena is the device and its addresses bound the bytes.
  size_t DeviceBytesLeftLocked() const;
  // Whether the planned step pins `b` within the next `pins` pins.
  bool PinDueLocked(const Buffer* b, size_t pins) const;
  // Rounded bytes of the buffers other than `except` that the planned step
  // pins within the next `pins` pins and that will need a chunk first
  // (on the host, or on their way there); 0 while no plan is followed.
  size_t BytesDueBackLocked(const Buffer* except, size_t pins) const;
  // Whether `b` is on the host or on its way there for good (an early
  // page-out, which its next pin cancels, is not).
  static bool OnHostOrLeaving(const Buffer* b);
  // Whether no buffer but `except` that the learned order pins from the
  // cursor up to (not including) position `pos` is on the host or leaving
  // for it, so that `except`'s copy in, needed at `pos`, enqueued now delays
  // none needed sooner. Resumes the last scan where its answer still holds
  // (PrefetchState::host_scan).
  bool NothingOnHostBeforeLocked(size_t pos, const Buffer* except);
  // `b` stops being a prefetch not yet pinned (pinned, evicted or freed):
  // a look-ahead prefetch's bytes leave the byte budget's count.
  void EndPrefetchLocked(Buffer* b);
  // Position of the buffer's next pin in the learned step order after the
  // cursor; SIZE_MAX when it is not pinned again this step or nothing is
  // learned yet.
  size_t NextUse(const Buffer* b) const;
  // Whether pins follow the learned order closely enough (at least half of
  // the last pins, 16 or more, were found in it) to let it choose victims
  // and prefetch; otherwise the engine falls back to LRU and on-demand.
  bool FollowingLearnedOrder() const;

  // ---- step_plan.cc ----
  // Notes a memory event of the step being recorded (the plan's input).
  void NoteStepEventLocked(StepEvent::Kind kind, const Buffer* b);
  // Computes from a finished step's events the page-outs an offline
  // planner would choose (Belady over the step's pins, as the planner's
  // Ideal schedule does, at the memory limit) and makes them the next
  // step's early page-outs (victims_learned, start_outs).
  void PlanStepLocked(const std::vector<StepEvent>& events);
  // Whether the plan of the learned step is being followed.
  bool FollowingPlan() const;
  // Starts the page-outs of start_outs not started yet, once the plan is
  // followed. Returns with `lock` held.
  void StartPlannedPageOutsLocked(std::unique_lock<std::mutex>& lock);
  // Pages in the plan's copy-ins whose issue position the step has reached
  // (PlanStepLocked), oldest first; stops at one that finds no free room.
  void StartPlannedPageInsLocked(std::unique_lock<std::mutex>& lock);
  // Keeps page_ins_in_flight_: notes a page-in, drops those that landed.
  void NotePageInLocked(const EventRef& ready, size_t bytes);
  size_t PageInBytesInFlightLocked();

  // ---- prefetch_guard.cc ----
  // A step recorded by the prefetcher ended and the next began at `at`:
  // times the step that ended and moves the guard on.
  void GuardStepEndedLocked(double at);
  // When a step boundary is, for the guard: NowSeconds with the guard on,
  // 0 without (no clock read at every new step id for nothing).
  double GuardNowLocked() const {
    return options_.prefetch_guard ? device_->NowSeconds() : 0;
  }
  // Whether the kernel pinning now runs under a step id that may begin the
  // next step; its pins are then matched as that step's (step_finding.cc).
  bool InCandidateStep() const;
  // The key under which `b` is matched against the learned order now.
  int64_t MatchKey(const Buffer* b) const;
  // The position in the learned order of the next pin (the candidate
  // step's while one is open).
  size_t LearnedCursor() const;

  // ---- fixed_address.cc ----
  // Reserves the virtual range and sets up the page table (Init).
  Status InitFixed();
  // Fixed-mode AllocateChunk: a virtual chunk plus its pages mapped.
  BfcArena::ChunkHandle AllocateChunkFixed(std::unique_lock<std::mutex>& lock,
                                           size_t bytes, Buffer* owner,
                                           AllocSource max_source,
                                           Status* status,
                                           size_t protect_until);
  // Makes [ptr, ptr + size) resident: maps its unmapped pages, trimming
  // cached pages and evicting inactive buffers (mu_ released meanwhile)
  // when the budget is short. `from_evicted`: the range belongs to an
  // evicted buffer (page-in). *source: the ladder step that made room.
  Status MakeResidentFixed(std::unique_lock<std::mutex>& lock, char* ptr,
                           size_t size, bool from_evicted,
                           AllocSource max_source, size_t protect_until,
                           AllocSource* source);
  // A resident allocation's range stops being resident. kFreed: freed (the
  // pages become cached, unmapped later); kEvicted: its bytes are on the
  // host, its pages that nothing resident shares are unmapped now where
  // that is proven safe. Returns an error (and changes nothing) only if the
  // first unmap fails, so the caller can keep the buffer resident.
  enum class Release {
    kFreed,              // freed: pages become cached
    kEvicted,            // bytes on the host: unmap what is safe
    kEvictedKeepMapped,  // a page-in failed before its copy: back to
                         // evicted, pages stay mapped (cached)
  };
  Status ReleaseRangeFixed(const char* ptr, size_t size, Release how);
  // An evicted buffer is destroyed: its pages lose their evicted reference.
  void DropEvictedRangeFixed(const char* ptr, size_t size);
  // Unmaps up to `want` cached pages outside [lo, hi) (page indexes); waits
  // (mu_ released) for the compute stream when a recent free may still be
  // read by queued work. Returns pages unmapped.
  size_t TrimCachedPages(std::unique_lock<std::mutex>& lock, size_t want,
                         size_t lo, size_t hi, Status* status);
  std::vector<Buffer*> ChoosePageVictims(size_t deficit, size_t lo, size_t hi,
                                         size_t protect_until,
                                         size_t max_victims);
  Status CheckPagesLocked() const;
  void FillFixedStats(EngineStats* s) const;
  size_t PageIndex(const void* ptr) const {
    return static_cast<size_t>(static_cast<const char*>(ptr) - vbase_) /
           page_size_;
  }
  // First page and one past the last page of a byte range.
  void PageSpan(const char* ptr, size_t size, size_t* lo, size_t* hi) const {
    *lo = PageIndex(ptr);
    *hi = PageIndex(ptr + size - 1) + 1;
  }

  // ---- stats.cc ----
  EngineStats GetStats() const;
  void ClearStats();
  Status CheckInvariants() const;
  std::string OutOfMemoryMessage(size_t bytes, size_t rounded,
                                 const Status& host_status) const;
  // Device memory in address order, runs of free, raw, pinned, idle and
  // unmovable chunks with their bytes: what splits the free memory, for the
  // out-of-memory message. REQUIRES: mu_ held.
  std::string FragmentationLayout() const;
  // For a request that exceeds the device (RejectLargerThanDevice).
  std::string LargerThanDeviceMessage(size_t bytes) const;
  int64_t NowNs() const;
  // Accounts `delta` chunk bytes owned by `owner` (nullptr: raw) as active
  // or inactive according to owner->active().
  void AddChunkBytes(const Buffer* owner, int64_t delta);
  // Moves a resident buffer's chunk bytes between active and inactive when
  // its activity changes; call with the activity before the change.
  void SetActivity(Buffer* b, bool was_active);
  void CountSource(AllocSource source);

  Device* const device_;
  EngineOptions options_;
  size_t lms_limit_ = 0;
  // Set once Init succeeded (Engine::Init writes it, before any other call
  // by the engine's contract); until then the public methods that need the
  // arena or the host pool refuse with NotInitialized() instead of touching
  // what does not exist yet.
  std::atomic<bool> initialized_{false};
  Status init_status_ = FailedPrecondition("Engine::Init() was not called");
  Status NotInitialized() const;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // buffer state transitions

  // Fixed-address mode state (all guarded by mu_ except the constants).
  struct Page {
    int32_t resident = 0;  // resident allocations' chunks on the page
    int32_t evicted = 0;   // evicted buffers' chunks on the page
    bool mapped = false;
    uint64_t last_free_seq = 0;  // free_seq_ of the last free touching it
  };
  enum PageClass { kPageFree, kPageEvicted, kPageInUse, kPageCached };
  static PageClass Classify(const Page& p) {
    if (p.mapped) return p.resident > 0 ? kPageInUse : kPageCached;
    return p.evicted > 0 ? kPageEvicted : kPageFree;
  }
  bool fixed_ = false;          // options_.fixed_addresses, constant
  size_t page_size_ = 0;        // constant after Init
  size_t budget_pages_ = 0;     // memory_limit / page_size, constant
  char* vbase_ = nullptr;       // the reserved range, constant after Init
  size_t vbytes_ = 0;
  std::vector<Page> pages_;
  size_t page_count_[4] = {0, 0, 0, 0};  // pages per PageClass
  size_t mapped_pages_ = 0;     // kPageInUse + kPageCached
  uint64_t free_seq_ = 0;       // bumped by every free of a resident range
  // Every free with a sequence number <= this is known complete on the
  // device: no queued work reads its pages any more.
  uint64_t synced_seq_ = 0;
  int64_t resident_bytes_ = 0;       // bytes_active_ + bytes_inactive_
  int64_t peak_resident_bytes_ = 0;  // its peak (fixed-mode bytes_in_use)
  int64_t peak_mapped_bytes_ = 0;    // fixed-mode peak_bytes_reserved
  // Owner of a chunk between FindChunk and the end of MakeResidentFixed
  // (mu_ may be released meanwhile); CheckInvariants skips such chunks.
  char claiming_tag_ = 0;

  std::unique_ptr<SubAllocator> device_sub_;
  std::unique_ptr<BfcArena> arena_;    // guarded by mu_
  std::unique_ptr<HostPool> host_pool_;  // own lock

  // Every live buffer (guarded by mu_). The id map is kept only with
  // prefetch, the one user of lookups by id; a hash insert per allocation
  // would otherwise cost a third of the allocation path.
  Buffer* all_head_ = nullptr;
  size_t num_buffers_ = 0;
  std::unordered_map<int64_t, Buffer*> by_id_;
  void TrackBuffer(Buffer* b);
  void UntrackBuffer(Buffer* b);
  template <typename F>
  void ForEachBuffer(F f) const {
    for (Buffer* b = all_head_; b != nullptr;) {
      Buffer* next = b->all_next;  // f may not destroy b, but be safe
      f(b);
      b = next;
    }
  }
  int64_t next_buffer_id_ = 1;
  // Destroyed buffers kept for reuse (guarded by mu_): a heap allocation and
  // free per tensor were a fifth of the allocation path. Not under
  // AddressSanitizer, so that a dangling Buffer* is still caught there.
  std::vector<Buffer*> spare_buffers_;
  Buffer* NewBufferLocked();
  void RecycleBufferLocked(Buffer* b);
  Buffer* lru_head_ = nullptr;  // oldest inactive
  Buffer* lru_tail_ = nullptr;  // newest inactive

  // Last-use epochs (all guarded by mu_). Recording a compute-stream event
  // at every Unpin, so that a page-out or move can wait for the buffer's
  // last use, cost more than the rest of a tensor's lifecycle together (an
  // event object, a driver call on CUDA, a queue entry in the sim) and took
  // mu_ twice per Unpin. Instead an Unpin stamps the buffer with the open
  // epoch under the mu_ acquisition it needs anyway, and an epoch is closed
  // (open_epoch_ advanced under mu_) every kUnpinsPerEpoch unpins, or at
  // once when a page-out needs it; a compute-stream event recorded after the
  // close follows every kernel enqueued before any unpin stamped with it or
  // an earlier epoch (the kernels came before their unpin, the unpin before
  // the close: mu_ orders them). A copy out of a buffer waits for that event:
  // at most kUnpinsPerEpoch unpins' worth of kernels later than the exact
  // last use, which a least-recently-used victim is long past.
  static constexpr uint64_t kUnpinsPerEpoch = 32;
  // The events of the last kEpochRing closed epochs: the throttle's target
  // (run_ahead_epochs closes back) is always among them.
  static constexpr size_t kEpochRing = kMaxRunAheadEpochs + 1;
  uint64_t open_epoch_ = 1;            // stamped by Unpin; never 0
  uint64_t unpins_in_open_epoch_ = 0;  // stamps of open_epoch_
  // Epochs <= this are proven complete (an event covering them was
  // synchronized without error): nothing need be waited for.
  uint64_t completed_epoch_ = 0;
  struct ClosedEpoch {
    uint64_t epoch = 0;     // 0: empty slot
    EventRef event;         // recorded after `epoch` closed
    uint64_t free_seq = 0;  // free_seq_ read before `event` was recorded
  };
  ClosedEpoch closed_epochs_[kEpochRing];  // slot epoch % kEpochRing

  // Host copies whose page-in is enqueued but maybe not finished; freed
  // once their event completes (guarded by mu_).
  struct PendingHostFree {
    void* ptr;
    size_t bytes;
    EventRef event;
  };
  std::vector<PendingHostFree> pending_host_frees_;

  // Early page-outs whose copy is enqueued, not yet settled (guarded by mu_).
  struct EarlyPageOut {
    Buffer* buffer = nullptr;
    void* host = nullptr;
    EventRef done;     // recorded on the D2H stream after the copy
    uint64_t covers = 0;   // last-use epochs the copy waited for
    uint64_t free_seq = 0;
  };
  std::vector<EarlyPageOut> early_outs_;
  // Buffers holding a clean host copy (Buffer::clean_host).
  int64_t clean_copies_ = 0;
  // Page-ins not known to have landed, oldest first (one stream, so they
  // land in order), and their bytes: what a new copy in queues behind.
  // Kept with prefetch on only (StartPlannedPageInsLocked).
  std::deque<std::pair<EventRef, size_t>> page_ins_in_flight_;
  size_t page_in_bytes_in_flight_ = 0;

  // Buffers in a transient state (kPagingOut, kPagingIn, kMoving); an
  // allocation that found nothing to reclaim waits for them to settle.
  int transitions_in_flight_ = 0;

  // Counters (guarded by mu_). BFC counters live in arena_. ClearStats
  // resets this to a default EngineStats, keeping only the fields listed
  // there: a new field here is a cumulative counter unless ClearStats says
  // otherwise.
  EngineStats counters_;
  // The group PlaceDueGroupLocked last looked at (guarded by mu_): each is
  // looked at once, at its first member's pin.
  struct DueGroupSeen {
    uint64_t generation = 0;
    int64_t step = -1;
    size_t end = 0;  // the group's end in the learned order
  } due_group_;
  int64_t bytes_active_ = 0;
  int64_t bytes_inactive_ = 0;

  // Prefetch state (guarded by mu_).
  struct PrefetchState {
    int64_t step = 0;
    int64_t next_ordinal = 0;
    std::vector<int64_t> recording;  // keys pinned this step
    // The last few steps' recordings, newest last: with several functions
    // per step (each its own TensorFlow step id) each has its own order.
    std::vector<std::vector<int64_t>> library;
    // Whether `learned` is still to be chosen from `library` by this step's
    // first pins.
    bool choosing = false;
    std::vector<int64_t> learned;    // the order this step follows
    size_t learned_index = 0;        // which library recording it is
    // The furthest `cursor` got in `learned`, and the pins since it last
    // went further (SwitchRecordingLocked).
    size_t cursor_high = 0;
    size_t stalled_pins = 0;
    size_t switch_at = 0;  // stalled_pins at which to search next
    // Whether `learned` is the newest recording (victims_learned is its).
    bool learned_is_last = false;
    // learned positions of each key, ascending (built when chosen)
    std::unordered_map<int64_t, std::vector<size_t>> positions;
    size_t cursor = 0;
    // Where the last pin found only beyond kResyncWindow, once in the
    // learned order, placed the step (SIZE_MAX: none since one was found).
    size_t lost_at = SIZE_MAX;
    // Where the last pin found beyond kNearPins but within kResyncWindow
    // would have placed the step, not followed until the next pin found
    // agrees (AdvanceCursorLocked); SIZE_MAX: none pending.
    size_t far_at = SIZE_MAX;
    // Step ids seen at the pin sites (NoteStepId): the id of the last kernel,
    // the id of the step being recorded, and a new id that may begin the
    // next step (its pins counted in a row, no pin of the step's own id
    // between them).
    bool has_step_id = false;
    int64_t step_id = 0;
    int64_t dominant_id = 0;
    bool has_candidate = false;
    OpenStep candidate;
    // Pins of other ids since the step's own id last pinned (an
    // interruption): where they began in `recording` and `events`, and how
    // many were matched and found in order (counted once the span is kept).
    bool interrupted = false;
    size_t interruption_index = 0;
    size_t interruption_events = 0;
    uint64_t interruption_bits = 0;
    int interruption_pins = 0;
    int interruption_in_order = 0;
    // Whether each of the last (up to 64) pins was found in `learned`, the
    // newest in the lowest bit.
    uint64_t found_bits = 0;
    int found_history = 0;
    // Buffers of this and the previous step by key (PrefetchKey), and per
    // key size (Buffer::key_size) how many of this step's allocations had it
    // so far.
    std::unordered_map<int64_t, Buffer*> by_key;
    std::unordered_map<uint64_t, int64_t> size_counts;
    // A challenge to the candidate (OpenChallengeLocked): where the first pin
    // of another id came since the candidate's id last pinned, in
    // `recording` and `events`; and the id pinning now, keyed from its own
    // first pin (ChallengerKey), which may take the candidate's place.
    bool challenged = false;
    size_t challenge_index = 0;
    size_t challenge_events = 0;
    OpenStep challenger;
    size_t inflight_bytes = 0;  // prefetched, not yet pinned
    // Per key, how many pins ahead of its use a buffer may be paged in; no
    // entry: prefetch_lookahead. Halved when its prefetch was evicted again
    // before the use (NotePrefetchWastedLocked), dropped when the key then
    // missed (NotePrefetchMissLocked).
    std::unordered_map<int64_t, size_t> distance;
    // Per key, the positions in this step's pin order (recording) at which
    // it was paged out, and the same for the step `learned` comes from.
    std::unordered_map<int64_t, std::vector<size_t>> victims_now;
    std::unordered_map<int64_t, std::vector<size_t>> victims_learned;
    // What this step did to memory, in order (allocations, pins, unpins,
    // frees), each at the pin position it came after: the input of the plan
    // the next step follows (PlanStepLocked).
    std::vector<StepEvent> events;
    // Whether victims_learned holds the plan computed from the recording
    // `learned` is (PlanStepLocked) rather than the victims that step chose.
    bool planned = false;
    // Buffers of earlier steps (keyed by id, or the previous step's by size
    // and rank) which the plan evicts before their first pin in the step,
    // their last use having been in the step before: paged
    // out as soon as the plan is followed (StartPlannedPageOutsLocked).
    std::vector<int64_t> start_outs;
    size_t start_next = 0;  // the first of start_outs not started yet
    // The plan's copy-ins: each evicted buffer's page-in may start at the
    // pin position from which, with its bytes added, the plan's memory
    // stays within the limit until its use (`need_at`), as the planner's
    // Ideal schedule places them. Ordered by issue position.
    struct PlannedIn {
      size_t issue_at = 0;
      size_t need_at = 0;
      int64_t key = 0;
    };
    std::vector<PlannedIn> planned_ins;
    size_t in_next = 0;  // the first of planned_ins not started yet
    // Bumped whenever a buffer starts leaving the device for good or has
    // left it, and whenever the learned order followed changes: either can
    // put a buffer on the host before a position once scanned clear.
    uint64_t host_generation = 0;
    // NothingOnHostBeforeLocked's last scan: the learned positions from
    // `from` up to `clear_to` held nothing but `except` on the host as of
    // `host_generation` (`generation`), keys resolved in or out of the
    // candidate step as `in_candidate` says. `except` is compared, never
    // dereferenced.
    struct HostScan {
      uint64_t generation = ~uint64_t{0};
      bool in_candidate = false;
      const Buffer* except = nullptr;
      size_t from = 0;
      size_t clear_to = 0;
    } host_scan;
    uint64_t plan_generation = 0;  // bumped by every PlanStepLocked
    size_t plan_largest = 0;  // the largest buffer of the planned step
    // The planned step's allocations as (pins before it, rounded bytes),
    // in order (LargestAllocationBetween).
    std::vector<std::pair<size_t, size_t>> plan_allocs;
    // The planned step's events, in order (layout_lookahead.cc; kept only
    // with EngineOptions::layout_lookahead).
    std::vector<StepEvent> plan_events;
    // The last look that found no place for a planned copy in: asked again
    // for the same copy while the free chunks and the bytes in use are what
    // they were, it refuses without a look. Only events that change the free
    // chunks lie between (every allocation, free and page-in does), so the
    // stretch left is what the look resolved less events that changed
    // nothing in its model, and the answer is the same (layout_lookahead.cc).
    struct LookRefused {
      int64_t buffer_id = 0;
      size_t need_at = 0;
      uint64_t generation = 0;
      bool in_candidate = false;
      uint64_t layout = UINT64_MAX;  // none yet
      size_t in_use = 0;
      size_t limit = 0;
    } look_refused;
    // The planned step's unpin positions (pins before each), sorted and
    // distinct: a kernel unpins its inputs once it ran, so these are where
    // one kernel's pins end (due_group.cc).
    std::vector<size_t> plan_unpins;
    size_t early_out_bytes = 0;  // host bytes of early page-outs in flight
    // The prefetch guard (prefetch_guard.cc).
    struct Guard {
      enum class Phase { kWaiting, kTrialOn, kTrialOff, kHolding, kProbing };
      Phase phase = Phase::kWaiting;
      bool paused = false;       // this step runs without prefetch
      int steps = 0;             // steps ended in this phase
      bool has_start = false;
      double step_start = 0;     // when the running step began
      double measured = 0;       // seconds of this phase's measured steps
      double reference = 0;      // the mode to beat: its measured seconds
    } guard;
  } prefetch_;
};

// Defined here: placement.cc and gather.cc both call it with lambdas.
template <typename MayLeave>
size_t Engine::Impl::LargestGapBesideLocked(const Buffer* pinned,
                                            MayLeave may_leave) const {
  return LargestGapOutsideLocked(nullptr, 0, [&](const BfcArena::Chunk& c) {
    return (pinned == nullptr || c.owner != pinned) && may_leave(c);
  });
}

template <typename MayLeave>
size_t Engine::Impl::LargestGapOutsideLocked(const char* lo, size_t size,
                                             MayLeave may_leave) const {
  const char* hi = lo + size;
  // Memory the arena has not reserved yet is a gap of its own (a new
  // region).
  size_t largest = arena_->memory_limit() - arena_->bytes_reserved();
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    size_t gap = 0;
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      const char* end = c->ptr + c->size;
      if (!may_leave(*c)) {
        gap = 0;
      } else if (size == 0 || end <= lo || c->ptr >= hi) {
        gap += c->size;
      } else {
        // The range splits this chunk: the part below it ends a gap, the
        // part above starts one.
        if (c->ptr < lo) largest = std::max(largest, gap + (lo - c->ptr));
        gap = end > hi ? static_cast<size_t>(end - hi) : 0;
      }
      largest = std::max(largest, gap);
    }
  });
  return largest;
}

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_ENGINE_IMPL_H_
