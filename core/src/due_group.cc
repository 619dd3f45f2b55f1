// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Placing a due group: the buffers the learned step pins for one kernel, and
// the output that kernel then allocates.
//
// A kernel's inputs are pinned one at a time, and once pinned none may move.
// While a learned step is followed, prefetch pages inputs in ahead of their
// pin wherever a hole is free at the time, and the pins then find them
// scattered: the output, often as large as the largest input, or the last
// input still on the host, finds no gap. At their largest batches, where
// paging on demand fit, ResNet50 on the AC922 pinned MaxPoolGrad's inputs
// (1.1, 4.6 and 1.1 GiB) as [1.1 | free 4.5 | 4.6 | free 4.5 | 1.1] and its
// 4.6 GiB output failed with 9.1 GiB free; InceptionV3 and DenseNet201
// pinned two and three of an AddN's inputs apart and the next input's
// page-in failed. placement.cc moves one buffer at its pin, judged by where
// the others lie then; the learned step knows the whole group before its
// first pin.
//
// So at the pin of the group's first member (the pins before the kernel
// unpins them or allocates): if, its resident members pinned where they lie,
// the members on the host and the output do not each find a gap (best fit,
// largest first), a window is chosen that holds them all: a run of chunks
// that may leave, overlapping the fewest bytes of resident members.
// Members in the window go to the tightest gap outside it (device to device
// where their old and new ranges are disjoint, else through the host), the
// members on the host come back into its low end, and the output's own
// placement (PlanClusterPlacement) later pages out whatever inactive buffers
// lie in the rest. Where some member in the window finds no gap outside it,
// or no window is free of early page-outs in flight, inactive buffers slide
// down within their run until a free chunk holds the window's bytes
// (defrag.cc, SlideFor); failing that, the resident members themselves slide
// down against each other, whatever else lies where they and the window go
// paged out, so that the window is free above them (PackDueGroupLocked).
// Where they do fit but two or more members are on the host, those are
// paged in where the fit put them rather than one pin at a time wherever
// best fit finds a gap then; so is a lone member on the host where its
// pin's page-in would land it where the output then finds no gap.
//
// Invariants: best effort, never an error for the pin: a member that finds
// no destination stays where it is (or on the host, and its pin pages it in
// as any other page-in). Destinations are all chosen before anything is
// copied. Only reclaimable buffers are paged out (PageOut frees a chunk only
// once its host copy completed) and only movable ones move (MoveBuffers,
// SlideFor, SlideDownLocked: their last use proven complete). mu_ is
// released during copies, so every member's state is looked at again before
// it is placed. Runs only while a learned plan is followed (prefetch on),
// never in fixed-address mode; with LMS off nothing here runs.
#include <algorithm>
#include <limits>
#include <unordered_set>
#include <utility>

#include "engine_impl.h"

namespace tflms {
namespace {

// Groups needing less room than memory_limit / this are left to
// placement.cc: the failures this answers needed 19% to 29% of the device.
constexpr size_t kDueGroupDivisor = 8;
// The most pins a group spans: the failures this answers had at most four
// large inputs; DenseNet's concats read dozens of small ones, which
// placement.cc places one at a time.
constexpr size_t kMaxGroupPins = 8;

struct Range {
  const char* lo;
  const char* hi;
  size_t size() const { return static_cast<size_t>(hi - lo); }
  bool Overlaps(const char* a, const char* b) const {
    return a < hi && b > lo;
  }
};

}  // namespace

template <typename MayLeave>
std::vector<std::pair<const char*, const char*>>
Engine::Impl::LeavableRunsLocked(MayLeave may_leave) const {
  std::vector<std::pair<const char*, const char*>> runs;
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    bool open = false;
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (!may_leave(*c)) {
        open = false;
        continue;
      }
      if (open) {
        runs.back().second = c->ptr + c->size;
      } else {
        runs.push_back({c->ptr, c->ptr + c->size});
        open = true;
      }
    }
  });
  return runs;
}

bool Engine::Impl::DueGroupFitsLocked(
    const std::unordered_set<const Buffer*>& in_group,
    const std::vector<Buffer*>& on_host, size_t output,
    std::vector<std::pair<Buffer*, const char*>>* places,
    std::pair<const char*, const char*> wall) const {
  // The gaps the resident members leave, pinned where they are: early
  // page-outs in flight count as gone (their chunks are free before the
  // output's allocation has to wait), as do inactive buffers.
  auto leaves = [&](const BfcArena::Chunk& c) {
    if (!c.in_use()) return true;
    const Buffer* o = static_cast<const Buffer*>(c.owner);
    if (in_group.count(o) != 0) return false;
    return Reclaimable(o) || (o != nullptr && o->early_out);
  };
  // Each gap as (bytes left, where they start); the arena's unreserved
  // rest has no address yet.
  std::vector<std::pair<size_t, const char*>> gaps;
  for (const auto& run : LeavableRunsLocked(leaves)) {
    Range r{run.first, run.second};
    if (wall.first != nullptr && r.Overlaps(wall.first, wall.second)) {
      if (wall.first > r.lo) {
        gaps.push_back({Range{r.lo, wall.first}.size(), r.lo});
      }
      if (wall.second < r.hi) {
        gaps.push_back({Range{wall.second, r.hi}.size(), wall.second});
      }
      continue;
    }
    gaps.push_back({r.size(), r.lo});
  }
  gaps.push_back({arena_->memory_limit() - arena_->bytes_reserved(), nullptr});
  // Best fit, largest first: whether the members on the host and the
  // output (nullptr) find a gap each, and where.
  std::vector<std::pair<size_t, Buffer*>> items = {
      {BfcArena::RoundedBytes(output), nullptr}};
  for (Buffer* m : on_host) {
    items.push_back({BfcArena::RoundedBytes(m->size), m});
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& x,
                                                  const auto& y) {
    return x.first > y.first;
  });
  places->clear();
  for (const auto& item : items) {
    auto g = gaps.end();
    for (auto h = gaps.begin(); h != gaps.end(); ++h) {
      if (h->first >= item.first && (g == gaps.end() || h->first < g->first)) {
        g = h;
      }
    }
    if (g == gaps.end()) return false;
    // The unreserved tail has no address to page a member in at: its pin
    // will, as any page-in.
    if (item.second != nullptr && g->second != nullptr) {
      places->push_back({item.second, g->second});
    }
    g->first -= item.first;
    if (g->second != nullptr) g->second += item.first;
  }
  return true;
}

bool Engine::Impl::PlaceDueGroupLocked(std::unique_lock<std::mutex>& lock,
                                       Buffer* b) {
  if (fixed_ || !FollowingPlan()) return false;
  const size_t cursor = LearnedCursor();
  if (NextUse(b) != cursor) return false;  // not in the learned order here
  // The group: the pins up to the first unpin or allocation after this
  // one, at most kMaxGroupPins. Allocations alone do not bound it: a chain
  // of kernels that forward their input allocates nothing for a while, and
  // the AddN that follows one in InceptionV3 then spanned the next kernels'
  // pins and asked room for four 4.96 GB inputs in 16 GiB (896 on the
  // AC922, 946 on the DGX-1 with twice the host ran out of memory). A
  // kernel's pins end where it unpins them, which the step recorded.
  const auto& allocs = prefetch_.plan_allocs;
  auto it = std::upper_bound(
      allocs.begin(), allocs.end(),
      std::make_pair(cursor, std::numeric_limits<size_t>::max()));
  size_t end = std::min(cursor + kMaxGroupPins, prefetch_.learned.size());
  const auto& unpins = prefetch_.plan_unpins;
  auto un = std::upper_bound(unpins.begin(), unpins.end(), cursor);
  if (un != unpins.end()) end = std::min(end, *un);
  size_t output = 0;  // the largest allocation right after the group
  if (it != allocs.end() && it->first <= end) {
    end = it->first;
    for (auto o = it; o != allocs.end() && o->first == end; ++o) {
      output = std::max(output, o->second);
    }
  }
  // Once per group: its next member's pin sees the same end.
  if (due_group_.generation == prefetch_.plan_generation &&
      due_group_.step == prefetch_.step && due_group_.end == end) {
    return false;
  }
  due_group_ = {prefetch_.plan_generation, prefetch_.step, end};

  // The members still to be pinned; pinned ones stay where they are, and
  // so do those in transit (their chunks are walls).
  std::vector<Buffer*> members;
  std::unordered_set<const Buffer*> in_group;
  std::vector<Buffer*> on_host;
  size_t need = BfcArena::RoundedBytes(output);
  const bool in_candidate = InCandidateStep();
  for (size_t i = cursor; i < end; ++i) {
    Buffer* m = BufferForKeyLocked(prefetch_.learned[i], in_candidate);
    if (m == nullptr || m->free_requested || m->pin_count > 0 ||
        m->unmovable || !in_group.insert(m).second) {
      continue;
    }
    if (m->state == BufferState::kReclaimed) {
      on_host.push_back(m);
      need += BfcArena::RoundedBytes(m->size);
    } else if (m->state == BufferState::kResident) {
      members.push_back(m);
    }
  }
  if (need < options_.memory_limit / kDueGroupDivisor) return false;
  std::vector<std::pair<Buffer*, const char*>> places;
  if (DueGroupFitsLocked(in_group, on_host, output, &places)) {
    // There is room, but each pin would page its member in alone, into the
    // gap best fit finds then, and the next member or the output may find
    // none: InceptionV3 at 692 on the DGX-1 paged in the first two of
    // AddN's three 3.6 GiB inputs as [free 3.2 | 3.6 | free 2.8 | 3.6 |
    // free 2.9] and the third failed. Where two or more members are on the
    // host, they go where the fit put them. The fit is best fit: filling
    // the largest gaps first packed ResNet50's batch norm inputs at 1497 on
    // the AC922 into the free run a later 4.8 GB allocation needed, and it
    // failed.
    //
    // One alone is its pin's own page-in, which goes where cluster
    // placement puts it: next to what cannot leave, where an early page-out
    // still in flight counts as a wall although the fit counted it as gone.
    // ResNet152 at batch 1339 on the AC922 with twice the host paged a
    // 4.29 GB batch-norm input in that way 2.0 GiB into an 8.3 GiB gap the
    // fit had filled from its low end, and the kernel's 4.29 GB output found
    // gaps of 2.0 and 2.3 GiB only. So where the output would find no gap
    // beside the member landed as its pin would land it, the member goes
    // where the fit put it. Doing so for every lone member, whether the
    // output needs it or not, made the 30 prefetch points of
    // docs/results.md 0.95% slower (the 3D U-Net's 2-11%).
    if (on_host.empty()) return false;
    if (on_host.size() == 1) {
      // Where its pin's page-in would land (AllocateChunk's first choice).
      const size_t rounded = BfcArena::RoundedBytes(on_host[0]->size);
      const ClusterPlan landing = AllocationClusterPlan(rounded);
      std::vector<std::pair<Buffer*, const char*>> unused;
      if (landing.lo == nullptr ||
          DueGroupFitsLocked(in_group, {}, output, &unused,
                             {landing.lo, landing.lo + rounded})) {
        return false;
      }
    }
    return !places.empty() && MoveDueGroupLocked(lock, places);
  }
  // The window: a run of chunks that may leave, resident members'
  // included, holding the output and the members on the host, that
  // overlaps the fewest bytes of resident members.
  auto member_bytes_in = [&](const char* lo, const char* hi) {
    size_t bytes = 0;
    for (const Buffer* m : members) {
      if (m->state != BufferState::kResident) continue;
      const BfcArena::Chunk* c = arena_->chunk(m->chunk);
      if (c->ptr < hi && c->ptr + c->size > lo) bytes += c->size;
    }
    return bytes;
  };
  auto may_leave = [&](const BfcArena::Chunk& c) {
    return !c.in_use() || Reclaimable(static_cast<const Buffer*>(c.owner));
  };
  Range window{nullptr, nullptr};
  size_t window_cost = std::numeric_limits<size_t>::max();
  for (const auto& run : LeavableRunsLocked(may_leave)) {
    if (static_cast<size_t>(run.second - run.first) < need) continue;
    // Candidate starts: the run's ends and either side of every member.
    std::vector<const char*> starts = {run.first, run.second - need};
    for (const Buffer* m : members) {
      const BfcArena::Chunk* c = arena_->chunk(m->chunk);
      starts.push_back(c->ptr + c->size);
      if (c->ptr >= run.first + need) starts.push_back(c->ptr - need);
    }
    for (const char* lo : starts) {
      if (lo < run.first || lo + need > run.second) continue;
      const size_t cost = member_bytes_in(lo, lo + need);
      if (cost < window_cost) {
        window_cost = cost;
        window = {lo, lo + need};
      }
    }
  }
  // Early page-outs in flight split every run that could hold it: the
  // members slide together instead, those page-outs settled first.
  if (window.lo == nullptr) {
    return SlideDueGroupLocked(lock, members, on_host, need);
  }

  // Resident members in the window leave it, largest first, each for the
  // tightest gap clear of the window, of the members that stay and of the
  // destinations already taken. Then the members on the host come back
  // into the window from its low end; the output takes the rest.
  // Each member with its destination (null: to be chosen).
  std::vector<std::pair<Buffer*, const char*>> moves;
  for (Buffer* m : members) {
    const BfcArena::Chunk* c = arena_->chunk(m->chunk);
    if (window.Overlaps(c->ptr, c->ptr + c->size)) {
      moves.push_back({m, nullptr});
    }
  }
  std::sort(moves.begin(), moves.end(), [](const auto& x, const auto& y) {
    return x.first->size > y.first->size;
  });
  const char* fill = window.lo;
  for (Buffer* m : on_host) {
    moves.push_back({m, fill});
    fill += BfcArena::RoundedBytes(m->size);
  }
  auto leaving = [&](const Buffer* o) {
    for (const auto& mv : moves) {
      if (mv.first == o) return true;
    }
    return false;
  };
  // Destinations first, none taken yet: a window that cannot be cleared
  // is not worth a single copy.
  std::vector<Range> taken = {window};
  for (auto& mv : moves) {
    if (mv.second != nullptr) continue;
    Buffer* m = mv.first;
    const size_t rounded = BfcArena::RoundedBytes(m->size);
    // Staying members are walls; leaving ones (m's own chunk too) not.
    auto dest_may_leave = [&](const BfcArena::Chunk& c) {
      if (!c.in_use()) return true;
      const Buffer* o = static_cast<const Buffer*>(c.owner);
      if (in_group.count(o) != 0 && !leaving(o)) return false;
      return Reclaimable(o);
    };
    size_t dest_gap = std::numeric_limits<size_t>::max();
    for (const auto& run : LeavableRunsLocked(dest_may_leave)) {
      std::vector<Range> pieces = {{run.first, run.second}};
      for (const Range& t : taken) {
        std::vector<Range> rest;
        for (const Range& p : pieces) {
          if (!p.Overlaps(t.lo, t.hi)) {
            rest.push_back(p);
            continue;
          }
          if (t.lo > p.lo) rest.push_back({p.lo, t.lo});
          if (t.hi < p.hi) rest.push_back({t.hi, p.hi});
        }
        pieces.swap(rest);
      }
      for (const Range& p : pieces) {
        if (p.size() >= rounded && p.size() < dest_gap) {
          dest_gap = p.size();
          mv.second = p.lo;
        }
      }
    }
    if (mv.second == nullptr) {
      return SlideDueGroupLocked(lock, members, on_host, need);
    }
    taken.push_back({mv.second, mv.second + rounded});
  }
  return MoveDueGroupLocked(lock, moves);
}

bool Engine::Impl::MoveDueGroupLocked(
    std::unique_lock<std::mutex>& lock,
    const std::vector<std::pair<Buffer*, const char*>>& moves) {
  bool placed_any = false;
  for (const auto& mv : moves) {
    Buffer* m = mv.first;
    if (m->free_requested || m->pin_count > 0 ||
        (m->state != BufferState::kResident &&
         m->state != BufferState::kReclaimed)) {
      continue;
    }
    const size_t rounded = BfcArena::RoundedBytes(m->size);
    const char* dest = mv.second;
    // A resident member whose new range overlaps its old one goes through
    // the host (a device copy needs disjoint ranges); so does one whose last
    // use is not proven complete once the compute stream drained.
    if (m->state == BufferState::kResident) {
      const BfcArena::Chunk* own = arena_->chunk(m->chunk);
      bool through_host =
          own->ptr < dest + rounded && own->ptr + own->size > dest;
      if (!through_host && !Movable(m)) {
        if (!SyncLastUses(lock).ok()) return placed_any;
        if (m->state != BufferState::kResident || m->pin_count > 0) continue;
        through_host = !Movable(m);
      }
      if (through_host) {
        size_t out = 0;
        if (!Reclaimable(m) || !PageOut(lock, {m}, &out).ok() || out == 0) {
          continue;
        }
      }
    }
    // Whatever else lies in the destination leaves; early page-outs in
    // flight there are waited for.
    Occupants in_dest = OccupantsLocked(dest, dest + rounded, {m});
    if (in_dest.blocked && in_dest.in_flight) {
      SettleEarlyPageOutsLocked(lock, early_outs_.size());
      in_dest = OccupantsLocked(dest, dest + rounded, {m});
    }
    if (in_dest.blocked) continue;
    if (!in_dest.leaving.empty()) {
      size_t out = 0;
      if (!PageOut(lock, in_dest.leaving, &out).ok() || out == 0) continue;
    }
    // Another thread may have pinned, freed or paged it meanwhile.
    if (m->free_requested || m->pin_count > 0) continue;
    // The destination was planned against the chunks as they were; those
    // paged out since, this member's own included, may have merged with
    // free chunks around it, leaving it inside one. UNet3D at 480^3 on the
    // A100-80 at lookahead 64 planned an up0 concat input's move to the
    // window's end (step 5); taken only at a free chunk's end, the member
    // stayed on the host, its pin paged it in 23 GiB from the other input,
    // and the 26.4 GiB output found no gap with 54.8 GB free.
    if (m->state == BufferState::kResident) {
      // The move holds both chunks until its copy is done.
      if (!Movable(m) || rounded > DeviceBytesLeftLocked()) continue;
      BfcArena::ChunkHandle h =
          arena_->TakeFreeRangeInside(dest, rounded, m->size, m);
      if (h == BfcArena::kInvalidChunk) continue;
      size_t moved = 0;
      if (!MoveBuffers(lock, {{m, h}}, &moved).ok() || moved == 0) continue;
    } else if (m->state == BufferState::kReclaimed) {
      if (arena_->bytes_in_use() + rounded > lms_limit_) continue;
      BfcArena::ChunkHandle h =
          arena_->TakeFreeRangeInside(dest, rounded, m->size, m);
      if (h == BfcArena::kInvalidChunk) continue;
      if (!PageIn(lock, m, /*for_prefetch=*/false, 0, false, h).ok()) continue;
      CountPageInAtPinLocked(m);  // its kernel waits for this copy
    } else {
      continue;
    }
    placed_any = true;
    counters_.bytes_due_group_placed += static_cast<int64_t>(m->size);
  }
  if (placed_any) ++counters_.num_due_group_placements;
  return placed_any;
}

Engine::Impl::Occupants Engine::Impl::OccupantsLocked(
    const char* lo, const char* hi, const std::vector<Buffer*>& staying) const {
  Occupants found;
  arena_->ForEachInUseIn(lo, hi, [&](const BfcArena::Chunk& c) {
    Buffer* o = static_cast<Buffer*>(c.owner);
    if (std::find(staying.begin(), staying.end(), o) != staying.end()) return;
    found.bytes += c.size;
    if (Reclaimable(o)) {
      found.leaving.push_back(o);
    } else {
      found.blocked = true;
      found.in_flight = found.in_flight || (o != nullptr && o->early_out);
    }
  });
  return found;
}

bool Engine::Impl::SlideDueGroupLocked(std::unique_lock<std::mutex>& lock,
                                       const std::vector<Buffer*>& members,
                                       const std::vector<Buffer*>& on_host,
                                       size_t need) {
  // No window clears with whole moves: every gap between what stays is
  // smaller than the members in the way. DenseNet201 at batch 1208 on the
  // AC922 with twice the host pinned three of AddN's four 3.2 GiB inputs
  // as [1.3 | 3.2 | 2.3 | 6.3 | 2.9] and the fourth found no room; all four
  // fit with 3.4 GiB to spare. Inactive buffers slide down within their run
  // (defrag.cc) until a free chunk holds the members on the host and the
  // output, and those members come back into its low end.
  size_t moved = 0;
  if (!SlideFor(lock, need, &moved).ok() || arena_->LargestFreeChunk() < need) {
    // The free bytes of no run reach `need` while inactive buffers hold the
    // rest: the members themselves slide together instead.
    size_t packed = 0;
    const bool any = PackDueGroupLocked(lock, members, need, &packed);
    moved += packed;
    if (!any || arena_->LargestFreeChunk() < need) return moved > 0;
  }
  bool placed_any = moved > 0;
  for (Buffer* m : on_host) {
    if (m->state != BufferState::kReclaimed || m->free_requested) continue;
    const size_t rounded = BfcArena::RoundedBytes(m->size);
    if (arena_->bytes_in_use() + rounded > lms_limit_) break;
    const char* lo = nullptr;
    size_t largest = 0;
    arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
      for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
           h = arena_->chunk(h)->next) {
        const BfcArena::Chunk* c = arena_->chunk(h);
        if (!c->in_use() && c->size > largest) {
          largest = c->size;
          lo = c->ptr;
        }
      }
    });
    if (largest < rounded || rounded > DeviceBytesLeftLocked()) break;
    BfcArena::ChunkHandle h = arena_->TakeFreeRange(lo, rounded, m->size, m);
    if (h == BfcArena::kInvalidChunk) break;
    if (!PageIn(lock, m, /*for_prefetch=*/false, 0, false, h).ok()) break;
    CountPageInAtPinLocked(m);  // its kernel waits for this copy
    counters_.bytes_due_group_placed += static_cast<int64_t>(m->size);
    placed_any = true;
  }
  if (placed_any) ++counters_.num_due_group_placements;
  return placed_any;
}

bool Engine::Impl::PackDueGroupLocked(std::unique_lock<std::mutex>& lock,
                                      const std::vector<Buffer*>& members,
                                      size_t need, size_t* moved) {
  // UNet3D at 304^3 on a V100 had a concat's two 3.35 GiB inputs side by
  // side 0.75 GiB above the lowest address it could use, two early
  // page-outs in flight above them, and its 6.70 GiB output fell 16 MiB
  // short of a gap once the rest had left: every window of 6.70 GiB
  // overlapped a member, and no gap outside it held one. The members slide
  // down against each other (device to device, in pieces), so that their
  // slack gathers above them, where the output goes.
  *moved = 0;
  if (members.empty()) return false;
  std::unordered_set<const Buffer*> sliding(members.begin(), members.end());
  auto in_run = [&](const BfcArena::Chunk& c) {
    if (!c.in_use()) return true;
    const Buffer* o = static_cast<const Buffer*>(c.owner);
    if (sliding.count(o) != 0) return o->pin_count == 0;
    return Reclaimable(o) || (o != nullptr && o->early_out);
  };
  // The run of chunks that may slide or leave holding every member; the
  // members go to its low end, packed in address order, `need` above them.
  const char* lowest = nullptr;
  const char* top = nullptr;  // the highest member's end
  size_t member_bytes = 0;
  for (const Buffer* m : members) {
    if (m->state != BufferState::kResident) return false;
    const BfcArena::Chunk* c = arena_->chunk(m->chunk);
    if (lowest == nullptr || c->ptr < lowest) lowest = c->ptr;
    top = std::max<const char*>(top, c->ptr + c->size);
    member_bytes += c->size;
  }
  Range run{nullptr, nullptr};
  for (const auto& r : LeavableRunsLocked(in_run)) {
    if (r.first <= lowest && top <= r.second) run = {r.first, r.second};
  }
  if (run.lo == nullptr || run.size() < member_bytes + need) return false;
  // Where the packed members start: the run's low end, or higher where
  // fewer bytes then leave (the range from there up to the packed output's
  // end or the highest member's, whichever is higher, is cleared).
  std::vector<Buffer*> order(members);
  auto by_address = [&] {
    std::sort(order.begin(), order.end(),
              [&](const Buffer* x, const Buffer* y) {
                return arena_->chunk(x->chunk)->ptr <
                       arena_->chunk(y->chunk)->ptr;
              });
  };
  by_address();
  // Each member slides as far as the bytes below it that are not members,
  // in pieces that long: not at all, or at least 1/kMaxSlidePieces of it.
  auto slides = [&](const char* s) {
    const char* at = s;
    for (const Buffer* m : order) {
      const BfcArena::Chunk* c = arena_->chunk(m->chunk);
      const size_t distance = static_cast<size_t>(c->ptr - at);
      if (distance != 0 && distance < c->size / kMaxSlidePieces) return false;
      at += c->size;
    }
    return true;
  };
  const char* start = nullptr;
  size_t cost = std::numeric_limits<size_t>::max();
  const size_t span = member_bytes + need;
  std::vector<const char*> starts = {run.lo, lowest, run.hi - span};
  if (static_cast<size_t>(top - run.lo) >= span) starts.push_back(top - span);
  for (const char* s : starts) {
    if (s < run.lo || s > lowest || s + span > run.hi || !slides(s)) continue;
    const size_t c =
        OccupantsLocked(s, std::max(s + span, top), members).bytes;
    if (c < cost) {
      cost = c;
      start = s;
    }
  }
  if (start == nullptr) return false;
  const char* clear_hi = std::max(start + span, top);
  // Every member's last use and page-in complete (they are copied on the
  // compute stream), the early page-outs in the range settled, the
  // inactive buffers there paged out.
  if (!SyncLastUses(lock).ok()) return false;
  for (const Buffer* m : members) {
    if (m->ready && !device_->EventDone(m->ready)) {
      EventRef ready = m->ready;
      lock.unlock();
      const Status st = device_->SynchronizeEvent(ready);
      lock.lock();
      if (!st.ok()) return false;
    }
  }
  // The members all lie in [start, clear_hi) and must be movable.
  auto blocked = [&](const Occupants& in_range) {
    return in_range.blocked ||
           std::any_of(members.begin(), members.end(),
                       [&](const Buffer* m) { return !Movable(m); });
  };
  Occupants in_range = OccupantsLocked(start, clear_hi, members);
  if (blocked(in_range) && in_range.in_flight) {
    SettleEarlyPageOutsLocked(lock, early_outs_.size());
  }
  in_range = OccupantsLocked(start, clear_hi, members);
  if (blocked(in_range)) return false;
  if (!in_range.leaving.empty()) {
    size_t out = 0;
    if (!PageOut(lock, in_range.leaving, &out).ok() || out == 0) return false;
  }
  // Another thread may have evicted, pinned or moved one while mu_ was
  // released.
  for (Buffer* m : members) {
    if (m->state != BufferState::kResident || m->pin_count > 0) {
      return false;
    }
  }
  // Lowest first: each slides into the free chunk that the page-outs, or
  // the slide of the member below it, left below it. mu_ is released
  // during each copy.
  by_address();
  for (Buffer* m : order) {
    if (!Movable(m)) return *moved > 0;
    const BfcArena::Chunk* c = arena_->chunk(m->chunk);
    const BfcArena::ChunkHandle below = c->prev;
    if (below == BfcArena::kInvalidChunk || arena_->chunk(below)->in_use()) {
      continue;  // already against the member (or wall) below it
    }
    if (arena_->chunk(below)->size < c->size / kMaxSlidePieces) continue;
    const size_t size = c->size;
    if (!SlideDownLocked(lock, m, below).ok()) return *moved > 0;
    *moved += size;
  }
  counters_.bytes_due_group_placed += static_cast<int64_t>(*moved);
  return *moved > 0;
}

}  // namespace tflms
