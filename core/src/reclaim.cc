// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Reclaim: which inactive buffers to page out when a request does not fit.
//
// Three policies, tried in this order by the allocation ladder (engine.cc),
// each cheaper in bytes copied than the next (a fourth, ChooseTopUpVictims,
// serves a slide: defrag.cc, TopUpAndSlideLocked):
//   single     the least recently used inactive buffer whose chunk, merged
//              with its free neighbours, holds the request. One copy.
//              (TFLMS counted neighbours with a bug so they never counted;
//              here they do, which is what makes one victim usually enough.)
//   fragments  the window of adjacent chunks, all free or reclaimable, that
//              holds the request with the fewest bytes to page out. TFLMS
//              left this step a stub; PyTorch LMS had it.
//   full       every inactive buffer.
// All three only choose; PageOut (residency.cc) copies and frees. Choosing
// runs under mu_ and touches no device.
#include <algorithm>
#include <limits>

#include "engine_impl.h"
#include "window_scan.h"

namespace tflms {
namespace {

// Splits in a run past which ChooseTopUpVictims weighs only the stretches
// between neighbouring splits (the comment there says why).
constexpr size_t kMaxTopUpSplits = 128;

}  // namespace

bool Engine::Impl::Reclaimable(const Buffer* b) const {
  return b != nullptr && b->state == BufferState::kResident && b->in_lru &&
         b->pin_count == 0 && !b->unmovable && !b->free_requested;
}

bool Engine::Impl::SingleVictimHolds(const Buffer* b, size_t rounded,
                                     size_t in_use) const {
  if (!Reclaimable(b)) return false;
  const auto [lo, hi] = arena_->SpanOf(b->chunk);
  if (static_cast<size_t>(hi - lo) < rounded) return false;
  return in_use - arena_->chunk(b->chunk)->size + rounded <= lms_limit_;
}

std::vector<Buffer*> Engine::Impl::ChooseSingleVictim(size_t rounded,
                                                     size_t protect_until) {
  // Without a learned step order: the least recently used fitting buffer.
  // With one: among fitting buffers, the one pinned again furthest in the
  // future (Belady's choice), so a large request does not evict a tensor the
  // next few ops need; a buffer never pinned again this step wins at once.
  const bool learned = FollowingLearnedOrder();
  const size_t in_use = arena_->bytes_in_use();
  Buffer* best = nullptr;
  size_t best_next = 0;
  for (Buffer* b = lru_head_; b != nullptr; b = b->lru_next) {
    if (!SingleVictimHolds(b, rounded, in_use)) continue;
    if (!learned) return {b};
    const size_t next = NextUse(b);
    if (protect_until != 0 && next <= protect_until) continue;
    if (next == SIZE_MAX) return {b};
    if (best == nullptr || next > best_next) {
      best = b;
      best_next = next;
    }
  }
  if (best != nullptr) return {best};
  return {};
}

std::vector<Buffer*> Engine::Impl::ChooseFragmentVictims(size_t rounded) {
  // Among windows of free chunks and reclaimable buffers holding `rounded`
  // bytes, keep the one that pages out the fewest bytes.
  size_t best_cost = std::numeric_limits<size_t>::max();
  BfcArena::ChunkHandle best_first = BfcArena::kInvalidChunk;
  BfcArena::ChunkHandle best_last = BfcArena::kInvalidChunk;
  ScanWindows(
      *arena_, rounded,
      [&](const BfcArena::Chunk& c) {
        return Reclaimable(static_cast<const Buffer*>(c.owner));
      },
      [&](BfcArena::ChunkHandle first, BfcArena::ChunkHandle last,
          size_t cost) {
        if (cost < best_cost) {
          best_cost = cost;
          best_first = first;
          best_last = last;
        }
      });
  std::vector<Buffer*> victims;
  if (best_first == BfcArena::kInvalidChunk) return victims;
  for (BfcArena::ChunkHandle h = best_first;; h = arena_->chunk(h)->next) {
    const BfcArena::Chunk* c = arena_->chunk(h);
    if (c->in_use()) victims.push_back(static_cast<Buffer*>(c->owner));
    if (h == best_last) break;
  }
  return victims;
}

std::vector<Buffer*> Engine::Impl::ChooseTopUpVictims(size_t rounded,
                                                      size_t after,
                                                      size_t* cost) {
  // A run: adjacent chunks of one region, each free, movable, or
  // reclaimable and pinned after `after`; any other chunk ends it. A buffer
  // that may leave but cannot move yet (still landing, or its last use not
  // yet done) either leaves or splits the run, so each stretch between such
  // splits is weighed with those inside it leaving. What its free bytes and
  // theirs lack, for the request and for the LMS limit, comes from its
  // movable buffers pinned after `after`: the smallest that covers it alone
  // (the latest pinned among equals), else the latest pinned until covered.
  enum class Kind { kFree, kStays, kMayLeave, kMustLeave };
  struct Entry {
    Buffer* buffer;
    size_t size;
    Kind kind;
  };
  const size_t in_use = arena_->bytes_in_use();
  const size_t over =
      in_use + rounded > lms_limit_ ? in_use + rounded - lms_limit_ : 0;
  auto pinned_after = [&](const Buffer* b) {
    return Reclaimable(b) && NextUse(b) > after;
  };
  std::vector<Buffer*> best;
  *cost = std::numeric_limits<size_t>::max();
  std::vector<Entry> run;
  auto weigh = [&](size_t lo, size_t hi) {  // run[lo, hi)
    size_t free_bytes = 0, must = 0;
    std::vector<Buffer*> leaving, may;
    for (size_t i = lo; i < hi; ++i) {
      const Entry& e = run[i];
      if (e.kind == Kind::kFree) free_bytes += e.size;
      if (e.kind == Kind::kMustLeave) {
        must += e.size;
        leaving.push_back(e.buffer);
      }
      if (e.kind == Kind::kMayLeave) may.push_back(e.buffer);
    }
    const size_t room = free_bytes + must;
    const size_t lack = std::max(over > must ? over - must : 0,
                                 rounded > room ? rounded - room : 0);
    if (lack == 0 && must == 0) return;  // a slide alone would do
    auto bytes = [&](const Buffer* b) { return arena_->chunk(b->chunk)->size; };
    size_t paid = must;
    if (lack > 0) {
      Buffer* one = nullptr;
      for (Buffer* b : may) {
        if (bytes(b) < lack) continue;
        if (one == nullptr || bytes(b) < bytes(one) ||
            (bytes(b) == bytes(one) && NextUse(b) > NextUse(one))) {
          one = b;
        }
      }
      if (one != nullptr) {
        leaving.push_back(one);
        paid += bytes(one);
      } else {
        std::sort(may.begin(), may.end(),
                  [&](const Buffer* x, const Buffer* y) {
                    return NextUse(x) > NextUse(y);
                  });
        size_t got = 0;
        for (Buffer* b : may) {
          if (got >= lack) break;
          leaving.push_back(b);
          got += bytes(b);
        }
        if (got < lack) return;
        paid += got;
      }
    }
    if (paid < *cost) {
      *cost = paid;
      best = std::move(leaving);
    }
  };
  auto close_run = [&] {
    std::vector<size_t> starts{0}, ends;
    for (size_t i = 0; i < run.size(); ++i) {
      if (run[i].kind != Kind::kMustLeave) continue;
      starts.push_back(i + 1);
      ends.push_back(i);
    }
    ends.push_back(run.size());
    // k splits make (k + 1)(k + 2) / 2 stretches, each weighed in time
    // linear in the run, under mu_. The planner's points reach k = 68 in
    // runs of up to 1,206 chunks (docs/lookahead.md's replays); past
    // kMaxTopUpSplits only the stretches between neighbouring splits and
    // the whole run are weighed.
    if (starts.size() > kMaxTopUpSplits + 1) {
      for (size_t i = 0; i < starts.size(); ++i) {
        if (starts[i] < ends[i]) weigh(starts[i], ends[i]);
      }
      weigh(0, run.size());
    } else {
      for (size_t lo : starts) {
        for (size_t hi : ends) {
          if (lo < hi) weigh(lo, hi);
        }
      }
    }
    run.clear();
  };
  arena_->ForEachRegion([&](BfcArena::ChunkHandle h) {
    for (; h != BfcArena::kInvalidChunk; h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      Buffer* b = static_cast<Buffer*>(c->owner);
      if (!c->in_use()) {
        run.push_back({nullptr, c->size, Kind::kFree});
      } else if (Movable(b)) {
        run.push_back(
            {b, c->size, pinned_after(b) ? Kind::kMayLeave : Kind::kStays});
      } else if (pinned_after(b)) {
        run.push_back({b, c->size, Kind::kMustLeave});
      } else {
        close_run();
      }
    }
    close_run();
  });
  if (best.empty()) *cost = 0;
  return best;
}

std::vector<Buffer*> Engine::Impl::ChooseAllInactive() {
  std::vector<Buffer*> victims;
  for (Buffer* b = lru_head_; b != nullptr; b = b->lru_next) {
    if (Reclaimable(b)) victims.push_back(b);
  }
  return victims;
}

Status Engine::Impl::ReclaimInactive(size_t* bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  *bytes = 0;
  if (!options_.lms_enabled) {
    return FailedPrecondition(
        "reclaim_inactive needs LMS; enable it with "
        "tf.config.experimental.set_lms_enabled(True)");
  }
  std::vector<Buffer*> victims = ChooseAllInactive();
  if (victims.empty()) return Status::Ok();
  Status s = PageOut(lock, victims, bytes);
  if (*bytes > 0) ++counters_.num_full_reclaims;
  return s;
}

}  // namespace tflms
