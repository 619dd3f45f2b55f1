// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Step-pattern prefetch.
//
// Training repeats the same step, so the order in which buffers are pinned
// repeats too. During a step the engine records the pin order; from the
// next step on, each pin looks `prefetch_lookahead` pins ahead in the
// recorded order and pages in the reclaimed buffers it finds there, so their
// host-to-device copies overlap the compute in between instead of stalling
// the op that needs them (TFLMS v2 only paged in on demand).
//
// Identity across steps: tensors are new objects every step, so a buffer is
// known by the ordinal of its allocation within the step that created it;
// buffers that outlive their step (weights, optimizer slots) are known by
// their id. Both are stable from one step to the next as long as the step's
// allocation order is (TensorFlow's executor is deterministic for a fixed
// graph; a mismatch only costs a missed prefetch, never correctness).
//
// Steps inside TensorFlow: nothing calls StepBegin there; every kernel's
// pin site passes its context's step id (NoteStepId). Every tf.function call
// gets a new id, and so does every eager op, while functional control flow
// (While, If, nested calls) runs under its caller's. Kernels of other ids
// interleave with a step's (an input pipeline's functions, a callback's eager
// ops), so a new id does not end the step at once: it becomes the candidate,
// and only once kMinStepPins of its pins came in a row (no pin of the step's
// own id between them) does the next step begin, retroactively at the
// candidate's first pin. The pins and allocations since then move over to the
// new step, keys renumbered. A return to the step's id drops the candidate;
// eager ops and small functions between steps stay in the step before.
// A step of several functions (each its own id, e.g. a custom loop calling a
// gradient function and then an apply function) yields one recording per
// function; the last kLibrarySize recordings are kept and each step follows
// the one in which its first pin comes earliest. The first (tracing) call of
// a function pins in an order of its own; the next call's recording replaces
// it, so prefetch starts from the third call.
//
// Bounds: prefetched-but-not-yet-pinned bytes stay under
// prefetch_budget_bytes, except one tensor larger than the budget paged in
// alone into memory that is free; a prefetch may evict at most one victim
// (single reclaim), never run a full reclaim or defragmentation, and a key
// whose prefetch was evicted again before its use is paged in closer to it
// (half the distance) from then on.
//
// Page-out ahead of pressure: the positions at which each key was paged out
// are noted per step; in the next step, a buffer unpinned at its last use
// before such a position (and needed again beyond the look-ahead) starts its
// copy to the host at once without the host waiting for it
// (StartEarlyPageOut), so the device-to-host link works while the compute
// stream does, instead of when an allocation finds no room and the host,
// and then the compute stream, wait for the copy.
//
// Planned page-outs: the positions above are the ones a plan chose
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
// The plan only chooses what goes out and from where; the copies, their
// ordering after the last use and the settling of chunks are the early
// page-out's, so a step that does not follow the plan (a mismatch, another
// function's order) costs time, never data.
#include <algorithm>
#include <cstdint>
#include <queue>

#include "engine_impl.h"

namespace tflms {
namespace {
// How far ahead of the cursor a pin is searched for in the learned order.
constexpr size_t kResyncWindow = 64;
// Fewer pins than this under one step id are not a step of their own (an
// eager op pins its few inputs; a training step's function hundreds).
constexpr size_t kMinStepPins = 16;
// Recordings kept to choose from (functions per step, times two).
constexpr size_t kLibrarySize = 4;
// Pins looked back on before the learned order is trusted: where steps do
// not repeat (loop iterations that run in parallel allocate in a different
// order each time) following it would evict what is needed next.
constexpr int kTrustPins = 16;
}  // namespace

int64_t PrefetchKey(const Buffer* b) {
  return b->step_ordinal >= 0 ? b->step_ordinal : -b->id;
}

void Engine::Impl::StepBegin() {
  std::lock_guard<std::mutex> lock(mu_);
  StepBeginLocked();
}

void Engine::Impl::NoteStepId(int64_t step_id) {
  std::lock_guard<std::mutex> lock(mu_);
  PrefetchState& p = prefetch_;
  p.step_id = step_id;
  if (!p.has_step_id) {
    p.has_step_id = true;
    p.dominant_id = step_id;
    return;
  }
  if (step_id == p.dominant_id) {
    p.has_candidate = false;  // an interruption, not a new step
  } else if (!p.has_candidate || step_id != p.candidate_id) {
    p.has_candidate = true;
    p.candidate_id = step_id;
    p.candidate_pins = 0;
    p.candidate_index = p.recording.size();
    p.candidate_ordinal = p.next_ordinal;
    p.candidate_cursor = 0;
  }
}

void Engine::Impl::FollowRecording(size_t index) {
  PrefetchState& p = prefetch_;
  p.learned = p.library[index];
  p.learned_is_last = index + 1 == p.library.size();
  p.positions.clear();
  for (size_t i = 0; i < p.learned.size(); ++i) {
    p.positions[p.learned[i]].push_back(i);
  }
}

void Engine::Impl::StepBeginLocked() {
  SplitStepLocked(prefetch_.recording.size(), prefetch_.next_ordinal);
}

void Engine::Impl::SplitStepLocked(size_t index, int64_t ordinal_base) {
  PrefetchState& p = prefetch_;
  // What the new step already pinned and allocated moves over to it: its
  // keys and its buffers' ordinals count from ordinal_base; buffers of the
  // finished step that are still alive are long-lived from here on, known
  // by id.
  std::unordered_map<int64_t, Buffer*> moved;
  for (auto& entry : p.by_ordinal) {
    Buffer* b = entry.second;
    if (entry.first >= ordinal_base) {
      b->step_ordinal = entry.first - ordinal_base;
      b->step_created = p.step + 1;
      moved[b->step_ordinal] = b;
    } else {
      b->step_ordinal = -1;
    }
  }
  std::vector<int64_t> tail;
  for (size_t i = index; i < p.recording.size(); ++i) {
    const int64_t k = p.recording[i];
    if (k < 0) {
      tail.push_back(k);
    } else if (k >= ordinal_base) {
      tail.push_back(k - ordinal_base);
    } else {
      // A buffer freed since has no key worth learning: it cannot recur.
      auto it = p.by_ordinal.find(k);
      if (it != p.by_ordinal.end()) tail.push_back(-it->second->id);
    }
  }
  // Victims noted at positions before `index` are the finished step's; later
  // ones are the new step's, renumbered like its pins.
  std::unordered_map<int64_t, std::vector<size_t>> victims_tail;
  for (auto& entry : p.victims_now) {
    std::vector<size_t> before;
    for (size_t at : entry.second) {
      if (at < index) {
        before.push_back(at);
      } else {
        int64_t key = entry.first;
        if (key >= ordinal_base) {
          key -= ordinal_base;
        } else if (key >= 0) {
          auto it = p.by_ordinal.find(key);
          if (it == p.by_ordinal.end()) continue;  // freed: cannot recur
          key = -it->second->id;
        }
        victims_tail[key].push_back(at - index);
      }
    }
    entry.second = std::move(before);
  }
  // Events likewise: before `index` the finished step's, the rest the new
  // step's, keys and positions renumbered.
  std::vector<StepEvent> finished_events;
  std::vector<StepEvent> events_tail;
  for (const StepEvent& e : p.events) {
    if (e.at < index) {
      finished_events.push_back(e);
      continue;
    }
    StepEvent moved_event = e;
    moved_event.at = e.at - index;
    if (e.key >= ordinal_base) {
      moved_event.key = e.key - ordinal_base;
    } else if (e.key >= 0) {
      auto it = p.by_ordinal.find(e.key);
      if (it == p.by_ordinal.end()) continue;  // freed: cannot recur
      moved_event.key = -it->second->id;
    }
    events_tail.push_back(moved_event);
  }
  p.events = std::move(events_tail);
  p.recording.resize(index);
  if (!p.recording.empty()) {
    p.victims_learned = std::move(p.victims_now);
    PlanStepLocked(finished_events);
    if (p.library.size() == kLibrarySize) p.library.erase(p.library.begin());
    p.library.push_back(std::move(p.recording));
    // Until this step's first pins say otherwise, it follows the last one.
    FollowRecording(p.library.size() - 1);
    p.choosing = p.library.size() > 1;
  }
  p.victims_now = std::move(victims_tail);
  p.recording = std::move(tail);
  p.cursor = 0;
  ++p.step;
  p.next_ordinal -= ordinal_base;
  p.by_ordinal = std::move(moved);
}

bool Engine::Impl::FollowingLearnedOrder() const {
  const PrefetchState& p = prefetch_;
  if (!options_.prefetch_enabled || p.learned.empty()) return false;
  if (p.found_history < kTrustPins) return false;
  const int found = __builtin_popcountll(p.found_bits);
  return 2 * found >= p.found_history;
}

bool Engine::Impl::InCandidateStep() const {
  const PrefetchState& p = prefetch_;
  return p.has_candidate && p.step_id == p.candidate_id;
}

int64_t Engine::Impl::MatchKey(const Buffer* b) const {
  const int64_t key = PrefetchKey(b);
  if (!InCandidateStep() || key < 0) return key;
  // As it will be keyed once the candidate step is confirmed.
  return key >= prefetch_.candidate_ordinal ? key - prefetch_.candidate_ordinal
                                            : -b->id;
}

size_t Engine::Impl::NextUse(const Buffer* b) const {
  auto it = prefetch_.positions.find(MatchKey(b));
  if (it == prefetch_.positions.end()) return SIZE_MAX;
  const std::vector<size_t>& pos = it->second;
  const size_t cursor =
      InCandidateStep() ? prefetch_.candidate_cursor : prefetch_.cursor;
  auto next = std::lower_bound(pos.begin(), pos.end(), cursor);
  return next == pos.end() ? SIZE_MAX : *next;
}

bool Engine::Impl::ShouldPageOutEarlyLocked(const Buffer* b) const {
  const PrefetchState& p = prefetch_;
  if (fixed_ || !p.learned_is_last || b->pin_count > 0 || !Reclaimable(b) ||
      !FollowingLearnedOrder()) {
    return false;
  }
  auto it = p.victims_learned.find(MatchKey(b));
  if (it == p.victims_learned.end()) return false;
  const size_t next = NextUse(b);
  const size_t cursor = InCandidateStep() ? p.candidate_cursor : p.cursor;
  const bool plan = FollowingPlan();
  if (plan && options_.host_memory_limit > 0) {
    // The plan knows no host limit: it leaves the host pool room for the
    // step's largest buffer, which an on-demand reclaim may still need
    // where fragmentation asks for more than the plan evicted (UNet3D on
    // an 80 GB GPU filled a 128 GiB pool otherwise).
    const size_t host_used =
        static_cast<size_t>(counters_.current_bytes_reclaimed) +
        p.early_out_bytes;
    if (host_used + b->size + p.plan_largest > options_.host_memory_limit) {
      return false;
    }
  }
  if (next == SIZE_MAX) {
    // Not pinned again this step. A step's own tensor is freed before it
    // is needed again. A buffer that outlives steps is next needed in the
    // next step: the plan pages it out now if it evicts it after this
    // point, or in the next step before its first pin there.
    if (!plan || MatchKey(b) >= 0) return false;
    auto first = p.positions.find(MatchKey(b));
    const size_t first_pin =
        first == p.positions.end() ? 0 : first->second.front();
    for (size_t at : it->second) {
      if (at >= cursor || at < first_pin) return true;
    }
    return false;
  }
  // Within the look-ahead window prefetch would page it straight back in:
  // leave it to on-demand reclaim, which evicts only under real pressure.
  if (next - cursor < static_cast<size_t>(options_.prefetch_lookahead)) {
    return false;
  }
  // The step the order was learned from paged it out between this use and
  // the next (or, following the plan, Belady's simulation of it does): the
  // room it holds is needed before it is.
  for (size_t at : it->second) {
    if (at >= cursor && at < next) return true;
  }
  return false;
}

void Engine::Impl::NoteVictimLocked(const Buffer* v) {
  prefetch_.victims_now[MatchKey(v)].push_back(prefetch_.recording.size());
}

void Engine::Impl::NotePrefetchWastedLocked(Buffer* b) {
  const size_t halved = b->prefetch_distance / 2;
  prefetch_.distance[MatchKey(b)] = std::max<size_t>(halved, 1);
}

void Engine::Impl::ForgetBufferForPrefetch(Buffer* b) {
  if (options_.prefetch_enabled) NoteStepEventLocked(StepEvent::kFree, b);
  if (b->step_ordinal >= 0 && b->step_created == prefetch_.step) {
    prefetch_.by_ordinal.erase(b->step_ordinal);
  }
}

std::vector<Buffer*> Engine::Impl::NotePinAndPlan(Buffer* b) {
  PrefetchState& p = prefetch_;
  const int64_t key = PrefetchKey(b);
  NoteStepEventLocked(StepEvent::kPin, b);
  p.recording.push_back(key);
  if (p.has_candidate && p.step_id == p.candidate_id &&
      ++p.candidate_pins >= kMinStepPins) {
    // A new step id that pinned enough in a row: its step began where the id
    // first appeared.
    p.has_candidate = false;
    p.dominant_id = p.candidate_id;
    const size_t reached = p.candidate_cursor;
    SplitStepLocked(p.candidate_index, p.candidate_ordinal);
    p.cursor = reached;
    p.choosing = false;
  }
  std::vector<Buffer*> plan;
  // Pins of a candidate step are matched, until it is confirmed or dropped,
  // as if it had begun where it first appeared: its own cursor, and ordinals
  // counted from its first allocation (older buffers by id, as they will be).
  const bool in_candidate = InCandidateStep();
  const int64_t offset = in_candidate ? p.candidate_ordinal : 0;
  const int64_t match_key = MatchKey(b);
  size_t& cursor = in_candidate ? p.candidate_cursor : p.cursor;
  if (p.choosing && !in_candidate) {
    // The recording in which this pin comes earliest (the newest on a tie)
    // is the order this step follows.
    size_t best = SIZE_MAX, best_at = kResyncWindow;
    for (size_t c = p.library.size(); c-- > 0;) {
      const std::vector<int64_t>& keys = p.library[c];
      const size_t n = std::min(keys.size(), best_at);
      for (size_t i = 0; i < n; ++i) {
        if (keys[i] == key) {
          best = c;
          best_at = i;
          break;
        }
      }
    }
    if (best != SIZE_MAX) {
      p.choosing = false;
      if (best != p.library.size() - 1) FollowRecording(best);
    } else if (p.recording.size() >= kResyncWindow) {
      p.choosing = false;  // keep following the last step's order
    }
  }
  if (p.learned.empty()) return plan;
  const size_t end = std::min(p.learned.size(), cursor + kResyncWindow);
  bool found = false;
  for (size_t i = cursor; i < end; ++i) {
    if (p.learned[i] == match_key) {
      cursor = i + 1;
      found = true;
      break;
    }
  }
  p.found_bits = (p.found_bits << 1) | (found ? 1 : 0);
  p.found_history = std::min(p.found_history + 1, 64);
  if (!found || !FollowingLearnedOrder()) return plan;
  size_t budget_left = options_.prefetch_budget_bytes > p.inflight_bytes
                           ? options_.prefetch_budget_bytes - p.inflight_bytes
                           : 0;
  const size_t stop =
      std::min(p.learned.size(),
               cursor + static_cast<size_t>(options_.prefetch_lookahead));
  for (size_t i = cursor; i < stop; ++i) {
    const int64_t k = p.learned[i];
    Buffer* next = nullptr;
    if (k >= 0) {
      auto it = p.by_ordinal.find(k + offset);
      if (it != p.by_ordinal.end()) next = it->second;
    } else {
      auto it = by_id_.find(-k);
      if (it != by_id_.end()) next = it->second;
    }
    if (next == nullptr || next->state != BufferState::kReclaimed ||
        next->free_requested) {
      continue;
    }
    auto d = p.distance.find(k);
    if (d != p.distance.end() && i - cursor >= d->second) continue;
    if (next->size > budget_left) {
      // A tensor larger than the budget is paged in only first in line,
      // with nothing else in flight, and only into a hole that is free now
      // (RunPrefetch: no reclaim). Allowed to evict, such page-ins made the
      // planner's ResNet50 at 6x batch swap 23% more bytes; never prefetched,
      // they were 12 of its 13 misses at 4x while 10-13 GiB sat free.
      if (plan.empty() && p.inflight_bytes == 0 &&
          arena_ != nullptr &&
          arena_->LargestFreeChunk() >= BfcArena::RoundedBytes(next->size)) {
        plan.push_back(next);
      }
      break;
    }
    budget_left -= next->size;
    plan.push_back(next);
  }
  return plan;
}

void Engine::Impl::RunPrefetch(std::unique_lock<std::mutex>& lock,
                               const std::vector<Buffer*>& plan) {
  // Copy the ids: PageIn releases mu_, and a planned buffer may be freed
  // meanwhile, so each is looked up again before use.
  std::vector<int64_t> ids;
  ids.reserve(plan.size());
  for (Buffer* b : plan) ids.push_back(b->id);
  for (int64_t id : ids) {
    auto it = by_id_.find(id);
    if (it == by_id_.end()) continue;
    Buffer* b = it->second;
    if (b->state != BufferState::kReclaimed || b->free_requested) continue;
    // Evicting for a prefetch must not push out what is needed before it.
    const size_t needed_at = NextUse(b);
    // Over the budget: only into free memory (NotePinAndPlan).
    // Over the budget: only into free memory (NotePinAndPlan).
    Status s = PageIn(lock, b, /*for_prefetch=*/true,
                      needed_at == SIZE_MAX ? 0 : needed_at,
                      /*no_reclaim=*/b->size > options_.prefetch_budget_bytes);
    if (b->free_requested) {
      DestroyBufferLocked(b);
      continue;
    }
    if (!s.ok()) break;  // no room without costly reclaim: stop here
    ++counters_.num_prefetches;
    b->prefetched = true;
    const size_t cursor =
        InCandidateStep() ? prefetch_.candidate_cursor : prefetch_.cursor;
    b->prefetch_distance =
        needed_at == SIZE_MAX || needed_at < cursor ? 0 : needed_at - cursor;
    prefetch_.inflight_bytes += b->size;
  }
}

void Engine::Impl::NoteStepEventLocked(StepEvent::Kind kind, const Buffer* b) {
  if (fixed_) return;  // no plan there: evictions unmap pages instead
  prefetch_.events.push_back({kind, PrefetchKey(b), prefetch_.recording.size(),
                              BfcArena::RoundedBytes(b->size)});
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
  if (fixed_ || events.empty()) return;
  const size_t n = events.size();
  constexpr size_t kNever = SIZE_MAX;
  // Uses (allocations and pins) of each key, by event index.
  std::unordered_map<int64_t, std::vector<size_t>> uses;
  int64_t stride = 1;
  p.plan_largest = 0;
  for (size_t e = 0; e < n; ++e) {
    const StepEvent& ev = events[e];
    if (ev.kind != StepEvent::kUnpin && ev.kind != StepEvent::kFree) {
      uses[ev.key].push_back(e);
    }
    p.plan_largest = std::max(p.plan_largest, ev.bytes);
    stride = std::max(stride, ev.key + 1);
  }
  const size_t capacity = lms_limit_;
  // The step is simulated twice, as it repeats: the first pass leaves the
  // buffers that outlive steps where the second (the one planned) finds
  // them. A step's own tensors are new objects in each pass.
  struct Inst {
    size_t bytes = 0;
    int pins = 0;
    bool resident = false;
    bool on_host = false;
    size_t next_use = kNever;
    size_t last_unpin = kNever;
  };
  std::unordered_map<int64_t, Inst> inst;
  std::priority_queue<std::pair<size_t, int64_t>> heap;  // (next use, key)
  auto next_use = [&](int64_t key, size_t pass, size_t e) {
    auto it = uses.find(key);
    if (it == uses.end()) return kNever;
    const std::vector<size_t>& u = it->second;
    auto nx = std::upper_bound(u.begin(), u.end(), e);
    if (nx != u.end()) return pass * n + *nx;
    // A buffer that outlives the step is used again in the next one.
    if (key < 0 && !u.empty()) return (pass + 1) * n + u.front();
    return kNever;
  };
  std::unordered_map<int64_t, std::vector<size_t>> victims;
  size_t used = 0;
  size_t host = 0;       // bytes the plan keeps on the host
  size_t peak_host = 0;  // their peak in the second pass
  std::vector<std::pair<size_t, int64_t>> pinned_aside;
  for (size_t pass = 0; pass < 2; ++pass) {
    for (size_t e = 0; e < n; ++e) {
      const StepEvent& ev = events[e];
      const size_t t = pass * n + e;
      const int64_t ik =
          ev.key >= 0 ? ev.key + static_cast<int64_t>(pass) * stride : ev.key;
      if (ev.kind == StepEvent::kUnpin) {
        auto it = inst.find(ik);
        if (it != inst.end() && it->second.pins > 0) --it->second.pins;
        if (it != inst.end()) it->second.last_unpin = t;
      } else if (ev.kind == StepEvent::kFree) {
        auto it = inst.find(ik);
        if (it != inst.end()) {
          if (it->second.resident) used -= it->second.bytes;
          if (it->second.on_host) host -= it->second.bytes;
          inst.erase(it);
        }
      } else {
        Inst& s = inst[ik];
        s.bytes = ev.bytes;
        if (!s.resident) {
          if (s.on_host) host -= s.bytes;
          s.on_host = false;
          s.resident = true;
          used += s.bytes;
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
          v.on_host = true;
          used -= v.bytes;
          host += v.bytes;
          if (pass == 0) continue;
          peak_host = std::max(peak_host, host);
          if (top.second < 0 && (v.last_unpin == kNever || v.last_unpin < n)) {
            // Last used in the step before: nothing in this one to start
            // its page-out from.
            p.start_outs.push_back(top.second);
          }
          // A tensor of the first pass that outlived it has no key here.
          if (top.second >= 0 && top.second < stride) continue;
          victims[top.second < 0 ? top.second : top.second - stride]
              .push_back(ev.at);
        }
        for (const auto& entry : pinned_aside) heap.push(entry);
        pinned_aside.clear();
      }
    }
  }
  if (options_.host_memory_limit > 0 &&
      peak_host + p.plan_largest > options_.host_memory_limit) {
    // The plan knows no fragmentation: where it already fills the host pool
    // to within one buffer, the engine will need more host room than it
    // planned, and the pool is what runs out. The step's own victims are
    // followed instead (victims_learned as recorded).
    p.start_outs.clear();
    return;
  }
  p.victims_learned = std::move(victims);
  p.planned = true;
}

void Engine::Impl::StartPlannedPageOutsLocked(
    std::unique_lock<std::mutex>& lock) {
  PrefetchState& p = prefetch_;
  if (p.start_next >= p.start_outs.size() || !FollowingPlan()) return;
  while (p.start_next < p.start_outs.size()) {
    const int64_t key = p.start_outs[p.start_next++];
    auto it = by_id_.find(-key);
    if (it == by_id_.end()) continue;
    Buffer* b = it->second;
    if (!Reclaimable(b) || b->last_use_epoch == 0) continue;
    if (options_.host_memory_limit > 0 &&
        static_cast<size_t>(counters_.current_bytes_reclaimed) +
                p.early_out_bytes + b->size + p.plan_largest >
            options_.host_memory_limit) {
      continue;  // room kept for on-demand reclaims (see above)
    }
    StartEarlyPageOut(lock, b);  // releases mu_ meanwhile
  }
}

}  // namespace tflms
