// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Finding steps: where one step ends and the next begins, and which recorded
// order each follows (prefetch.cc follows it).
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
// Invariants: `recording` holds the keys pinned since the step began (an
// open candidate's included, keyed as the step's); a candidate's and a
// challenger's `keys` are the same pins from their first, keyed as their
// step's; `library` holds at most kLibrarySize recordings, the newest last,
// and `learned` is a copy of library[learned_index]. Nothing here pages or
// copies: a wrong boundary or order costs prefetch hits, never data.
//
// Thread-safety: every function but NoteStepId and NoteAllocationSite
// (lock-free, per thread) runs with mu_ held.

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "engine_impl.h"
#include "prefetch_keys.h"

namespace tflms {
namespace {
// Fewer pins than this under one step id are not a step of their own (an
// eager op pins its few inputs; a training step's function hundreds).
constexpr size_t kMinStepPins = 16;
// Pins in a row by which another id takes a candidate's place (from its own
// first pin); fewer, between the candidate's pins, are kernels running
// beside it (OpenChallengeLocked). An input pipeline's function pins one
// tensor; the step whose id came after a few kernels that are not steps
// (an apply function, eager ops) pins hundreds.
constexpr size_t kTakeoverPins = 4;
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

void Engine::Impl::StepBegin() {
  std::lock_guard<std::mutex> lock(mu_);
  StepBeginLocked();
}

void Engine::Impl::StepBeginLocked() {
  DropCandidateLocked();  // nothing moves over: the step begins here
  KeepInterruptionLocked();
  SplitStepLocked(prefetch_.recording.size(), prefetch_.next_ordinal,
                  GuardNowLocked());
}

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
  open->event_keys.clear();
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
    if (e.in_candidate) {
      e.candidate_key = p.challenger.event_keys[i - p.challenger.events];
    }
  }
  for (auto& entry : p.challenger.by_key) {
    entry.second->candidate_rank = entry.second->challenger_rank;
  }
  p.candidate = std::move(p.challenger);
  p.candidate.event_keys.clear();
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
  ResetStallLocked(0);
  p.far_at = SIZE_MAX;
  ++p.step;
  p.next_ordinal -= ordinal_base;
  p.by_key = std::move(by_key);
  p.size_counts = std::move(p.candidate.size_counts);
  DropCandidateLocked();
}

void Engine::Impl::FollowRecording(size_t index) {
  PrefetchState& p = prefetch_;
  ++p.host_generation;  // positions name other pins now
  p.learned = p.library[index];
  p.learned_index = index;
  p.learned_is_last = index + 1 == p.library.size();
  ResetStallLocked(0);
  p.lost_at = SIZE_MAX;
  p.far_at = SIZE_MAX;
  p.positions.clear();
  for (size_t i = 0; i < p.learned.size(); ++i) {
    p.positions[p.learned[i]].push_back(i);
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

void Engine::Impl::NoteStepPinLocked(const Buffer* b, int64_t key) {
  PrefetchState& p = prefetch_;
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
    ConfirmCandidateLocked();
  }
}

void Engine::Impl::ConfirmCandidateLocked() {
  PrefetchState& p = prefetch_;
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
  ResetStallLocked(p.cursor);
  p.choosing = false;
}

void Engine::Impl::ChooseRecordingLocked(int64_t key) {
  PrefetchState& p = prefetch_;
  if (!p.choosing) return;
  const size_t best = RecordingStartingWith(key);
  if (best != SIZE_MAX) {
    p.choosing = false;
    if (best != p.library.size() - 1) FollowRecording(best);
  } else if (p.recording.size() >= kResyncWindow) {
    p.choosing = false;  // keep following the last step's order
  }
}

void Engine::Impl::ResetStallLocked(size_t high) {
  PrefetchState& p = prefetch_;
  p.cursor_high = high;
  p.stalled_pins = 0;
  p.switch_at = kSwitchPins;
}

void Engine::Impl::NoteCursorProgressLocked(bool in_candidate,
                                            size_t* cursor) {
  PrefetchState& p = prefetch_;
  // A candidate's pins move its own cursor, not the step's: they neither
  // advance nor stall the step's.
  if (in_candidate || *cursor > p.cursor_high) {
    ResetStallLocked(in_candidate ? p.cursor_high : *cursor);
    return;
  }
  if (++p.stalled_pins != p.switch_at) return;
  // Each search reads every recording; where none explains the pins (an
  // order that does not repeat), the next waits twice as long.
  p.switch_at *= 2;
  if (SwitchRecordingLocked(cursor)) p.cursor_high = *cursor;
}

}  // namespace tflms
