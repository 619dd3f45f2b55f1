// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Layout look-ahead: where a planned copy in may go
// (EngineOptions::layout_lookahead, experimental, off by default).
//
// The plan (step_plan.cc) counts bytes, not addresses, so a copy it issues
// early can take the hole that an allocation of the same stretch of the step
// then does not find; that allocation reclaims on demand, the host waiting.
// The plan's slack (twice the step's largest buffer kept free of planned
// copies) and the check at issue (a hole of that size left) guard against
// that everywhere at once, and so also hold back copies whose stretch
// allocates nothing large (ResNet50 at 356 on the DGX-1: the backward pass's
// host-to-device link 12% busy where the Ideal's is 64%). Here each copy's
// own stretch is asked instead: from the arena's real layout, the learned
// step's events from now to the copy's use, on through the outputs of the
// kernel that uses it, are replayed over a model of the free chunks with the
// copy in one place (the bottom or top end of one of the smallest free
// chunks that hold it). The copy takes the first place beside which every
// allocation and page-in of the stretch finds room; where none does, it
// waits for the next pin. Places whose bytes the GPU is done with come
// first: a copy into a chunk whose last kernel has not run yet waits for it
// on the host-to-device stream, and every copy queued behind it with it.
//
// The model frees nothing that the step does not free (no page-outs), so in
// a stretch that needs page-outs no place is found and the copy waits, as
// the slack made it wait. Such a stretch is mostly told by its bytes alone,
// before any place is replayed; and a refusal is given again without a look
// while the free chunks stay as they were (the pins of one kernel's inputs).
//
// A look costs the host time in proportion to the events it models and the
// free ranges its best fits scan (counted in the stats, and told to the
// device: the planner's SimDevice charges them to its modelled host, at
// rates measured on the planner's own machine). At the planner's points
// that cost outweighs what the placement wins (docs/how-it-works.md).
//
// Invariants of FreeRanges: ranges are kept by address and neither overlap
// nor touch (coalesced as BfcArena::FreeChunk coalesces); a range taken by
// best fit is split as the arena would split the chunk; the bytes in use
// never pass the LMS limit.
//
// Thread-safety: runs with mu_ held, and never releases it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine_impl.h"

namespace tflms {
namespace {

// Events of the learned step a look replays at most, which bounds its host
// time (some 50 us a look on average on the planner's machine, eight
// places tried). What the step does beyond them is not checked.
constexpr size_t kLookAheadEvents = 4096;
// Free chunks (smallest first) whose two ends are tried as places.
constexpr size_t kPlacesTried = 4;

class FreeRanges {
 public:
  using Range = std::pair<const char*, size_t>;  // (start, bytes)

  FreeRanges(const BfcArena* arena, size_t in_use, size_t limit)
      : arena_(arena), in_use_(in_use), limit_(limit) {}

  // The arena's free chunks (none touching), in any order; Sort() after.
  void Append(const char* lo, size_t size) { ranges_.push_back({lo, size}); }
  void Sort() { std::sort(ranges_.begin(), ranges_.end()); }

  void Release(const char* lo, size_t size) {
    in_use_ -= std::min(in_use_, size);
    auto next = std::lower_bound(
        ranges_.begin(), ranges_.end(), lo,
        [](const Range& r, const char* at) { return r.first < at; });
    const bool joins_next = next != ranges_.end() && lo + size == next->first;
    const bool joins_prev = next != ranges_.begin() &&
                            (next - 1)->first + (next - 1)->second == lo;
    if (joins_prev && joins_next) {
      (next - 1)->second += size + next->second;
      ranges_.erase(next);
    } else if (joins_prev) {
      (next - 1)->second += size;
    } else if (joins_next) {
      next->first = lo;
      next->second += size;
    } else {
      ranges_.insert(next, {lo, size});
    }
  }

  // Ranges TakeBestFit looked at (what a look's host time grows with,
  // beside its events).
  size_t scanned() const { return scanned_; }

  // Best fit (the smallest range that holds it, the lowest of equals) at
  // its bottom end, as BfcArena::FindChunk takes it. Returns the range
  // taken ({nullptr, 0} where none holds `rounded` or the LMS limit would
  // be passed).
  Range TakeBestFit(size_t rounded) {
    if (in_use_ + rounded > limit_) return {nullptr, 0};
    scanned_ += ranges_.size();
    size_t best = ranges_.size();
    for (size_t i = 0; i < ranges_.size(); ++i) {
      const bool fits = ranges_[i].second >= rounded;
      if (fits && (best == ranges_.size() ||
                   ranges_[i].second < ranges_[best].second)) {
        best = i;
      }
    }
    if (best == ranges_.size()) return {nullptr, 0};
    const Range r = ranges_[best];
    const size_t taken =
        arena_->WouldSplit(r.second, rounded) ? rounded : r.second;
    Remove(best, r.first, taken);
    return {r.first, taken};
  }

  // Takes exactly [lo, lo + rounded) out of the free range `range` holding
  // it (TakeFreeRange splits whatever the size).
  void TakeAt(Range range, const char* lo, size_t rounded) {
    auto it = std::lower_bound(
        ranges_.begin(), ranges_.end(), range.first,
        [](const Range& r, const char* at) { return r.first < at; });
    Remove(static_cast<size_t>(it - ranges_.begin()), lo, rounded);
  }

  // The free ranges holding `rounded`, smallest first (the lowest of
  // equals), at most `n`.
  std::vector<Range> Smallest(size_t rounded, size_t n) const {
    std::vector<Range> out;
    for (const Range& r : ranges_) {
      if (r.second >= rounded) out.push_back(r);
    }
    std::stable_sort(out.begin(), out.end(),
                     [](const Range& a, const Range& b) {
                       return a.second < b.second;
                     });
    if (out.size() > n) out.resize(n);
    return out;
  }

 private:
  // Takes [lo, lo + taken) out of ranges_[i], which holds it.
  void Remove(size_t i, const char* lo, size_t taken) {
    const Range r = ranges_[i];
    const char* end = r.first + r.second;
    const bool below = lo > r.first;
    const bool above = lo + taken < end;
    if (below && above) {
      ranges_[i].second = static_cast<size_t>(lo - r.first);
      ranges_.insert(ranges_.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                     {lo + taken, static_cast<size_t>(end - (lo + taken))});
    } else if (below) {
      ranges_[i].second = static_cast<size_t>(lo - r.first);
    } else if (above) {
      ranges_[i] = {lo + taken, static_cast<size_t>(end - (lo + taken))};
    } else {
      ranges_.erase(ranges_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    in_use_ += taken;
  }

  const BfcArena* arena_;
  size_t in_use_;
  size_t limit_;
  std::vector<Range> ranges_;  // by address, none overlapping or touching
  size_t scanned_ = 0;
};

}  // namespace

void Engine::Impl::NoteLookLocked(size_t events, size_t ranges_scanned) {
  counters_.layout_look_events += static_cast<int64_t>(events);
  counters_.layout_look_ranges_scanned += static_cast<int64_t>(ranges_scanned);
  device_->NoteLayoutLook(static_cast<int64_t>(events),
                          static_cast<int64_t>(ranges_scanned));
}

BfcArena::ChunkHandle Engine::Impl::TakeChunkForPlannedInLocked(
    Buffer* b, size_t from, size_t need_at, bool in_candidate) {
  PrefetchState& p = prefetch_;
  PrefetchState::LookRefused asked;
  asked.buffer_id = b->id;
  asked.need_at = need_at;
  asked.generation = p.plan_generation;
  asked.in_candidate = in_candidate;
  asked.layout = arena_->free_layout_version();
  asked.in_use = arena_->bytes_in_use();
  asked.limit = lms_limit_;
  const PrefetchState::LookRefused& last = p.look_refused;
  if (asked.layout == last.layout && asked.buffer_id == last.buffer_id &&
      asked.need_at == last.need_at && asked.generation == last.generation &&
      asked.in_candidate == last.in_candidate &&
      asked.in_use == last.in_use && asked.limit == last.limit) {
    ++counters_.num_layout_looks_repeated;
    return BfcArena::kInvalidChunk;
  }
  ++counters_.num_layout_looks;
  const size_t rounded = BfcArena::RoundedBytes(b->size);
  FreeRanges initial(arena_.get(), arena_->bytes_in_use(), lms_limit_);
  arena_->ForEachRegion([&](BfcArena::ChunkHandle h) {
    for (; h != BfcArena::kInvalidChunk; h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (!c->in_use()) initial.Append(c->ptr, c->size);
    }
  });
  initial.Sort();
  // The stretch, resolved once for every place tried: the learned step's
  // events from `from` up to the copy's pin and on through the outputs of
  // the kernel that pins it (to its first unpin), since that kernel's
  // inputs and outputs are what its pin would place together
  // (due_group.cc). A take is an allocation still to come or the first pin
  // of a buffer now on the host; a release frees a take of the stretch or
  // the chunk of a buffer on the device now.
  struct Op {
    bool take;
    size_t bytes;         // take: rounded bytes
    size_t of_take;       // release of a take: its index; else SIZE_MAX
    const char* lo;       // release of a chunk on the device now
  };
  std::vector<Op> ops;
  std::unordered_map<int64_t, size_t> taken;  // key -> index of its take
  std::unordered_set<const Buffer*> released;
  size_t takes = 0;
  auto first = std::lower_bound(
      p.plan_events.begin(), p.plan_events.end(), from,
      [](const StepEvent& e, size_t at) { return e.at < at; });
  size_t walked = 0;
  for (auto e = first; e != p.plan_events.end() && walked < kLookAheadEvents &&
                       (e->at < need_at || e->kind != StepEvent::kUnpin);
       ++e, ++walked) {
    if (e->kind == StepEvent::kUnpin) continue;
    auto t = taken.find(e->key);
    if (t != taken.end()) {
      if (e->kind == StepEvent::kFree) {
        ops.push_back({false, 0, t->second, nullptr});
        taken.erase(t);
      }
      continue;
    }
    const Buffer* x = BufferForKeyLocked(e->key, in_candidate);
    if (x == b) continue;
    const bool on_device = x != nullptr && x->chunk != BfcArena::kInvalidChunk;
    size_t bytes = 0;
    if (e->kind == StepEvent::kFree) {
      if (on_device && released.insert(x).second) {
        const BfcArena::Chunk* c = arena_->chunk(x->chunk);
        ops.push_back({false, c->size, SIZE_MAX, c->ptr});
      }
      continue;
    } else if (e->kind == StepEvent::kPin) {
      if (x == nullptr || x->state != BufferState::kReclaimed) continue;
      bytes = BfcArena::RoundedBytes(x->size);
    } else if (on_device) {
      continue;  // allocated already
    } else {
      bytes = e->bytes;
    }
    taken[e->key] = takes++;
    ops.push_back({true, bytes, SIZE_MAX, nullptr});
  }
  // The look's work: events modelled and free ranges scanned.
  size_t modelled = walked;
  size_t scanned = 0;
  auto refuse = [&] {
    p.look_refused = asked;
    ++counters_.num_layout_looks_refused;
    NoteLookLocked(modelled, scanned);
    return BfcArena::kInvalidChunk;
  };
  // Where the stretch's bytes alone pass the LMS limit beside the copy, it
  // needs page-outs, which the model does not make: no place can fit, and
  // none is replayed (most refusals, and the costly part of a look: a
  // replay scans the free ranges at every take). Takes count their rounded
  // bytes, no more than a replay's takes hold, so a place that a replay
  // would find is never refused here.
  {
    size_t in_use = arena_->bytes_in_use() + rounded;
    std::vector<size_t> take_bytes;
    take_bytes.reserve(takes);
    for (const Op& op : ops) {
      ++modelled;
      if (op.take) {
        if (in_use + op.bytes > lms_limit_) return refuse();
        in_use += op.bytes;
        take_bytes.push_back(op.bytes);
      } else {
        const size_t freed =
            op.of_take != SIZE_MAX ? take_bytes[op.of_take] : op.bytes;
        in_use -= std::min(in_use, freed);
      }
    }
  }
  // Whether every take of the stretch finds room beside the copy at `lo`.
  std::vector<std::pair<const char*, size_t>> placed(takes);
  auto fits_beside = [&](std::pair<const char*, size_t> range,
                         const char* lo) {
    FreeRanges ranges = initial;
    ranges.TakeAt(range, lo, rounded);
    size_t next_take = 0;
    bool fits = true;
    for (const Op& op : ops) {
      ++modelled;
      if (op.take) {
        placed[next_take] = ranges.TakeBestFit(op.bytes);
        if (placed[next_take++].first == nullptr) {
          fits = false;
          break;
        }
      } else if (op.of_take != SIZE_MAX) {
        ranges.Release(placed[op.of_take].first, placed[op.of_take].second);
      } else {
        ranges.Release(op.lo, op.bytes);
      }
    }
    scanned += ranges.scanned();
    return fits;
  };
  // Places whose bytes the GPU is done with first: a copy into a chunk
  // whose last kernel has not run waits for it on the host-to-device
  // stream, and the copies queued behind it with it.
  auto free_now = [&](const char* chunk_lo) {
    const BfcArena::Chunk* c = arena_->chunk(arena_->HandleFor(chunk_lo));
    EventRef event;
    uint64_t covers = 0;
    uint64_t free_seq = 0;
    if (!LastUseEventLocked(c->reuse_after, &event, &covers, &free_seq)) {
      return false;
    }
    return !event || device_->EventDone(event);
  };
  const std::vector<std::pair<const char*, size_t>> ranges =
      initial.Smallest(rounded, kPlacesTried);
  for (bool now : {true, false}) {
    for (const auto& range : ranges) {
      if (free_now(range.first) != now) continue;
      for (const char* lo :
           {range.first, range.first + range.second - rounded}) {
        if (fits_beside(range, lo)) {
          NoteLookLocked(modelled, scanned);
          return arena_->TakeFreeRange(lo, rounded, b->size, b);
        }
      }
    }
  }
  return refuse();
}

}  // namespace tflms
