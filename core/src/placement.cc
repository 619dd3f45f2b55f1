// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Cluster placement: where a large request made under memory pressure goes.
//
// Best fit looks at free chunks only. Under LMS pressure almost nothing is
// free and the chunk a request gets is wherever a victim happened to sit, so
// the buffers one op pins end up scattered: ResNet50 at batch 1444 on 16 GiB
// failed a 4.8 GB MaxPoolGrad output with 10 GB free, split by its three
// pinned inputs into holes of 1.3, 4.5 and 4.3 GB. What decides whether an op
// fits is the layout of the chunks that cannot leave (active buffers, raw
// allocations): everything else can be paged out. So a large request under
// pressure is placed by that view: it goes to one end of the tightest gap
// between chunks that cannot leave (best fit over that view), next to an
// active chunk or a region edge, paging out the inactive buffers in the way.
// Pinned buffers then pack together and leave the largest gap whole.
//
// Before its pin, a resident buffer of a quarter of the device or more that
// sits stranded in the middle of such a gap moves to one of its ends
// (RelocateStrandedLocked); while a learned plan is followed, only if the
// allocations and page-ins of the step's next pins would otherwise find no
// gap. Early page-outs still in flight count as walls,
// except when the learned step is about to make an allocation that large:
// then they are settled and count as free, and a smaller stranded buffer
// moves too if, pinned where it is beside the other buffers the step pins
// before that allocation, it would leave the allocation no gap large enough.
//
// Invariants: only chooses under mu_; the page-out itself is PageOut's
// (residency.cc), which frees a chunk only after its host copy completed.
// With LMS off nothing here runs, so TensorFlow's BFC placement is kept.
#include <algorithm>
#include <limits>

#include "engine_impl.h"

namespace tflms {
namespace {

// Requests of at least memory_limit / kClusterDivisor bytes are "large".
constexpr size_t kClusterDivisor = 64;
// How many pins ahead of a pin an allocation counts as due (the rest of the
// pinning kernel's inputs, then its outputs).
constexpr size_t kDuePins = 8;

bool LargeForPlacement(size_t rounded, size_t memory_limit) {
  return rounded >= memory_limit / kClusterDivisor;
}

}  // namespace

bool Engine::Impl::PlacementPressure() const {
  // Fixed-address mode maps pages behind any virtual address: no physical
  // fragmentation to avoid; nor has the unfragmented yardstick. Without
  // bytes on the host nothing was evicted yet, and best fit keeps
  // TensorFlow's placement.
  return options_.lms_enabled && !fixed_ && !options_.unfragmented &&
         counters_.current_bytes_reclaimed > 0;
}

bool Engine::Impl::UnderPlacementPressure(size_t rounded) const {
  return PlacementPressure() &&
         LargeForPlacement(rounded, options_.memory_limit);
}

bool Engine::Impl::UnderPlacementPressure(const Buffer& b) const {
  // Every pin asks; the chunk is another cache line, which a pin without
  // pressure (the common case) does not touch.
  return PlacementPressure() &&
         LargeForPlacement(arena_->chunk(b.chunk)->size, options_.memory_limit);
}

Engine::Impl::ClusterPlan Engine::Impl::PlanClusterPlacement(
    size_t rounded, const std::unordered_set<const Buffer*>* stay) {
  ClusterPlan plan;
  size_t best_gap = std::numeric_limits<size_t>::max();
  size_t best_cost = std::numeric_limits<size_t>::max();
  auto may_leave = [&](const BfcArena::Chunk& c) {
    if (!c.in_use()) return true;
    const Buffer* o = static_cast<const Buffer*>(c.owner);
    return Reclaimable(o) && (stay == nullptr || stay->count(o) == 0);
  };
  // Bytes of in-use chunks overlapping [lo, lo + rounded) within a gap
  // starting at chunk `first`.
  auto cost_of = [&](BfcArena::ChunkHandle first, const char* lo) {
    size_t cost = 0;
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (c->ptr >= lo + rounded) break;
      if (c->ptr + c->size > lo && c->in_use()) cost += c->size;
    }
    return cost;
  };
  arena_->ForEachRegion([&](BfcArena::ChunkHandle region_first) {
    BfcArena::ChunkHandle h = region_first;
    while (h != BfcArena::kInvalidChunk) {
      // Skip chunks that cannot leave; then measure the gap.
      while (h != BfcArena::kInvalidChunk && !may_leave(*arena_->chunk(h))) {
        h = arena_->chunk(h)->next;
      }
      if (h == BfcArena::kInvalidChunk) break;
      const BfcArena::ChunkHandle first = h;
      const char* gap_lo = arena_->chunk(h)->ptr;
      size_t gap = 0;
      while (h != BfcArena::kInvalidChunk && may_leave(*arena_->chunk(h))) {
        gap += arena_->chunk(h)->size;
        h = arena_->chunk(h)->next;
      }
      if (gap < rounded || gap > best_gap) continue;
      const char* ends[2] = {gap_lo, gap_lo + gap - rounded};
      for (const char* lo : ends) {
        const size_t cost = cost_of(first, lo);
        if (gap < best_gap || cost < best_cost) {
          best_gap = gap;
          best_cost = cost;
          plan.lo = lo;
        }
      }
    }
  });
  if (plan.lo == nullptr) return plan;
  // Collect victims overlapping the range: walk from the region start.
  arena_->ForEachInUseIn(plan.lo, plan.lo + rounded,
                         [&](const BfcArena::Chunk& c) {
                           plan.victims.push_back(
                               static_cast<Buffer*>(c.owner));
                         });
  return plan;
}

Engine::Impl::ClusterPlan Engine::Impl::AllocationClusterPlan(
    size_t rounded) {
  if (!UnderPlacementPressure(rounded) ||
      arena_->bytes_in_use() + rounded > lms_limit_) {
    return {};
  }
  ClusterPlan plan = PlanClusterPlacement(rounded);
  // Paging out for placement alone, while a free chunk may fit, costs
  // swap (ResNet50 at batch 796: step 3.3 s -> 11.4 s when done for every
  // large request): only for requests of a quarter of the device or more,
  // which a misplaced neighbour can leave with no room at all.
  if (!plan.victims.empty() && !WorthPagingOutToPlace(rounded)) return {};
  return plan;
}

BfcArena::ChunkHandle Engine::Impl::TakeClusterRange(const ClusterPlan& plan,
                                                     size_t rounded,
                                                     size_t bytes,
                                                     Buffer* owner) {
  if (plan.lo == nullptr) return BfcArena::kInvalidChunk;
  return arena_->TakeFreeRange(plan.lo, rounded, bytes, owner);
}

bool Engine::Impl::RelocateStrandedLocked(std::unique_lock<std::mutex>& lock,
                                          Buffer* b) {
  // An early page-out in flight leaves too, its chunk free once the copy is
  // settled, when the learned step is about to allocate a quarter of the
  // device or more. Counting it as a wall hid the stranding of InceptionV3's
  // AddN input at batch 896 (a few 0.5 MB activations on their way out
  // between it and a 4.87 GB hole), and the AddN's 4.96 GB output then found
  // no room. Settling them costs the host a wait for their copies, which
  // is worth it only then: done for every stranded buffer, it made UNet3D
  // 272^3 on the DGX-1 step 24% slower.
  // Cleared once they are settled: one started later (the lock is released
  // below) is a wall again, since PageOut takes resident victims only.
  const size_t due = LargestAllocationDueLocked(kDuePins);
  bool count_in_flight = WorthPagingOutToPlace(due);
  bool leaving_in_flight = false;
  // Set when b would move only to make room for the due allocation: the
  // buffers the step pins before it stay too.
  bool due_pins_stay = false;
  auto may_leave = [&](const BfcArena::Chunk& c) {
    if (!c.in_use() || c.owner == b) return true;
    const Buffer* o = static_cast<const Buffer*>(c.owner);
    if (due_pins_stay && o != nullptr && PinDueLocked(o, kDuePins)) {
      return false;
    }
    if (count_in_flight && o != nullptr && o->early_out) {
      leaving_in_flight = true;
      return true;
    }
    return Reclaimable(o);
  };
  auto plan_move = [&](const char** dest) {
    const BfcArena::Chunk* own = arena_->chunk(b->chunk);
    const size_t size = own->size;
    const char* gap_lo = own->ptr;
    for (BfcArena::ChunkHandle h = own->prev; h != BfcArena::kInvalidChunk &&
                                              may_leave(*arena_->chunk(h));
         h = arena_->chunk(h)->prev) {
      gap_lo = arena_->chunk(h)->ptr;
    }
    const char* gap_hi = own->ptr + size;
    for (BfcArena::ChunkHandle h = own->next; h != BfcArena::kInvalidChunk &&
                                              may_leave(*arena_->chunk(h));
         h = arena_->chunk(h)->next) {
      gap_hi = arena_->chunk(h)->ptr + arena_->chunk(h)->size;
    }
    const size_t below = static_cast<size_t>(own->ptr - gap_lo);
    const size_t above = static_cast<size_t>(gap_hi - (own->ptr + size));
    const size_t threshold = options_.memory_limit / kClusterDivisor;
    if (below < threshold || above < threshold) return false;
    // An end the buffer does not overlap (a move copies between disjoint
    // ranges); the nearer one when both qualify.
    const bool low_ok = below >= size, high_ok = above >= size;
    if (!low_ok && !high_ok) return false;
    *dest = (low_ok && (!high_ok || below <= above)) ? gap_lo : gap_hi - size;
    return true;
  };
  // Paging others out to make a destination costs a host round trip per
  // victim (ResNet50 at batch 796: step 3.3 s -> 11.4 s when any large
  // buffer could), and even a move to free memory first waits for the
  // compute stream to pass every last use (3.27 s -> 3.56 s at batch 796):
  // only buffers of a quarter of the device or more, which a stranded
  // neighbour can leave with no room at all, are moved (ResNet50 on the
  // AC922 reaches batch 1497 with or without the smaller moves).
  // A smaller buffer moves only when, pinned where it is beside the other
  // buffers the step pins before it, it would leave the learned step's
  // coming allocation of a quarter of the device or more no gap to go to:
  // UNet3D 400^3 on the A100-40 pinned its concat's two 8.2 GB inputs
  // 8.6 GiB apart, in the middle of 40 GiB, and the 16.4 GB output found no
  // room in the third step with prefetch.
  // Paging on demand, a buffer under a quarter of the device moves
  // when, pinned where it is, it would leave no gap as large as itself: an
  // op's output is often the size of its largest input. ResNet152 at batch
  // 1337 on the AC922 with twice the host pinned two 4.29 GB inputs, each
  // 1.5 MB under the quarter, in the middle of gaps of 3.7 and 3.9 GiB, and
  // its 4.29 GB output found no room with 8.6 GB free, while 1322 and 1352
  // fit. Such a buffer overlaps both ends of its own gap, so it cannot move
  // device to device: it goes to the host and comes back next to what
  // cannot leave (RoundTripStrandedLocked).
  // While a learned plan is followed, the step says what must fit while b
  // is pinned: the allocations and the page-ins of its next kDuePins pins.
  // A buffer of a quarter of the device or more then moves only when,
  // pinned where it is beside the buffers those pins find on the device,
  // it would leave no gap for the largest of those allocations and the
  // buffers that come back for them. Moving every such buffer found
  // mid-gap paged out what lay at its destination and waited for the GPU's
  // last uses at nearly every large pin: ResNet50 at batch 1342 on the
  // AC922, where nearly every op pages out, stepped 10.37 s with prefetch
  // against 9.84 s on demand, and 7.90 s with moves only where the step
  // needs them.
  // (A smaller buffer is judged by the coming allocation alone.)
  const size_t own_size = arena_->chunk(b->chunk)->size;
  const bool large = WorthPagingOutToPlace(own_size);
  bool stranded_by_own_size = false;
  // count_in_flight implies a plan: only a plan makes an allocation due.
  if (large ? FollowingPlan() : count_in_flight) {
    due_pins_stay = true;
    size_t need = BfcArena::RoundedBytes(due);
    if (large) need += BytesDueBackLocked(b, kDuePins);
    if (LargestGapBesideLocked(b, may_leave) >= need) return false;
    leaving_in_flight = false;  // only those in b's own gap need settling
  } else if (!large) {
    // While a learned plan is followed, prefetched buffers due soon hem
    // most buffers in; moving them all made ResNet152 at batch 564 on
    // the AC922 step 75% slower (2195 round trips a step).
    if (FollowingPlan() || LargestGapBesideLocked(b, may_leave) >= own_size) {
      return false;
    }
    stranded_by_own_size = true;
  }
  const char* dest = nullptr;
  if (!plan_move(&dest)) {
    return stranded_by_own_size && RoundTripStrandedLocked(lock, b);
  }
  if (leaving_in_flight) {
    // The destination counts on chunks whose copies out may still run.
    SettleEarlyPageOutsLocked(lock, early_outs_.size());
    count_in_flight = false;
    if (b->state != BufferState::kResident || b->pin_count > 0) return false;
  }
  // Movable() needs the buffer's last use proven complete.
  if (!SyncLastUses(lock).ok()) return false;
  if (b->state != BufferState::kResident || b->pin_count > 0 ||
      !plan_move(&dest)) {
    return false;
  }
  const size_t size = arena_->chunk(b->chunk)->size;
  std::vector<Buffer*> victims;
  arena_->ForEachInUseIn(dest, dest + size, [&](const BfcArena::Chunk& c) {
    victims.push_back(static_cast<Buffer*>(c.owner));
  });
  if (!victims.empty()) {
    size_t reclaimed = 0;
    Status s = PageOut(lock, victims, &reclaimed);
    if (reclaimed == 0 || !s.ok()) return false;
    ++counters_.num_fragment_reclaims;
  }
  if (b->state != BufferState::kResident || b->pin_count > 0 || !Movable(b)) {
    return false;
  }
  BfcArena::ChunkHandle dst = arena_->TakeFreeRange(dest, size, b->size, b);
  if (dst == BfcArena::kInvalidChunk) return false;
  size_t moved = 0;
  Status s = MoveBuffers(lock, {{b, dst}}, &moved);
  return s.ok() && moved > 0;
}

bool Engine::Impl::RoundTripStrandedLocked(std::unique_lock<std::mutex>& lock,
                                           Buffer* b) {
  // Best effort, as the gather is: whatever fails leaves b on the host, and
  // its pin pages it in as any other page-in.
  const size_t rounded = arena_->chunk(b->chunk)->size;
  size_t out = 0;
  if (!PageOut(lock, {b}, &out).ok() || out == 0) return false;
  if (b->state != BufferState::kReclaimed || b->free_requested) return false;
  ClusterPlan plan = PlanClusterPlacement(rounded);
  if (plan.lo == nullptr) return false;
  if (!plan.victims.empty()) {
    size_t reclaimed = 0;
    if (!PageOut(lock, plan.victims, &reclaimed).ok() || reclaimed == 0) {
      return false;
    }
  }
  // Another thread may have paged it in, pinned or freed it meanwhile.
  if (b->state != BufferState::kReclaimed || b->free_requested) return false;
  BfcArena::ChunkHandle h = TakeClusterRange(plan, rounded, b->size, b);
  if (h == BfcArena::kInvalidChunk) return false;
  ++counters_.num_stranded_round_trips;
  if (!PageIn(lock, b, /*for_prefetch=*/false, 0, false, h).ok()) return false;
  // The pin that follows finds it resident, yet its kernel waits for this
  // copy as for any page-in at a pin.
  CountPageInAtPinLocked(b);
  return true;
}

}  // namespace tflms
