// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The step plan: the page-outs and page-ins an offline schedule would
// choose for the learned step, which the prefetcher then follows.
//
// Planned page-outs: the positions at which prefetch.cc's page-out ahead of
// pressure pages buffers out (victims_learned) are the ones a plan chose
// rather than the ones the step's own (least-recently-used, on-demand)
// reclaims chose. Each step records its memory events (allocations, pins,
// unpins, frees, with rounded sizes, at pin positions); when it ends,
// PlanStepLocked runs that step twice through a model of the device with
// the LMS limit as its only constraint, evicting by next use (Belady) as the
// planner's Ideal schedule does, and keeps the evictions of the second pass.
// A buffer that outlives steps is needed next in the following step: it is
// paged out after its last use here if the plan evicts it later in this
// step or in the next one before its first pin (start_outs: those whose
// last use was in the step before are paged out once the order is trusted).
// The plan names buffers by their prefetch keys: one of this step's that
// is still alive in the next is there the previous step's buffer of its size
// and rank, which is how the second pass finds the first pass's.
// The plan only chooses what goes out and from where; the copies, their
// ordering after the last use and the settling of chunks are the early
// page-out's, so a step that does not follow the plan (a mismatch, another
// function's order) costs time, never data.
//
// Thread-safety: every function runs with mu_ held (StartPlanned* release
// it around their copies and return with it held).

#include <algorithm>
#include <cstdint>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine_impl.h"
#include "prefetch_keys.h"

namespace tflms {
namespace {
// Planned page-ins leave this many times the step's largest buffer free in
// the plan (PlanStepLocked).
constexpr size_t kPlannedInSlack = 2;
// Planned page-ins start only while the page-ins still landing hold at most
// this share of the prefetch budget (StartPlannedPageInsLocked).
constexpr size_t kPlannedInQueueShare = 4;
}  // namespace

void Engine::Impl::NoteStepEventLocked(StepEvent::Kind kind, const Buffer* b) {
  if (fixed_) return;  // no plan there: evictions unmap pages instead
  PrefetchState& p = prefetch_;
  StepEvent e{kind, PrefetchKey(b), p.recording.size(),
              BfcArena::RoundedBytes(b->size)};
  if (p.has_candidate) {
    e.in_candidate = true;
    e.candidate_key = CandidateKey(b);
  }
  if (p.challenged) p.challenger.event_keys.push_back(ChallengerKey(b));
  p.events.push_back(e);
}

bool Engine::Impl::FollowingPlan() const {
  const PrefetchState& p = prefetch_;
  return p.planned && p.learned_is_last && FollowingLearnedOrder();
}

void Engine::Impl::PlanStepLocked(const std::vector<StepEvent>& events) {
  PrefetchState& p = prefetch_;
  p.planned = false;
  p.start_outs.clear();
  p.start_next = 0;
  p.planned_ins.clear();
  p.in_next = 0;
  p.plan_allocs.clear();
  p.plan_unpins.clear();
  p.plan_events.clear();
  ++p.plan_generation;
  if (fixed_ || events.empty()) return;
  if (LayoutLookAhead()) p.plan_events = events;
  for (const StepEvent& ev : events) {
    if (ev.kind == StepEvent::kAlloc || ev.kind == StepEvent::kAllocPinned) {
      p.plan_allocs.push_back({ev.at, ev.bytes});
    } else if (ev.kind == StepEvent::kUnpin) {
      p.plan_unpins.push_back(ev.at);
    }
  }
  std::sort(p.plan_unpins.begin(), p.plan_unpins.end());
  p.plan_unpins.erase(std::unique(p.plan_unpins.begin(), p.plan_unpins.end()),
                      p.plan_unpins.end());
  const size_t n = events.size();
  constexpr size_t kNever = SIZE_MAX;
  // Uses (allocations and pins) of each key, by event index.
  std::unordered_map<int64_t, std::vector<size_t>> uses;
  p.plan_largest = 0;
  // This step's keys whose buffers outlive it: the next step knows them
  // with the earlier-step flag.
  std::unordered_set<int64_t> outlive;
  for (size_t e = 0; e < n; ++e) {
    const StepEvent& ev = events[e];
    if (ev.kind != StepEvent::kUnpin && ev.kind != StepEvent::kFree) {
      uses[ev.key].push_back(e);
    }
    if (ev.key >= 0 && !(ev.key & kPreviousStepBit)) {
      if (ev.kind == StepEvent::kAlloc || ev.kind == StepEvent::kAllocPinned) {
        outlive.insert(ev.key);
      } else if (ev.kind == StepEvent::kFree) {
        outlive.erase(ev.key);
      }
    }
    p.plan_largest = std::max(p.plan_largest, ev.bytes);
  }
  // An earlier step's key names, in the repeated step, the buffer of this
  // step that takes it on; where none does (nothing of that size and rank
  // outlives this step), the same buffer as now, which kept its key.
  auto taken_on = [&](int64_t key) {
    return outlive.count(key & ~kPreviousStepBit) != 0;
  };
  const size_t capacity = lms_limit_;
  // The step is simulated twice, as it repeats: the first pass leaves the
  // buffers that outlive steps where the second (the one planned) finds
  // them. A step's own tensors are new objects in each pass: in the second,
  // a key of this step names a new instance (kSecondPassBit), and an
  // earlier step's key the first pass's buffer that takes it on (taken_on).
  constexpr int64_t kSecondPassBit = int64_t{1} << 62;
  auto instance = [&](int64_t key, size_t pass) -> int64_t {
    if (key < 0 || pass == 0) return key;
    if (key & kPreviousStepBit) {
      return taken_on(key) ? key & ~kPreviousStepBit : key;
    }
    return key | kSecondPassBit;
  };
  // The key the next step will know a second-pass instance by.
  auto next_step_key = [&](int64_t ik, int64_t* key) {
    if (ik < 0 || (ik & kSecondPassBit)) {
      *key = ik < 0 ? ik : ik & ~kSecondPassBit;
      return true;
    }
    *key = ik | kPreviousStepBit;  // this step's, or an earlier one's kept
    return true;
  };
  struct Inst {
    size_t bytes = 0;
    int pins = 0;
    bool resident = false;
    size_t next_use = kNever;
    size_t last_unpin = kNever;
    // Where the plan evicted it: the event index in the second pass, or
    // kEvictedBefore if in the first (a buffer that outlives steps).
    size_t evicted_at = kNever;
  };
  constexpr size_t kEvictedBefore = SIZE_MAX - 1;
  // The second pass's bytes on the device after each event, and the copies
  // back in that its evictions cause (event indices).
  struct CopyIn {
    int64_t key;
    size_t after;  // the first event from which it may be issued
    size_t need;
    size_t bytes;
  };
  std::vector<size_t> mem(n, 0);
  std::vector<CopyIn> copy_ins;
  std::unordered_map<int64_t, Inst> inst;
  std::priority_queue<std::pair<size_t, int64_t>> heap;  // (next use, key)
  auto next_use = [&](int64_t key, size_t pass, size_t e) {
    auto it = uses.find(key);
    if (it != uses.end()) {
      const std::vector<size_t>& u = it->second;
      auto nx = std::upper_bound(u.begin(), u.end(), e);
      if (nx != u.end()) return pass * n + *nx;
    }
    // A buffer that outlives the step is used again in the next one: by id,
    // by the key it kept, or, one of this step's, by its earlier-step key.
    // An earlier step's buffer whose key this step's takes on is not.
    if (key >= 0 && (key & kPreviousStepBit) && taken_on(key)) return kNever;
    const auto next = uses.find(key < 0 ? key : key | kPreviousStepBit);
    if (next == uses.end() || next->second.empty()) return kNever;
    return (pass + 1) * n + next->second.front();
  };
  std::unordered_map<int64_t, std::vector<size_t>> victims;
  size_t used = 0;
  std::vector<std::pair<size_t, int64_t>> pinned_aside;
  for (size_t pass = 0; pass < 2; ++pass) {
    for (size_t e = 0; e < n; ++e) {
      const StepEvent& ev = events[e];
      const size_t t = pass * n + e;
      const int64_t ik = instance(ev.key, pass);
      if (ev.kind == StepEvent::kUnpin) {
        auto it = inst.find(ik);
        if (it != inst.end() && it->second.pins > 0) --it->second.pins;
        if (it != inst.end()) it->second.last_unpin = t;
      } else if (ev.kind == StepEvent::kFree) {
        auto it = inst.find(ik);
        if (it != inst.end()) {
          if (it->second.resident) used -= it->second.bytes;
          inst.erase(it);
        }
      } else {
        Inst& s = inst[ik];
        s.bytes = ev.bytes;
        if (!s.resident) {
          s.resident = true;
          used += s.bytes;
          int64_t key = 0;
          if (pass == 1 && s.evicted_at != kNever &&
              next_step_key(ik, &key)) {
            copy_ins.push_back({key,
                                s.evicted_at == kEvictedBefore
                                    ? 0
                                    : s.evicted_at + 1,
                                e, s.bytes});
          }
          s.evicted_at = kNever;
        }
        if (ev.kind != StepEvent::kAlloc) ++s.pins;
        s.next_use = next_use(ev.key, pass, e);
        heap.push({s.next_use, ik});
        while (used > capacity && !heap.empty()) {
          const std::pair<size_t, int64_t> top = heap.top();
          heap.pop();
          auto it = inst.find(top.second);
          if (it == inst.end() || !it->second.resident ||
              it->second.next_use != top.first) {
            continue;  // stale
          }
          if (it->second.pins > 0) {
            pinned_aside.push_back(top);
            continue;
          }
          Inst& v = it->second;
          v.resident = false;
          used -= v.bytes;
          v.evicted_at = pass == 0 ? kEvictedBefore : e;
          if (pass == 0) continue;
          int64_t key = 0;
          if (!next_step_key(top.second, &key)) continue;
          const bool from_before = key < 0 || (key & kPreviousStepBit);
          if (from_before && (v.last_unpin == kNever || v.last_unpin < n)) {
            // Last used in the step before: nothing in this one to start
            // its page-out from.
            p.start_outs.push_back(key);
          }
          victims[key].push_back(ev.at);
        }
        for (const auto& entry : pinned_aside) heap.push(entry);
        pinned_aside.clear();
      }
      if (pass == 1) mem[e] = used;
    }
  }
  // Each copy in starts at the earliest event from which the memory, its
  // bytes added, stays within the limit until its use; taken in order of
  // use, so a nearer use gets the room first (the planner's Ideal schedule,
  // yardsticks.py, places its copies the same way). Events before its
  // eviction, and the first pass (the step before), are out of reach.
  // The plan knows bytes, not addresses: copies placed right up to the
  // limit split the holes that the step's large buffers then do not find,
  // and those allocations page out on demand, the host waiting. Leaving
  // twice the step's largest buffer free was the best of 0 to 3 times on
  // the planner's 26 prefetch points (ResNet50 at batch 398 on PCIe 3:
  // 4.22 s with none, 3.20 s with it, 3.43 s without planned page-ins).
  // With the layout look-ahead, each copy's place is checked against the
  // allocations of its own stretch instead (layout_lookahead.cc).
  const size_t slack =
      LayoutLookAhead() ? 0
                        : std::min(capacity, kPlannedInSlack * p.plan_largest);
  const size_t room = capacity - slack;
  for (const CopyIn& c : copy_ins) {
    size_t issue = c.after;
    for (size_t e = c.need; e > c.after; --e) {
      if (mem[e - 1] + c.bytes > room) {
        issue = e;
        break;
      }
    }
    for (size_t e = issue; e < c.need; ++e) mem[e] += c.bytes;
    p.planned_ins.push_back({events[issue].at, events[c.need].at, c.key});
  }
  std::stable_sort(p.planned_ins.begin(), p.planned_ins.end(),
                   [](const PrefetchState::PlannedIn& a,
                      const PrefetchState::PlannedIn& b) {
                     return a.issue_at < b.issue_at;
                   });
  // The plan knows no host limit and no fragmentation. Each planned
  // page-out leaves the pool room for the step's largest buffer instead
  // (PlannedPageOutLeavesRoomLocked), so an on-demand reclaim that
  // fragmentation asks for still finds host room. Dropping the whole plan
  // where its peak came within one buffer of the pool, as this did before,
  // repeated the step's own LRU evictions and lost to on-demand paging for
  // UNet3D at 464^3 on the 80 GB GPUs (H100: 5.99 s against 5.75 s; planned
  // 5.32 s).
  p.victims_learned = std::move(victims);
  p.planned = true;
}

void Engine::Impl::NotePageInLocked(const EventRef& ready, size_t bytes) {
  PageInBytesInFlightLocked();  // drops the landed ones first
  page_ins_in_flight_.emplace_back(ready, bytes);
  page_in_bytes_in_flight_ += bytes;
}

size_t Engine::Impl::PageInBytesInFlightLocked() {
  while (!page_ins_in_flight_.empty() &&
         device_->EventDone(page_ins_in_flight_.front().first)) {
    page_in_bytes_in_flight_ -= page_ins_in_flight_.front().second;
    page_ins_in_flight_.pop_front();
  }
  return page_in_bytes_in_flight_;
}

void Engine::Impl::StartPlannedPageInsLocked(
    std::unique_lock<std::mutex>& lock) {
  PrefetchState& p = prefetch_;
  if (!FollowingPlan()) return;
  const uint64_t generation = p.plan_generation;
  while (p.in_next < p.planned_ins.size()) {
    const bool in_candidate = InCandidateStep();
    const size_t cursor = in_candidate ? p.candidate.cursor : p.cursor;
    const size_t i = p.in_next;
    const PrefetchState::PlannedIn in = p.planned_ins[i];
    if (in.issue_at > cursor) return;
    // A planned copy in is for a use further away than the look-ahead's,
    // and copies on one stream run in order: queued behind much else it
    // only delays copies needed sooner. So it starts only while little is
    // still landing. Without this check GPT-2 1.5B with Adam on the DGX-1
    // stepped in 5.342 s against 5.036 s without planned page-ins (5.029 s
    // with it), and 6 of the 26 results points were 1-5% slower (1 of 26,
    // by 1.2%, with it).
    // Unless nothing the step pins before its use is still on the host:
    // then what it queues behind is needed sooner anyway, and it delays
    // nothing, the stream serving copies by deadline as the Ideal's link
    // does. Held back there, the copies of the backward pass's last blocks
    // waited while the look-ahead kept more than the share landing, until
    // the look-ahead itself issued them, 6-127 pins before their use:
    // ResNet50 at 712 on the DGX-1 stepped 3.3% faster with this, and the
    // results points at neighbouring batches 0.49% faster by geometric mean
    // (32 of 124 by over 1%, 10 slower by over 1%).
    // Its pin is past (on demand then), or it is not on the host: skipped.
    Buffer* b = in.need_at < cursor ? nullptr
                                    : BufferForKeyLocked(in.key, in_candidate);
    const bool wanted = b != nullptr && b->state == BufferState::kReclaimed &&
                        !b->free_requested;
    bool queued = false;
    if (PageInBytesInFlightLocked() >
        options_.prefetch_budget_bytes / kPlannedInQueueShare) {
      if (!wanted || !NothingOnHostBeforeLocked(in.need_at, b)) return;
      queued = true;
    }
    p.in_next = i + 1;
    if (!wanted) continue;
    // Only into room that is free, with early page-outs whose copies are
    // done settled first (never waiting for one): the plan counted on that
    // room, and a reclaim here would evict what the plan keeps. And only
    // where a free chunk would still hold the step's largest buffer: a
    // page-in that split the hole a large allocation needs made it page
    // out on demand (ResNet50 at batch 398, PCIe 3: 7.7 GB more each way).
    while (!early_outs_.empty() && device_->EventDone(early_outs_[0].done)) {
      SettleEarlyPageOutsLocked(lock, /*max=*/1);
    }
    if (p.plan_generation != generation) return;
    const size_t rounded = BfcArena::RoundedBytes(b->size);
    const bool look = LayoutLookAhead();
    if (arena_->bytes_in_use() + rounded > lms_limit_ ||
        arena_->LargestFreeChunk() < rounded ||
        (!look && RoomAfterTakingLocked(rounded) < p.plan_largest)) {
      p.in_next = i;  // no room yet: again at the next pin
      return;
    }
    BfcArena::ChunkHandle into = BfcArena::kInvalidChunk;
    if (look) {
      into = TakeChunkForPlannedInLocked(b, cursor, in.need_at, in_candidate);
      if (into == BfcArena::kInvalidChunk) {
        p.in_next = i;  // no place yet: again at the next pin
        return;
      }
    }
    Status s = PageIn(lock, b, /*for_prefetch=*/true, in.need_at,
                      /*no_reclaim=*/true, into);
    if (b->free_requested) {
      DestroyBufferLocked(b);
    } else if (s.ok()) {
      ++counters_.num_prefetches;
      ++counters_.num_planned_prefetches;
      if (queued) ++counters_.num_planned_prefetches_queued;
      b->prefetched = true;
      b->prefetch_distance = in.need_at - std::min(in.need_at, cursor);
      b->prefetch_planned = true;
    } else if (p.plan_generation == generation && p.in_next == i + 1) {
      // No room yet (fragmentation, or frees still to come): try again
      // at the next pin, the copies after it waiting as a stream would.
      p.in_next = i;
      return;
    }
    if (p.plan_generation != generation) return;  // a new step's plan
  }
}

void Engine::Impl::StartPlannedPageOutsLocked(
    std::unique_lock<std::mutex>& lock) {
  PrefetchState& p = prefetch_;
  if (p.start_next >= p.start_outs.size() || !FollowingPlan()) return;
  while (p.start_next < p.start_outs.size()) {
    const int64_t key = p.start_outs[p.start_next++];
    Buffer* b = BufferForKeyLocked(key, InCandidateStep());
    if (b == nullptr) continue;
    if (!Reclaimable(b) || b->last_use_epoch == 0) continue;
    if (!PlannedPageOutLeavesRoomLocked(b)) continue;
    StartEarlyPageOut(lock, b);  // releases mu_ meanwhile
  }
}

}  // namespace tflms
