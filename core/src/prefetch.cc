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
}  // namespace

int64_t PrefetchKey(const Buffer* b) {
  return b->step_ordinal >= 0 ? b->step_ordinal : -b->id;
}

void Engine::Impl::StepBegin() {
  std::lock_guard<std::mutex> lock(mu_);
  PrefetchState& p = prefetch_;
  if (!p.recording.empty()) {
    p.learned.swap(p.recording);
    p.positions.clear();
    for (size_t i = 0; i < p.learned.size(); ++i) {
      p.positions[p.learned[i]].push_back(i);
    }
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
  std::vector<Buffer*> plan;
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
