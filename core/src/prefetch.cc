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
// Identity across steps: tensors are new objects every step, so a buffer
// made in a step is known by its size and its rank among the allocations of
// that size in its step (StepKey in prefetch_keys.h; with a flag once that step is over, e.g.
// a batch an input pipeline made during it, or a weight the optimizer
// replaced), which it keeps for life unless a later step's buffer takes the
// same key; one that gave its key up is known by its id from then on. TensorFlow's executor
// does not allocate in the same order every step (parallel loop iterations,
// other threads' kernels), and an ordinal within the step shifted with every
// extra or reordered allocation; a rank per size shifts only with that size's.
// Each pin is looked for up to kResyncWindow pins either side of the cursor,
// the nearest occurrence winning, and counts as in order within kNearPins;
// one found further away moves the cursor only when the next pin found
// comes just after it (two pins agreeing), and a cursor left further behind
// than the window is moved by two keys that each come once in the order
// (kRelocatePins).
// A mismatch only costs a missed prefetch, never correctness: every key is
// resolved to a live buffer (by_key, by_id_) before it is used.
//
// Bounds: prefetched-but-not-yet-pinned bytes stay under
// prefetch_budget_bytes, except one tensor larger than the budget paged in
// alone into memory that is free; a prefetch may evict at most one victim
// (single reclaim), never run a full reclaim or defragmentation, and a key
// whose prefetch was evicted again before its use is paged in closer to it
// (half the distance) until it misses in a step where no prefetch of it was
// wasted (NotePrefetchMissLocked). An over-budget tensor is paged in only
// where the hole left still holds what the step allocates before its use.
//
// Page-out ahead of pressure: the positions at which each key was paged out
// are noted per step; in the next step, a buffer unpinned at its last use
// before such a position (and needed again beyond the look-ahead, or, if
// larger than the prefetch budget, at least kEarlyOutOverBudgetPins pins
// later) starts its copy to the host at once without the host waiting for it
// (StartEarlyPageOut), so the device-to-host link works while the compute
// stream does, instead of when an allocation finds no room and the host,
// and then the compute stream, wait for the copy.
//
// Finding steps (where one ends, which recorded order the next follows) is
// step_finding.cc's; the plan a finished step yields (which buffers go out
// where, which come back when) is step_plan.cc's.

#include <algorithm>
#include <cstdint>
#include <unordered_set>

#include "engine_impl.h"
#include "prefetch_keys.h"

namespace tflms {
namespace {
// A lost cursor moves to where two keys that each come once in the learned
// order place the step, if the second comes at most this many pins after
// the first (AdvanceCursorLocked).
constexpr size_t kRelocatePins = 16;
// A tensor larger than the prefetch budget that the plan evicts before its
// next use is paged out early if that use is at least this many pins away,
// even within the look-ahead (ShouldPageOutEarlyLocked, which says why and
// what the bound was measured against).
constexpr size_t kEarlyOutOverBudgetPins = 32;
// Pins looked back on before the learned order is trusted: where steps do
// not repeat (loop iterations that run in parallel allocate in a different
// order each time) following it would evict what is needed next.
constexpr int kTrustPins = 16;

// `b`'s rank among the allocations of its key size since `open`'s first
// pin, under which `open` knows it (CandidateKey, ChallengerKey).
int64_t RankInOpenStep(Engine::Impl::OpenStep* open, Buffer* b) {
  const int64_t rank = open->size_counts[b->key_size]++;
  open->by_key[StepKey(false, b->key_size, rank)] = b;
  return rank;
}
}  // namespace

int64_t Engine::Impl::PrefetchKey(const Buffer* b) const {
  const int64_t age = prefetch_.step - b->step_created;
  if (b->step_ordinal < 0 || age < 0) return -b->id;
  return StepKey(age >= 1, b->key_size, b->size_rank);
}

int64_t Engine::Impl::SpanKey(const Buffer* b, int64_t ordinal_base,
                              int64_t rank) const {
  if (b->step_ordinal < 0) return -b->id;
  if (b->step_created == prefetch_.step && b->step_ordinal >= ordinal_base) {
    return StepKey(false, b->key_size, rank);
  }
  return StepKey(true, b->key_size, b->size_rank);
}

int64_t Engine::Impl::CandidateKey(const Buffer* b) const {
  return SpanKey(b, prefetch_.candidate.ordinal, b->candidate_rank);
}

int64_t Engine::Impl::ChallengerKey(const Buffer* b) const {
  return SpanKey(b, prefetch_.challenger.ordinal, b->challenger_rank);
}

Buffer* Engine::Impl::BufferForKeyLocked(int64_t key, bool in_candidate) const {
  const PrefetchState& p = prefetch_;
  const std::unordered_map<int64_t, Buffer*>* map = &p.by_key;
  if (key < 0) {
    auto it = by_id_.find(-key);
    return it == by_id_.end() ? nullptr : it->second;
  }
  if (in_candidate) {
    if (key & kPreviousStepBit) {
      // This step's, as keyed now, or an older step's that kept its key.
      auto own = map->find(key & ~kPreviousStepBit);
      if (own != map->end()) return own->second;
    } else {
      map = &p.candidate.by_key;
    }
  }
  auto it = map->find(key);
  return it == map->end() ? nullptr : it->second;
}

void Engine::Impl::NoteAllocationLocked(Buffer* b) {
  PrefetchState& p = prefetch_;
  b->step_created = p.step;
  b->step_ordinal = p.next_ordinal++;
  // Only prefetch resolves keys; without it the maps would cost every
  // allocation hash inserts for nothing.
  if (!options_.prefetch_enabled) return;
  // Ranked per size rather than numbered overall: the executor runs ready
  // kernels in a different order from step to step (parallel loop
  // iterations, an input pipeline's threads), which shifts every later
  // ordinal, while the k-th allocation of a given size is mostly the same
  // tensor each step. Per size and site where the allocating kernel is
  // known: a size many kernels allocate (Keras's SGD: a weight's gradient,
  // its momentum product and, when the old buffer is still read, its new
  // value, 2,304 bytes each for every kernel of the CPU harness's deep CNN)
  // was ranked in the order the executor happened to run them, and a weight
  // known by another key each step.
  b->key_size = KeySize(b->size, CallerSite());
  b->size_rank = p.size_counts[b->key_size]++;
  p.by_key[StepKey(false, b->key_size, b->size_rank)] = b;
  if (p.has_candidate) b->candidate_rank = RankInOpenStep(&p.candidate, b);
  if (p.challenged) b->challenger_rank = RankInOpenStep(&p.challenger, b);
}

void Engine::Impl::NoteMatchLocked(bool found) {
  PrefetchState& p = prefetch_;
  if (p.interrupted) {
    // Counted once it is known whether these pins belong to the step.
    p.interruption_bits = (p.interruption_bits << 1) | (found ? 1 : 0);
    ++p.interruption_pins;
    if (found) ++p.interruption_in_order;
    return;
  }
  ++counters_.prefetch_pins;
  if (found) ++counters_.prefetch_pins_in_order;
  p.found_bits = (p.found_bits << 1) | (found ? 1 : 0);
  p.found_history = std::min(p.found_history + 1, 64);
}

bool Engine::Impl::FollowingLearnedOrder() const {
  const PrefetchState& p = prefetch_;
  // While the guard pauses prefetch, the engine acts as without it (no
  // prefetch, no planned copies, least-recently-used victims) and only
  // keeps learning.
  if (!options_.prefetch_enabled || p.learned.empty() || p.guard.paused) {
    return false;
  }
  if (p.found_history < kTrustPins) return false;
  const int found = __builtin_popcountll(p.found_bits);
  return 2 * found >= p.found_history;
}

bool Engine::Impl::InCandidateStep() const {
  const PrefetchState& p = prefetch_;
  return p.has_candidate && p.step_id == p.candidate.id;
}

size_t Engine::Impl::LearnedCursor() const {
  return InCandidateStep() ? prefetch_.candidate.cursor : prefetch_.cursor;
}

int64_t Engine::Impl::MatchKey(const Buffer* b) const {
  // In a candidate step: as it will be keyed once the step is confirmed.
  return InCandidateStep() ? CandidateKey(b) : PrefetchKey(b);
}

size_t Engine::Impl::NextUse(const Buffer* b) const {
  auto it = prefetch_.positions.find(MatchKey(b));
  if (it == prefetch_.positions.end()) return SIZE_MAX;
  const std::vector<size_t>& pos = it->second;
  const size_t cursor = LearnedCursor();
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
  const size_t cursor = LearnedCursor();
  const bool plan = FollowingPlan();
  if (plan && !PlannedPageOutLeavesRoomLocked(b)) return false;
  if (next == SIZE_MAX) {
    // Not pinned again this step. A step's own tensor is freed before it
    // is needed again. A buffer that outlives steps is next needed in the
    // next step: the plan pages it out now if it evicts it after this
    // point, or in the next step before its first pin there.
    const int64_t key = MatchKey(b);
    if (!plan || (key >= 0 && !(key & kPreviousStepBit))) return false;
    auto first = p.positions.find(key);
    const size_t first_pin =
        first == p.positions.end() ? 0 : first->second.front();
    for (size_t at : it->second) {
      if (at >= cursor || at < first_pin) return true;
    }
    return false;
  }
  // Within the look-ahead window prefetch would page it straight back in:
  // leave it to on-demand reclaim, which evicts only under real pressure.
  // Not so a tensor over the prefetch budget: the look-ahead brings one back
  // only first in line and only into a hole that still holds what the step
  // allocates before its use (NotePinAndPlan), so where the plan evicts it
  // first it stays out, and paged out now its copy overlaps the compute
  // instead of making the allocation that needs its room wait for it.
  // ResNet50 at 712 on the DGX-1: a 2.29 GB activation due 73 pins after its
  // last use, evicted by the plan 55 pins after it, 8.873 -> 8.654 s a step.
  // Not where it is due within kEarlyOutOverBudgetPins: there the on-demand
  // rules may keep it by a slide (defrag.cc), and at the largest batches
  // paging every such tensor out early made steps up to 9.6% slower
  // (ResNet50 at 1342 on the AC922). Bounds of 16 and 64 pins were worse:
  // ResNet152 at 1339 on the AC922 with twice the host ran out of memory
  // in its third step, and ResNet50 at 1340 on the DGX-1 with twice the
  // host stepped 4.9% slower over 30 steps. Its cost: the training workload
  // at six times its device, every activation over the budget, steps in
  // 0.519 s with prefetch at lookahead 128 against 0.453 s without the rule
  // and 0.475 s on demand (docs/tuning.md): the tensors it sends out come
  // back on demand there (328 of 341 over 40 steps), where at the planner's
  // points they come back as prefetch hits; at five times, and at six with
  // lookahead 256, it is faster.
  const size_t distance = next - cursor;
  if (distance < static_cast<size_t>(options_.prefetch_lookahead) &&
      (!OverPrefetchBudget(b) || distance < kEarlyOutOverBudgetPins)) {
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

bool Engine::Impl::PlannedPageOutLeavesRoomLocked(const Buffer* b) const {
  // The room is for the step's largest buffer, which an on-demand reclaim
  // may still need where fragmentation asks for more than the plan evicted
  // (UNet3D on an 80 GB GPU filled a 128 GiB pool otherwise).
  if (options_.host_memory_limit == 0) return true;
  const size_t host_used =
      static_cast<size_t>(counters_.current_bytes_reclaimed) +
      prefetch_.early_out_bytes;
  return host_used + b->size + prefetch_.plan_largest <=
         options_.host_memory_limit;
}

void Engine::Impl::NoteVictimLocked(const Buffer* v) {
  // Keyed as this step knows it; SplitStepLocked rekeys the new step's.
  prefetch_.victims_now[PrefetchKey(v)].push_back(prefetch_.recording.size());
}

void Engine::Impl::NotePrefetchWastedLocked(Buffer* b) {
  b->prefetch_wasted = true;
  const size_t halved = b->prefetch_distance / 2;
  prefetch_.distance[MatchKey(b)] = std::max<size_t>(halved, 1);
}

void Engine::Impl::NotePrefetchMissLocked(Buffer* b) {
  // Paused, every pin of a reclaimed buffer misses: none says a distance
  // was too short.
  if (prefetch_.guard.paused) return;
  // A shortened distance is only ever lengthened here. Kept for good, each
  // step's one wasted prefetch shortened one more key, and the look-ahead,
  // which skips a key not yet within its distance and spends the budget on
  // the keys after it, then never prefetched those keys in time: on the
  // training workload at three times its device (core/tests) the step grew
  // by 4 ms every step, past on-demand paging after about 12 steps. A miss
  // right after the key's prefetch was wasted is that waste's, and keeps the
  // shorter distance (else the waste repeats every step).
  if (b->prefetch_wasted) {
    b->prefetch_wasted = false;
    return;
  }
  prefetch_.distance.erase(MatchKey(b));
}

size_t Engine::Impl::LargestAllocationBetween(size_t from, size_t to) const {
  const auto& allocs = prefetch_.plan_allocs;
  auto it = std::lower_bound(allocs.begin(), allocs.end(),
                             std::make_pair(from, size_t{0}));
  size_t largest = 0;
  for (; it != allocs.end() && it->first <= to; ++it) {
    largest = std::max(largest, it->second);
  }
  return largest;
}

size_t Engine::Impl::RoomAfterTakingLocked(size_t rounded) const {
  // Within the device, the hole bounds the bytes free too. Unfragmented,
  // only the bytes say what the request leaves.
  const size_t hole = arena_->LargestFreeAfterTaking(rounded);
  const size_t left = DeviceBytesLeftLocked();
  return std::min(hole, left > rounded ? left - rounded : 0);
}

size_t Engine::Impl::DeviceBytesLeftLocked() const {
  if (!options_.unfragmented) return SIZE_MAX;
  const size_t in_use = arena_->bytes_in_use();
  return in_use >= lms_limit_ ? 0 : lms_limit_ - in_use;
}

size_t Engine::Impl::LargestAllocationDueLocked(size_t pins) const {
  if (!FollowingPlan()) return 0;  // implies prefetch_enabled
  const size_t cursor = LearnedCursor();
  return LargestAllocationBetween(cursor, cursor + pins);
}

bool Engine::Impl::PinDueLocked(const Buffer* b, size_t pins) const {
  if (!FollowingPlan()) return false;
  const size_t cursor = LearnedCursor();
  const size_t next = NextUse(b);
  return next != SIZE_MAX && next < cursor + pins;
}

size_t Engine::Impl::BytesDueBackLocked(const Buffer* except,
                                        size_t pins) const {
  if (!FollowingPlan()) return 0;
  const size_t cursor = LearnedCursor();
  const size_t end = std::min(cursor + pins, prefetch_.learned.size());
  const bool in_candidate = InCandidateStep();
  std::unordered_set<const Buffer*> seen;
  size_t bytes = 0;
  for (size_t i = cursor; i < end; ++i) {
    const Buffer* m = BufferForKeyLocked(prefetch_.learned[i], in_candidate);
    if (m == nullptr || m == except || !seen.insert(m).second) continue;
    if (OnHostOrLeaving(m)) bytes += BfcArena::RoundedBytes(m->size);
  }
  return bytes;
}

bool Engine::Impl::OnHostOrLeaving(const Buffer* b) {
  // An early page-out is cancelled by the pin and keeps its chunk.
  return b->state == BufferState::kReclaimed ||
         (b->state == BufferState::kPagingOut && !b->early_out);
}

bool Engine::Impl::NothingOnHostBeforeLocked(size_t pos,
                                             const Buffer* except) {
  PrefetchState& p = prefetch_;
  PrefetchState::HostScan& scan = p.host_scan;
  const bool in_candidate = InCandidateStep();
  const size_t cursor = LearnedCursor();
  // Asked at every pin while planned copies wait, over hundreds of pins
  // each time: the scan goes on from where the last one stopped unless a
  // buffer may have left since or the cursor went back (a resync).
  if (scan.generation != p.host_generation ||
      scan.in_candidate != in_candidate || scan.except != except ||
      cursor < scan.from) {
    scan.generation = p.host_generation;
    scan.in_candidate = in_candidate;
    scan.except = except;
    scan.from = cursor;
    scan.clear_to = cursor;
  }
  const size_t end = std::min(pos, p.learned.size());
  size_t i = std::max(scan.clear_to, cursor);
  for (; i < end; ++i) {
    const Buffer* m = BufferForKeyLocked(p.learned[i], in_candidate);
    if (m != nullptr && m != except && OnHostOrLeaving(m)) break;
  }
  scan.clear_to = std::max(scan.clear_to, i);
  return i >= end;
}

void Engine::Impl::ForgetBufferForPrefetch(Buffer* b) {
  // Without prefetch no key was ever entered (NoteAllocationLocked).
  if (!options_.prefetch_enabled) return;
  PrefetchState& p = prefetch_;
  NoteStepEventLocked(StepEvent::kFree, b);
  if (b->step_ordinal < 0) return;
  // Saturated keys may name another buffer: erase only b's own entry.
  auto erase_own = [b](std::unordered_map<int64_t, Buffer*>& map,
                       int64_t key) {
    auto it = map.find(key);
    if (it != map.end() && it->second == b) map.erase(it);
  };
  erase_own(p.by_key, PrefetchKey(b));
  if (p.has_candidate && b->step_created == p.step &&
      b->step_ordinal >= p.candidate.ordinal) {
    erase_own(p.candidate.by_key, CandidateKey(b));
  }
  if (p.challenged && b->step_created == p.step &&
      b->step_ordinal >= p.challenger.ordinal) {
    erase_own(p.challenger.by_key, ChallengerKey(b));
  }
}

bool Engine::Impl::AdvanceCursorLocked(int64_t key, size_t* cursor) {
  // The occurrence of the key nearest the cursor, up to kResyncWindow pins
  // either way. Looking only forward let a key that recurs (a weight read
  // by every loop iteration, a small tensor of each iteration) pull the
  // cursor ahead of a step that ran its iterations in another interleaving,
  // and nothing behind the cursor matched again: the LSTM's backward loop
  // lost its place for a thousand pins. Looking back brings it home.
  auto it = prefetch_.positions.find(key);
  if (it == prefetch_.positions.end()) return false;
  const std::vector<size_t>& pos = it->second;
  auto next = std::lower_bound(pos.begin(), pos.end(), *cursor);
  size_t best = SIZE_MAX, best_distance = kResyncWindow;
  if (next != pos.end() && *next - *cursor < best_distance) {
    best = *next;
    best_distance = *next - *cursor;
  }
  if (next != pos.begin()) {
    const size_t before = *std::prev(next);
    // Just behind the cursor is distance 1: the pin the cursor passed.
    if (*cursor - before < best_distance) best = before;
  }
  if (best == SIZE_MAX) {
    // Lost: the step is further than the window from where the cursor is.
    // A key that comes once in the learned order (an activation, known by
    // its size and rank) says where the step has got to, once the key lost
    // before it, also once in the order, said nearly the same. Without
    // this the cursor stayed behind for the rest of the step: in the CPU
    // harness's Keras fit, a training step after validation whose 95
    // weights were not known as the order knew them lost its place there
    // and found 1,051 of its 1,856 pins nowhere near it.
    PrefetchState& p = prefetch_;
    if (pos.size() == 1) {
      const size_t at = pos.front();
      if (p.lost_at != SIZE_MAX && at > p.lost_at &&
          at - p.lost_at <= kRelocatePins) {
        *cursor = at + 1;
        p.lost_at = SIZE_MAX;
      } else {
        p.lost_at = at;
      }
    }
    return false;
  }
  PrefetchState& p = prefetch_;
  p.lost_at = SIZE_MAX;
  // In order only if near where the step had got to: an order reshuffled
  // every step (parallel loop iterations) finds most keys within the window
  // somewhere, and must not be trusted for it.
  const size_t distance = best >= *cursor ? best - *cursor : *cursor - best;
  if (distance <= kNearPins) {
    *cursor = best + 1;
    p.far_at = SIZE_MAX;
    return true;
  }
  // Further away, the cursor moves only where the pin before was also found
  // far away, just before this one: two pins agreeing on where the step is.
  // A key that recurs (a metric's scalar, a loss term, a weight read again)
  // is found somewhere within the window wherever the step is, and moving
  // to wherever that was pulled the cursor back, one such key after
  // another, out of the step: in a Keras fit on the CPU harness, a training
  // step whose kernels ran in another order than the recorded one (the
  // variable reads all before the forward pass rather than along it) was
  // pulled from the loss back into the forward pass, then matched its
  // backward pass's activations there, walking backwards, and found 684 of
  // its 1,760 pins in order (the same step in a run with the recorded order:
  // 1,752). A step shifted against the order is followed from its third
  // pin there (the second moves the cursor; counted in order, it let orders
  // reshuffled every step be trusted where two pins agreed by chance).
  if (p.far_at != SIZE_MAX) {
    auto confirmed = std::upper_bound(pos.begin(), pos.end(), p.far_at);
    if (confirmed != pos.end() && *confirmed - p.far_at <= kNearPins) {
      *cursor = *confirmed + 1;
      p.far_at = SIZE_MAX;
      return false;
    }
  }
  p.far_at = best;
  return false;
}

std::vector<Buffer*> Engine::Impl::NotePinAndPlan(Buffer* b) {
  PrefetchState& p = prefetch_;
  const int64_t key = PrefetchKey(b);
  NoteStepEventLocked(StepEvent::kPin, b);
  NoteStepPinLocked(b, key);
  std::vector<Buffer*> plan;
  // A challenger's few pins follow no order: most are kernels running beside
  // the candidate. Asked again after NoteStepPinLocked, which may have let
  // this pin's challenger take over: its pins are then the candidate's and
  // matched from its own start.
  if (p.challenged && p.step_id == p.challenger.id) return plan;
  // Pins of a candidate step are matched, until it is confirmed or dropped,
  // as if it had begun where it first appeared: its own cursor, and ranks
  // counted from its first allocation (older buffers as they will be known).
  const bool in_candidate = InCandidateStep();
  const int64_t match_key = MatchKey(b);
  size_t& cursor = in_candidate ? p.candidate.cursor : p.cursor;
  if (!in_candidate) ChooseRecordingLocked(key);
  if (p.learned.empty()) return plan;
  const bool found = AdvanceCursorLocked(match_key, &cursor);
  NoteCursorProgressLocked(in_candidate, &cursor);
  NoteMatchLocked(found);
  if (!found || !FollowingLearnedOrder()) return plan;
  size_t budget_left = options_.prefetch_budget_bytes > p.inflight_bytes
                           ? options_.prefetch_budget_bytes - p.inflight_bytes
                           : 0;
  const size_t stop =
      std::min(p.learned.size(),
               cursor + static_cast<size_t>(options_.prefetch_lookahead));
  for (size_t i = cursor; i < stop; ++i) {
    const int64_t k = p.learned[i];
    Buffer* next = BufferForKeyLocked(k, in_candidate);
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
      // And only where the hole left still holds every allocation the step
      // makes before that use: where the next op's output needed the hole,
      // the output's allocation evicted the prefetched tensor (the only
      // victim large enough), which then paged in again on demand: the
      // training workload with 256 MiB tensors at five and six times its
      // device stepped 63% and 55% slower with prefetch than without.
      const size_t rounded = BfcArena::RoundedBytes(next->size);
      if (plan.empty() && p.inflight_bytes == 0 && arena_ != nullptr &&
          arena_->LargestFreeChunk() >= rounded &&
          RoomAfterTakingLocked(rounded) >=
              LargestAllocationBetween(cursor, i)) {
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
    Status s = PageIn(lock, b, /*for_prefetch=*/true,
                      needed_at == SIZE_MAX ? 0 : needed_at,
                      /*no_reclaim=*/OverPrefetchBudget(b));
    if (b->free_requested) {
      DestroyBufferLocked(b);
      continue;
    }
    if (!s.ok()) break;  // no room without costly reclaim: stop here
    ++counters_.num_prefetches;
    b->prefetched = true;
    const size_t cursor = LearnedCursor();
    b->prefetch_distance =
        needed_at == SIZE_MAX || needed_at < cursor ? 0 : needed_at - cursor;
    prefetch_.inflight_bytes += b->size;
  }
}

}  // namespace tflms
