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
// (While, If, nested calls) runs under its caller's. A change of id ends a
// step only if the id that ends had at least kMinStepPins pins: eager ops
// and small functions between steps are folded into the next step's
// recording (their pins then repeat with it, or cost a resync), however many
// of them run in a row.
// A step of several functions (each its own id, e.g. a custom loop calling a
// gradient function and then an apply function) yields one recording per
// function; the last kLibrarySize recordings are kept and each step follows
// the one in which its first pin comes earliest. The first (tracing) call of
// a function pins in an order of its own; the next call's recording replaces
// it, so prefetch starts from the third call.
//
// Bounds: prefetched-but-not-yet-pinned bytes stay under
// prefetch_budget_bytes, and a prefetch may evict at most one victim (single
// reclaim), never run a full reclaim or defragmentation.
#include <algorithm>
#include <cstdint>

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
  if (p.has_step_id && p.step_id == step_id) return;
  const bool boundary = p.has_step_id && p.id_pins >= kMinStepPins;
  p.has_step_id = true;
  p.step_id = step_id;
  p.id_pins = 0;
  if (boundary) StepBeginLocked();
}

void Engine::Impl::FollowRecording(size_t index) {
  PrefetchState& p = prefetch_;
  p.learned = p.library[index];
  p.positions.clear();
  for (size_t i = 0; i < p.learned.size(); ++i) {
    p.positions[p.learned[i]].push_back(i);
  }
}

void Engine::Impl::StepBeginLocked() {
  PrefetchState& p = prefetch_;
  if (!p.recording.empty()) {
    if (p.library.size() == kLibrarySize) p.library.erase(p.library.begin());
    p.library.push_back(std::move(p.recording));
    // Until this step's first pins say otherwise, it follows the last one.
    FollowRecording(p.library.size() - 1);
    p.choosing = p.library.size() > 1;
  }
  p.recording.clear();
  p.cursor = 0;
  ++p.step;
  p.next_ordinal = 0;
  // Buffers of the finished step that are still alive are now long-lived:
  // from here on they are known by id.
  for (auto& entry : p.by_ordinal) entry.second->step_ordinal = -1;
  p.by_ordinal.clear();
}

size_t Engine::Impl::NextUse(const Buffer* b) const {
  auto it = prefetch_.positions.find(PrefetchKey(b));
  if (it == prefetch_.positions.end()) return SIZE_MAX;
  const std::vector<size_t>& pos = it->second;
  auto next = std::lower_bound(pos.begin(), pos.end(), prefetch_.cursor);
  return next == pos.end() ? SIZE_MAX : *next;
}

void Engine::Impl::ForgetBufferForPrefetch(Buffer* b) {
  if (b->step_ordinal >= 0 && b->step_created == prefetch_.step) {
    prefetch_.by_ordinal.erase(b->step_ordinal);
  }
}

std::vector<Buffer*> Engine::Impl::NotePinAndPlan(Buffer* b) {
  PrefetchState& p = prefetch_;
  const int64_t key = PrefetchKey(b);
  p.recording.push_back(key);
  ++p.id_pins;
  std::vector<Buffer*> plan;
  if (p.choosing) {
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
  const size_t end = std::min(p.learned.size(), p.cursor + kResyncWindow);
  bool found = false;
  for (size_t i = p.cursor; i < end; ++i) {
    if (p.learned[i] == key) {
      p.cursor = i + 1;
      found = true;
      break;
    }
  }
  if (!found) return plan;
  size_t budget_left = options_.prefetch_budget_bytes > p.inflight_bytes
                           ? options_.prefetch_budget_bytes - p.inflight_bytes
                           : 0;
  const size_t stop =
      std::min(p.learned.size(),
               p.cursor + static_cast<size_t>(options_.prefetch_lookahead));
  for (size_t i = p.cursor; i < stop; ++i) {
    const int64_t k = p.learned[i];
    Buffer* next = nullptr;
    if (k >= 0) {
      auto it = p.by_ordinal.find(k);
      if (it != p.by_ordinal.end()) next = it->second;
    } else {
      auto it = by_id_.find(-k);
      if (it != by_id_.end()) next = it->second;
    }
    if (next == nullptr || next->state != BufferState::kReclaimed ||
        next->free_requested) {
      continue;
    }
    // A tensor larger than the budget is not prefetched even when nothing
    // else is in flight: tried, it made the planner's ResNet50 at 6x batch
    // swap 23% more bytes (its page-in evicts what the next ops need).
    if (next->size > budget_left) break;
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
    Status s = PageIn(lock, b, /*for_prefetch=*/true,
                      needed_at == SIZE_MAX ? 0 : needed_at);
    if (b->free_requested) {
      DestroyBufferLocked(b);
      continue;
    }
    if (!s.ok()) break;  // no room without costly reclaim: stop here
    ++counters_.num_prefetches;
    b->prefetched = true;
    prefetch_.inflight_bytes += b->size;
  }
}

}  // namespace tflms
