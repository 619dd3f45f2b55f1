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
// that size in its step (StepKey; with a flag once that step is over, e.g.
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
// Steps inside TensorFlow: nothing calls StepBegin there; every kernel's
// pin site passes its context's step id (NoteStepId), which that thread's
// next pin takes. Every tf.function call gets a new id, and so does every
// eager op, while functional control flow (While, If, nested calls) runs
// under its caller's. Kernels of other ids
// interleave with a step's (an input pipeline's functions, a callback's eager
// ops), so a new id does not end the step at once: it becomes the candidate,
// and only once kMinStepPins of its pins came in a row (no pin of the step's
// own id between them) does the next step begin, retroactively at the
// candidate's first pin. The pins and allocations since then move over to the
// new step, keyed as they were recorded meanwhile (CandidateKey). A return to the step's id drops the candidate;
// eager ops and small functions between steps stay in the step before. A
// third id between the candidate's pins only challenges it (a pipeline's
// function beside a validation step): the candidate's id pinning again
// ends the challenge, and the challenger takes over, from its own first
// pin, once it pins kTakeoverPins in a row or more than the candidate did.
// A step of several functions (each its own id, e.g. a custom loop calling a
// gradient function and then an apply function) yields one recording per
// function, and so does a validation step between training steps; the
// library keeps one recording per kind of step, of the kLibrarySize kinds
// run most recently (a step's recording replaces the one it followed when
// most keys are shared, LibrarySlotFor), and each step follows the one in
// which its first pin comes earliest. The first (tracing) call of a function
// pins in an order of its own; the next call's recording replaces it, so
// prefetch starts from the third call.
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
// The plan names buffers by their prefetch keys: one of this step's that
// is still alive in the next is there the previous step's buffer of its size
// and rank, which is how the second pass finds the first pass's.
// The plan only chooses what goes out and from where; the copies, their
// ordering after the last use and the settling of chunks are the early
// page-out's, so a step that does not follow the plan (a mismatch, another
// function's order) costs time, never data.
#include <algorithm>
#include <cstdint>
#include <queue>
#include <unordered_set>

#include "engine_impl.h"

namespace tflms {
namespace {
// How far ahead of the cursor a pin is searched for in the learned order.
constexpr size_t kResyncWindow = 64;
// A pin found at most this far from where the learned order expected it
// counts as in order; further away within kResyncWindow it only moves the
// cursor there (in the TensorFlow steps measured, 93% of the pins found came
// at the expected place and 5% within 4 pins of it).
constexpr size_t kNearPins = 4;
// A lost cursor moves to where two keys that each come once in the learned
// order place the step, if the second comes at most this many pins after
// the first (AdvanceCursorLocked).
constexpr size_t kRelocatePins = 16;
// Fewer pins than this under one step id are not a step of their own (an
// eager op pins its few inputs; a training step's function hundreds).
constexpr size_t kMinStepPins = 16;
// Pins in a row by which another id takes a candidate's place (from its own
// first pin); fewer, between the candidate's pins, are kernels running
// beside it (OpenChallengeLocked). An input pipeline's function pins one
// tensor; the step whose id came after a few kernels that are not steps
// (an apply function, eager ops) pins hundreds.
constexpr size_t kTakeoverPins = 4;
// Planned page-ins leave this many times the step's largest buffer free in
// the plan (PlanStepLocked).
constexpr size_t kPlannedInSlack = 2;
// Planned page-ins start only while the page-ins still landing hold at most
// this share of the prefetch budget (StartPlannedPageInsLocked).
constexpr size_t kPlannedInQueueShare = 4;
// A tensor larger than the prefetch budget that the plan evicts before its
// next use is paged out early if that use is at least this many pins away,
// even within the look-ahead (ShouldPageOutEarlyLocked, which says why and
// what the bound was measured against).
constexpr size_t kEarlyOutOverBudgetPins = 32;
// Recordings kept to choose from, one per kind of step (functions per step,
// a validation step between training steps; LibrarySlotFor).
constexpr size_t kLibrarySize = 4;
// Pins in a row that did not move the cursor past the furthest place it
// reached in the followed order,
// after which the recordings are searched for them; at least kSwitchFound
// of them must come in order in another, and more than in the followed one
// (SwitchRecordingLocked).
constexpr size_t kSwitchPins = 8;
constexpr size_t kSwitchFound = 6;
// A recording is of the kind of the one it followed when this percentage of
// the longer one's pins are keys both have.
constexpr size_t kSameKindPercent = 50;
// Pins looked back on before the learned order is trusted: where steps do
// not repeat (loop iterations that run in parallel allocate in a different
// order each time) following it would evict what is needed next.
constexpr int kTrustPins = 16;

// Step keys: bit 61 says whether the buffer is of the step itself (0) or of
// the one before (1), then its size and its rank among that size's
// allocations in its step; both saturate (a collision costs a missed
// prefetch, never correctness: a planned buffer is looked up again).
constexpr int kRankBits = 21;
constexpr int kSizeBits = 40;
constexpr int64_t kPreviousStepBit = int64_t{1} << (kRankBits + kSizeBits);

// The size field of a key: the size alone, or, where the allocating kernel
// is known, the size and its site mixed (SplitMix64's finalizer) into the
// field's bits; a collision costs a missed prefetch, never correctness.
uint64_t KeySize(size_t size, uint64_t site) {
  if (site == 0) return size;
  uint64_t z = site + 0x9e3779b97f4a7c15ULL * (size + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) >> (64 - kSizeBits);
}

int64_t StepKey(bool previous, uint64_t size, int64_t rank) {
  const uint64_t max_size = (uint64_t{1} << kSizeBits) - 1;
  const int64_t max_rank = (int64_t{1} << kRankBits) - 1;
  const uint64_t s = std::min(size, max_size);
  return (previous ? kPreviousStepBit : 0) |
         static_cast<int64_t>(s << kRankBits) | std::min(rank, max_rank);
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
  if (p.has_candidate) {
    b->candidate_rank = p.candidate.size_counts[b->key_size]++;
    p.candidate.by_key[StepKey(false, b->key_size, b->candidate_rank)] = b;
  }
  if (p.challenged) {
    b->challenger_rank = p.challenger.size_counts[b->key_size]++;
    p.challenger.by_key[StepKey(false, b->key_size, b->challenger_rank)] = b;
  }
}

void Engine::Impl::StartOpenStepLocked(OpenStep* open,
                                       int64_t step_id) {
  const PrefetchState& p = prefetch_;
  ClearOpenStep(open);
  open->id = step_id;
  open->pins = 0;
  open->index = p.recording.size();
  open->events = p.events.size();
  open->ordinal = p.next_ordinal;
  open->time = GuardNowLocked();
  open->cursor = 0;
}

void Engine::Impl::ClearOpenStep(OpenStep* open) {
  open->by_key.clear();
  open->size_counts.clear();
  open->keys.clear();
}

void Engine::Impl::DropCandidateLocked() {
  PrefetchState& p = prefetch_;
  p.has_candidate = false;
  ClearOpenStep(&p.candidate);
  DropChallengeLocked();
}

void Engine::Impl::DropChallengeLocked() {
  PrefetchState& p = prefetch_;
  p.challenged = false;
  ClearOpenStep(&p.challenger);
}

void Engine::Impl::OpenChallengeLocked(int64_t step_id) {
  PrefetchState& p = prefetch_;
  // Replacing the candidate at once, as a new id did before, restarted it at
  // every such kernel: a validation step whose id alternated with its input
  // pipeline's one-pin functions was confirmed about 200 pins late on the
  // CPU harness, its first pins left in the training step before it.
  if (!p.challenged) {
    p.challenged = true;
    p.challenge_index = p.recording.size();
    p.challenge_events = p.events.size();
  }
  StartOpenStepLocked(&p.challenger, step_id);
}

void Engine::Impl::TakeOverCandidateLocked() {
  PrefetchState& p = prefetch_;
  // The candidate's pins before the challenger's stay where the step's
  // interruption keeps or forgets them, as when it was dropped; what the
  // challenger made and pinned since its first pin takes the keys it had as
  // the challenger's.
  for (size_t i = p.interruption_events; i < p.events.size(); ++i) {
    StepEvent& e = p.events[i];
    e.in_candidate = i >= p.challenger.events;
    if (e.in_candidate) e.candidate_key = e.challenger_key;
  }
  for (auto& entry : p.challenger.by_key) {
    entry.second->candidate_rank = entry.second->challenger_rank;
  }
  p.candidate = std::move(p.challenger);
  p.candidate.cursor = 0;  // its pins so far were not matched
  DropChallengeLocked();
}

void Engine::Impl::ForgetChallengeLocked() {
  PrefetchState& p = prefetch_;
  if (!p.challenged) return;
  // As an interruption's (ForgetInterruptionLocked): left in the candidate's
  // recording they would shift its order wherever they came.
  const size_t at = p.challenge_index;
  p.recording.resize(at);
  p.candidate.keys.resize(at - p.candidate.index);
  ClampPositionsLocked(at, p.challenge_events);
  DropChallengeLocked();
}

void Engine::Impl::ClampPositionsLocked(size_t at, size_t from_event) {
  PrefetchState& p = prefetch_;
  for (size_t i = from_event; i < p.events.size(); ++i) {
    p.events[i].at = std::min(p.events[i].at, at);
  }
  for (auto& entry : p.victims_now) {
    for (size_t& v : entry.second) v = std::min(v, at);
  }
}

void Engine::Impl::StepBegin() {
  std::lock_guard<std::mutex> lock(mu_);
  StepBeginLocked();
}

namespace {
// The step id the calling thread's kernel noted last, and for which engine.
// Per thread because a kernel notes its id and then pins its inputs in two
// calls: with one id for the whole engine, another thread's kernel noting
// its own id in between (an input pipeline's function) had the pins
// counted as that id's, and since the allocator passed on only changes of
// id, they went on being counted so until some other id came. In a Keras
// fit over tf.data on the CPU harness the training step's backward pass
// was taken for a step of a pipeline function's id (three of four epochs
// in one run), and two steps in each such epoch found nothing in order.
struct NotedStep {
  const Engine::Impl* engine = nullptr;
  int64_t id = 0;
};
thread_local NotedStep noted_step;

// The site the calling thread's kernel noted for its allocations, and for
// which engine (NoteAllocationSite).
struct NotedSite {
  const Engine::Impl* engine = nullptr;
  uint64_t site = 0;
};
thread_local NotedSite noted_site;
}  // namespace

void Engine::Impl::NoteAllocationSite(uint64_t site) {
  noted_site = {this, site};
}

uint64_t Engine::Impl::CallerSite() const {
  return noted_site.engine == this ? noted_site.site : 0;
}

void Engine::Impl::NoteStepId(int64_t step_id) {
  // No lock: the id takes effect at this thread's next pin
  // (TakeNotedStepLocked).
  noted_step = {this, step_id};
}

void Engine::Impl::TakeNotedStepLocked() {
  const NotedStep& noted = noted_step;
  if (noted.engine != this) return;
  if (prefetch_.has_step_id && noted.id == prefetch_.step_id) return;
  NoteStepIdLocked(noted.id);
}

void Engine::Impl::NoteStepIdLocked(int64_t step_id) {
  PrefetchState& p = prefetch_;
  p.step_id = step_id;
  if (!p.has_step_id) {
    p.has_step_id = true;
    p.dominant_id = step_id;
    return;
  }
  if (step_id == p.dominant_id) {
    DropCandidateLocked();  // an interruption, not a new step
    ForgetInterruptionLocked();
    return;
  }
  if (!p.interrupted) {
    p.interrupted = true;
    p.interruption_index = p.recording.size();
    p.interruption_events = p.events.size();
  }
  if (p.has_candidate && step_id == p.candidate.id) {
    ForgetChallengeLocked();
    return;
  }
  if (p.has_candidate) {
    OpenChallengeLocked(step_id);
    return;
  }
  p.has_candidate = true;
  StartOpenStepLocked(&p.candidate, step_id);
}

void Engine::Impl::ForgetInterruptionLocked() {
  PrefetchState& p = prefetch_;
  if (!p.interrupted) return;
  p.interrupted = false;
  // Kernels of other ids that ran while the step's own id returned after
  // them (an input pipeline's functions on its own threads) pin at places
  // that differ from step to step. Left in the recording, they shifted the
  // learned order under every pin of the step between where they came in
  // the recorded step and where they come in this one (each pin then more
  // than kNearPins away): in a Keras fit over tf.data on the CPU harness,
  // only 50-69% of the pins were found in order. Their memory events stay,
  // at the place where the step's own pins resume.
  const size_t at = p.interruption_index;
  p.recording.resize(at);
  for (size_t i = p.interruption_events; i < p.events.size(); ++i) {
    p.events[i].in_candidate = false;
  }
  ClampPositionsLocked(at, p.interruption_events);
  p.interruption_bits = 0;
  p.interruption_pins = 0;
  p.interruption_in_order = 0;
}

void Engine::Impl::KeepInterruptionLocked() {
  PrefetchState& p = prefetch_;
  if (!p.interrupted) return;
  p.interrupted = false;
  // Their matches count as they came, oldest first.
  for (int i = std::min(p.interruption_pins, 64) - 1; i >= 0; --i) {
    p.found_bits = (p.found_bits << 1) | ((p.interruption_bits >> i) & 1);
    p.found_history = std::min(p.found_history + 1, 64);
  }
  counters_.prefetch_pins += p.interruption_pins;
  counters_.prefetch_pins_in_order += p.interruption_in_order;
  p.interruption_bits = 0;
  p.interruption_pins = 0;
  p.interruption_in_order = 0;
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

void Engine::Impl::FollowRecording(size_t index) {
  PrefetchState& p = prefetch_;
  ++p.host_generation;  // positions name other pins now
  p.learned = p.library[index];
  p.learned_index = index;
  p.learned_is_last = index + 1 == p.library.size();
  p.stalled_pins = 0;
  p.switch_at = kSwitchPins;
  p.cursor_high = 0;
  p.lost_at = SIZE_MAX;
  p.far_at = SIZE_MAX;
  p.positions.clear();
  for (size_t i = 0; i < p.learned.size(); ++i) {
    p.positions[p.learned[i]].push_back(i);
  }
}

void Engine::Impl::StepBeginLocked() {
  DropCandidateLocked();  // nothing moves over: the step begins here
  KeepInterruptionLocked();
  SplitStepLocked(prefetch_.recording.size(), prefetch_.next_ordinal,
                  GuardNowLocked());
}

void Engine::Impl::SplitStepLocked(size_t index, int64_t ordinal_base,
                                   double at) {
  PrefetchState& p = prefetch_;
  // A buffer that outlives the step it was made in keeps the key it had
  // there (size and rank, as an earlier step's) for as long as it lives,
  // however many steps pass: a step that makes none of that size in between
  // (a validation step between two training steps, which reads the weights
  // the last training step made) must not change how the next one knows
  // them. Keying such buffers by id from their second step on matched none
  // of the weights' pins in the first training step after each validation
  // of a Keras fit (28% of its pins in order), nor in the step after that,
  // whose recording knew them by id. Only where one of the finished step's
  // buffers takes the same key is the older one known by id instead; the
  // finished step's recording, events and victims name it so.
  std::unordered_map<int64_t, int64_t> aged;
  for (const auto& entry : p.by_key) {
    const Buffer* b = entry.second;
    if (!(entry.first & kPreviousStepBit) || b->step_ordinal < 0) continue;
    auto own = p.by_key.find(entry.first & ~kPreviousStepBit);
    if (own != p.by_key.end() && own->second->step_created == p.step &&
        own->second->step_ordinal < ordinal_base) {
      aged[entry.first] = -b->id;
    }
  }
  auto finished_key = [&](int64_t key) {
    auto it = aged.find(key);
    return it == aged.end() ? key : it->second;
  };
  // Victims noted at positions before `index` are the finished step's; later
  // ones are the new step's, keyed as its pins are (CandidateKey). Done
  // first: the keys are resolved through buffers not yet renumbered.
  std::unordered_map<int64_t, std::vector<size_t>> victims_tail;
  std::unordered_map<int64_t, std::vector<size_t>> victims_finished;
  for (auto& entry : p.victims_now) {
    std::vector<size_t> before;
    for (size_t at : entry.second) {
      if (at < index) {
        before.push_back(at);
        continue;
      }
      int64_t key = entry.first;
      if (key >= 0) {
        Buffer* v = BufferForKeyLocked(key, /*in_candidate=*/false);
        if (v == nullptr) continue;  // freed: cannot recur
        key = CandidateKey(v);
      }
      victims_tail[key].push_back(at - index);
    }
    if (!before.empty()) {
      std::vector<size_t>& v = victims_finished[finished_key(entry.first)];
      v.insert(v.end(), before.begin(), before.end());
    }
  }
  // What the new step already pinned and allocated moves over to it: its
  // buffers take their ranks since the candidate's first pin; the finished
  // step's buffers that are still alive become an earlier step's, and older
  // ones keep their keys unless aged above.
  std::unordered_map<int64_t, Buffer*> by_key;
  for (auto& entry : p.by_key) {
    Buffer* b = entry.second;
    if (b->step_ordinal < 0 || aged.count(entry.first) != 0) {
      b->step_ordinal = -1;
    } else if (b->step_created != p.step) {
      by_key[entry.first] = b;
    } else if (b->step_ordinal >= ordinal_base) {
      b->step_ordinal -= ordinal_base;
      b->step_created = p.step + 1;
      b->size_rank = b->candidate_rank;
      by_key[StepKey(false, b->key_size, b->size_rank)] = b;
    } else {
      by_key[StepKey(true, b->key_size, b->size_rank)] = b;
    }
  }
  // The candidate's pins were keyed as the new step's when they came.
  std::vector<int64_t> tail;
  if (p.candidate.keys.size() == p.recording.size() - index) {
    tail = std::move(p.candidate.keys);
  }
  // Events likewise: before `index` the finished step's, the rest the new
  // step's, at their positions since the candidate's first pin and with the
  // keys they were given as the candidate's (NoteStepEventLocked).
  std::vector<StepEvent> finished_events;
  std::vector<StepEvent> events_tail;
  for (const StepEvent& e : p.events) {
    if (e.at < index || !e.in_candidate) {
      finished_events.push_back(e);
      finished_events.back().key = finished_key(e.key);
      continue;
    }
    StepEvent moved_event = e;
    moved_event.at = e.at - index;
    moved_event.key = e.candidate_key;
    moved_event.in_candidate = false;
    events_tail.push_back(moved_event);
  }
  p.events = std::move(events_tail);
  p.recording.resize(index);
  for (int64_t& key : p.recording) key = finished_key(key);
  if (!p.recording.empty()) {
    ++counters_.num_prefetch_steps;
    p.victims_learned = std::move(victims_finished);
    PlanStepLocked(finished_events);
    const size_t slot = LibrarySlotFor(p.recording);
    if (slot != SIZE_MAX) p.library.erase(p.library.begin() + slot);
    p.library.push_back(std::move(p.recording));
    // Until this step's first pins say otherwise, it follows the last one.
    FollowRecording(p.library.size() - 1);
    p.choosing = p.library.size() > 1;
    GuardStepEndedLocked(at);
  }
  p.victims_now = std::move(victims_tail);
  p.recording = std::move(tail);
  p.cursor = 0;
  p.cursor_high = 0;
  p.stalled_pins = 0;
  p.switch_at = kSwitchPins;
  p.far_at = SIZE_MAX;
  ++p.step;
  p.next_ordinal -= ordinal_base;
  p.by_key = std::move(by_key);
  p.size_counts = std::move(p.candidate.size_counts);
  DropCandidateLocked();
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

size_t Engine::Impl::RecordingStartingWith(int64_t key) const {
  // The recording in which the key comes earliest, within kResyncWindow of
  // its start (the newest on a tie); SIZE_MAX if none.
  const PrefetchState& p = prefetch_;
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
  return best;
}

namespace {
// How many of the `n` keys `recent` (oldest first) come in order in `keys`,
// at the best of the newest key's occurrences: the keys before it found
// newest first, each within kNearPins + 1 before the one found after it.
// Sets `*at` to that occurrence's position.
size_t FoundInOrder(const std::vector<int64_t>& keys, const int64_t* recent,
                    size_t n, size_t* at) {
  size_t best = 0;
  for (size_t j = 0; j < keys.size(); ++j) {
    if (keys[j] != recent[n - 1]) continue;
    size_t found = 1, last = j;
    for (size_t i = n - 1; i-- > 0;) {
      const size_t low = last > kNearPins + 1 ? last - kNearPins - 1 : 0;
      for (size_t q = last; q-- > low;) {
        if (keys[q] == recent[i]) {
          ++found;
          last = q;
          break;
        }
      }
    }
    if (found > best) {
      best = found;
      *at = j;
    }
  }
  return best;
}
}  // namespace

bool Engine::Impl::SwitchRecordingLocked(size_t* cursor) {
  // A step is matched to a recording by its first pins, and two kinds of
  // step can begin alike: a Keras training step and a validation step run
  // the same forward pass, their first kernels read the same weights, so
  // the training step after validation followed the validation order (the
  // newest of the two) and from its backward pass on found its pins there
  // behind where it had got to, or nowhere, and nothing ahead to prefetch.
  // Where the cursor stopped advancing, the step's last pins are looked for
  // in each recording, and one in which more of them come in order than in
  // the followed one (at least kSwitchFound) is followed from there.
  PrefetchState& p = prefetch_;
  if (p.library.size() < 2 || p.recording.size() < kSwitchPins) return false;
  const int64_t* recent = &p.recording[p.recording.size() - kSwitchPins];
  size_t at = 0;
  size_t best = SIZE_MAX, best_at = 0;
  size_t best_found = std::max(
      kSwitchFound - 1, FoundInOrder(p.learned, recent, kSwitchPins, &at));
  for (size_t r = 0; r < p.library.size(); ++r) {
    if (r == p.learned_index) continue;
    const size_t found = FoundInOrder(p.library[r], recent, kSwitchPins, &at);
    if (found > best_found) {
      best = r;
      best_at = at;
      best_found = found;
    }
  }
  if (best == SIZE_MAX) return false;
  FollowRecording(best);
  *cursor = best_at + 1;
  return true;
}

size_t Engine::Impl::LibrarySlotFor(
    const std::vector<int64_t>& recording) const {
  // The library keeps one recording per kind of step, the most recently
  // run kinds: a recording replaces the one it followed when at least
  // kSameKindPercent of the longer of the two are keys both have (a set
  // measure, as the orders of two steps of a kind differ in places; the
  // longer, as a validation step's few hundred pins are nearly all found in
  // the training step's order, which has four times as many). Evicting
  // the oldest instead, a Keras fit whose validation ran kLibrarySize
  // steps or more left only validation orders: the first training step of
  // every epoch followed none of its own and waited for all it paged in
  // (the CPU harness's fit with six validation steps: 10.9 MB of its 11 MB
  // on demand in that step, 0.3-0.5 MB in the steps after it).
  const PrefetchState& p = prefetch_;
  if (!p.learned.empty() && p.learned_index < p.library.size()) {
    size_t shared = 0;
    for (int64_t key : recording) shared += p.positions.count(key);
    const size_t longer = std::max(recording.size(), p.learned.size());
    if (shared * 100 >= longer * kSameKindPercent) {
      return p.learned_index;
    }
  }
  return p.library.size() == kLibrarySize ? 0 : SIZE_MAX;
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
  p.recording.push_back(key);
  if (p.has_candidate) p.candidate.keys.push_back(CandidateKey(b));
  const bool challenger_pin = p.challenged && p.step_id == p.challenger.id;
  if (p.challenged) p.challenger.keys.push_back(ChallengerKey(b));
  if (challenger_pin) {
    // Counted as the candidate's below once it takes over. A candidate that
    // pinned less than its challenger in a row was most likely a kernel
    // beside the step (the pipeline's, just before the step's first pin).
    const size_t pins = p.challenger.pins + 1;
    if (pins >= kTakeoverPins || pins > p.candidate.pins) {
      TakeOverCandidateLocked();
    } else {
      ++p.challenger.pins;
    }
  }
  if (p.has_candidate && p.step_id == p.candidate.id &&
      ++p.candidate.pins >= kMinStepPins) {
    // A new step id that pinned enough in a row: its step began where the id
    // first appeared.
    p.dominant_id = p.candidate.id;
    KeepInterruptionLocked();
    SplitStepLocked(p.candidate.index, p.candidate.ordinal, p.candidate.time);
    // The candidate's pins were matched against the order the step before
    // followed. The step they begin follows the recording that starts with
    // its first pin, from where its pins so far lead: a Keras training step
    // after a validation step followed the validation's order (the step
    // just recorded) and found none of its backward pass's pins there.
    if (!p.recording.empty()) {
      const size_t best = RecordingStartingWith(p.recording.front());
      if (best != SIZE_MAX && best != p.library.size() - 1) {
        FollowRecording(best);
      }
    }
    p.cursor = 0;
    p.far_at = SIZE_MAX;
    for (int64_t k : p.recording) AdvanceCursorLocked(k, &p.cursor);
    p.cursor_high = p.cursor;
    p.stalled_pins = 0;
    p.switch_at = kSwitchPins;
    p.choosing = false;
  }
  std::vector<Buffer*> plan;
  // A challenger's few pins follow no order: most are kernels running beside
  // the candidate, and one that takes over is matched from its own start.
  if (p.challenged && p.step_id == p.challenger.id) return plan;
  // Pins of a candidate step are matched, until it is confirmed or dropped,
  // as if it had begun where it first appeared: its own cursor, and ranks
  // counted from its first allocation (older buffers as they will be known).
  const bool in_candidate = InCandidateStep();
  const int64_t match_key = MatchKey(b);
  size_t& cursor = in_candidate ? p.candidate.cursor : p.cursor;
  if (p.choosing && !in_candidate) {
    const size_t best = RecordingStartingWith(key);
    if (best != SIZE_MAX) {
      p.choosing = false;
      if (best != p.library.size() - 1) FollowRecording(best);
    } else if (p.recording.size() >= kResyncWindow) {
      p.choosing = false;  // keep following the last step's order
    }
  }
  if (p.learned.empty()) return plan;
  const bool found = AdvanceCursorLocked(match_key, &cursor);
  if (in_candidate || cursor > p.cursor_high) {
    p.cursor_high = in_candidate ? p.cursor_high : cursor;
    p.stalled_pins = 0;
    p.switch_at = kSwitchPins;
  } else if (++p.stalled_pins == p.switch_at) {
    // Each search reads every recording; where none explains the pins (an
    // order that does not repeat), the next waits twice as long.
    p.switch_at *= 2;
    if (SwitchRecordingLocked(&cursor)) p.cursor_high = cursor;
  }
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
          arena_->LargestFreeAfterTaking(rounded) >=
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

void Engine::Impl::NoteStepEventLocked(StepEvent::Kind kind, const Buffer* b) {
  if (fixed_) return;  // no plan there: evictions unmap pages instead
  PrefetchState& p = prefetch_;
  StepEvent e{kind, PrefetchKey(b), p.recording.size(),
              BfcArena::RoundedBytes(b->size)};
  if (p.has_candidate) {
    e.in_candidate = true;
    e.candidate_key = CandidateKey(b);
  }
  if (p.challenged) e.challenger_key = ChallengerKey(b);
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
  ++p.plan_generation;
  if (fixed_ || events.empty()) return;
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
  const size_t slack = std::min(capacity, kPlannedInSlack * p.plan_largest);
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
    if (arena_->bytes_in_use() + rounded > lms_limit_ ||
        arena_->LargestFreeChunk() < rounded ||
        arena_->LargestFreeAfterTaking(rounded) < p.plan_largest) {
      p.in_next = i;  // no room yet: again at the next pin
      return;
    }
    Status s = PageIn(lock, b, /*for_prefetch=*/true, in.need_at,
                      /*no_reclaim=*/true);
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
