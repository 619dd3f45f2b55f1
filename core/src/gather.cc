// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Gathering a group: the buffers one kernel is about to pin together.
//
// A small tensor made while the device is full lands where a victim was paged
// out, or in a sliver between large inactive buffers, and stays there when
// those leave. A kernel that pins many such tensors at once and then allocates
// an output about as large as all of them (TensorListStack over a loop's
// accumulator) can find the device nearly free and no gap for it: tf.scan's
// TensorListStack under tflms.tfcpu pinned 256 elements of 512 B lying 33 KiB
// apart and found 2.28 MB of 2.42 MB free, the largest gap 124 KiB, for its
// 128 KiB output. Once pinned nothing may move them, and on demand the engine
// cannot know that such an allocation follows. The TensorFlow side knows the
// group (it pins a list's or an array's elements together) and names it first.
//
// If, pinned where they are, the group's resident members would leave no gap
// (free chunks and buffers that may be paged out) as large as the whole group,
// they leave for the host. Then every member on the host, those and any paged
// out before, comes back into one run: the tightest gap that holds them all
// next to what cannot leave (PlanClusterPlacement), its inactive occupants
// paged out first. Members on the host would otherwise come back one pin at a
// time into whatever sliver best fit finds, between inactive buffers that
// leave later. map_fn's groups needed this part: gathering resident members
// alone never triggered there (9 runs); with it, 2 or 3 gathers a run and no
// failure in 30 runs that had failed in 9 of 57 (sequential iterations). A
// group that lies together, with none of it on the host, costs one walk over
// the chunks and nothing else.
//
// A concat's inputs (or a stack's) are such a group however few they are:
// its output holds them all. UNet3D at 272^3 on a V100 paged a concat's 2.4
// GiB skip connection in by its pin into the one hole that held it, 1.2 GiB
// above the other 2.4 GiB input, and the 4.8 GiB output found no gap with 9.5
// GiB free. For such a group the members on the host are placed first, as
// the run would be (the resident members staying), and the gap left for the
// output is judged with them there: only if it is too small do the resident
// members leave too. Under pressure only, and not while a learned step is
// followed (prefetch pages the members in then, and due_group.cc places
// them knowing the output).
//
// Invariants: best effort, never an error for the kernel: a member that finds
// no place in the run stays on the host and its pin pages it in as any other
// page-in. Only unpinned resident members leave, through PageOut (a chunk is
// freed only once its host copy completed). mu_ is released during copies, so
// every member's state is looked at again before it is placed. With LMS off,
// in fixed-address mode (no physical fragmentation) or for small groups,
// nothing here runs.
#include <algorithm>
#include <optional>
#include <unordered_set>
#include <utility>

#include "engine_impl.h"

namespace tflms {
namespace {

// Groups smaller than memory_limit / this are "small" as placement.cc's
// cluster requests are: a misplaced one cannot strand much.
constexpr size_t kGroupDivisor = 64;

}  // namespace

void Engine::Impl::GatherForPins(Buffer* const* buffers, size_t n,
                                 GatherKind kind) {
  const bool concat = kind == GatherKind::kConcat;
  const size_t min_group = concat ? 2 : Engine::kMinGatherGroup;
  if (n < min_group) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (!options_.lms_enabled || fixed_) return;
  // With nothing on the host the device is not under pressure: best fit
  // places the output as TensorFlow's BFC would. While a learned step is
  // followed, prefetch pages the members in ahead of their pins and the due
  // group's placement knows the output (due_group.cc). Gathering then as
  // well cost DenseNet201 at batch 296 on the DGX-1 7.68 -> 8.99 s a step
  // (65 gathers a step); gathering only where the output would find no gap
  // ran UNet3D at 304^3 on the DGX-1 with prefetch, but ran its 384^3 on the
  // A100-40 out of memory in step 17 (the run's second member came back
  // apart), which paging by the plan alone runs.
  if (concat &&
      (counters_.current_bytes_reclaimed == 0 || FollowingPlan())) {
    return;
  }
  std::vector<Buffer*> group;
  std::unordered_set<const Buffer*> members;
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    Buffer* b = buffers[i];
    if (b == nullptr || b->free_requested || !members.insert(b).second) {
      continue;
    }
    group.push_back(b);
    total += BfcArena::RoundedBytes(b->size);
  }
  if (group.size() < min_group ||
      total < options_.memory_limit / kGroupDivisor) {
    return;
  }
  auto may_leave = [&](const BfcArena::Chunk& c) {
    if (!c.in_use()) return true;
    const Buffer* o = static_cast<const Buffer*>(c.owner);
    return members.count(o) == 0 && Reclaimable(o);
  };
  auto on_host = [&] {
    std::vector<Buffer*> back;
    for (Buffer* b : group) {
      if (b->state == BufferState::kReclaimed && !b->free_requested) {
        back.push_back(b);
      }
    }
    return back;
  };
  auto run_of = [](const std::vector<Buffer*>& back) {
    size_t run = 0;
    for (const Buffer* b : back) run += BfcArena::RoundedBytes(b->size);
    return run;
  };
  // The output needs a gap as large as the whole group once every member
  // is pinned. A concat's members on the host come back next to what cannot
  // leave (the resident members among it), and the gap is judged with them
  // there: a concat's two 2.4 GiB inputs, one paged in by best fit 1.2 GiB
  // above the other, left UNet3D at 272^3 on a V100 no gap for its 4.8 GiB
  // output with 9.5 GiB free. That plan stands if nothing leaves (mu_ is
  // held until it is used).
  std::optional<ClusterPlan> concat_plan;
  const size_t host_run = concat ? run_of(on_host()) : 0;
  bool leave = false;
  if (host_run == 0) {
    leave = LargestGapBesideLocked(nullptr, may_leave) < total;
  } else {
    concat_plan = PlanClusterPlacement(host_run, &members);
    leave = concat_plan->lo == nullptr ||
            LargestGapOutsideLocked(concat_plan->lo, host_run, may_leave) <
                total;
  }
  bool gathered = false;
  if (leave) {
    std::vector<Buffer*> leaving;
    for (Buffer* b : group) {
      if (Reclaimable(b) && !b->early_out) leaving.push_back(b);
    }
    size_t out = 0;
    if (leaving.empty() || !PageOut(lock, leaving, &out).ok() || out == 0) {
      return;
    }
    gathered = true;
  }

  // Every member on the host comes back into one run, in the group's order:
  // those just paged out, and those paged out before, which their pins would
  // otherwise page in one by one wherever best fit finds a sliver (between
  // inactive buffers that leave later), scattering the group again. A
  // concat's members come back beside the resident ones, even one alone.
  std::vector<Buffer*> back = on_host();
  const size_t run = run_of(back);
  const bool bring_back =
      back.size() >= (concat ? 1u : 2u) &&
      (gathered || run >= options_.memory_limit / kGroupDivisor);
  if (gathered || bring_back) ++counters_.num_group_gathers;
  if (!bring_back) return;
  ClusterPlan plan = concat_plan && !gathered
                         ? *std::move(concat_plan)
                         : PlanClusterPlacement(run, concat ? &members
                                                            : nullptr);
  if (plan.lo == nullptr) return;
  if (!plan.victims.empty()) {
    size_t reclaimed = 0;
    if (!PageOut(lock, plan.victims, &reclaimed).ok() || reclaimed == 0) {
      return;
    }
  }
  // The run is at one end of its free chunk, and a range can be taken only
  // at an end of a free chunk: members are placed from that end inwards.
  const BfcArena::ChunkHandle first = arena_->HandleFor(plan.lo);
  const bool upwards =
      first != BfcArena::kInvalidChunk && !arena_->chunk(first)->in_use();
  if (!upwards) std::reverse(back.begin(), back.end());
  const char* end = plan.lo + run;  // members below `end` are placed
  const char* at = plan.lo;         // members from `at` on are placed
  for (Buffer* b : back) {
    // Another thread may have paged it in, pinned or freed it meanwhile.
    if (b->state != BufferState::kReclaimed || b->free_requested) continue;
    const size_t rounded = BfcArena::RoundedBytes(b->size);
    if (arena_->bytes_in_use() + rounded > lms_limit_) return;
    const char* lo = upwards ? at : end - rounded;
    BfcArena::ChunkHandle h = arena_->TakeFreeRange(lo, rounded, b->size, b);
    // Taken by another thread while a copy ran: the rest come back on
    // their pins.
    if (h == BfcArena::kInvalidChunk) return;
    if (upwards) {
      at += rounded;
    } else {
      end -= rounded;
    }
    if (!PageIn(lock, b, /*for_prefetch=*/false, 0, false, h).ok()) return;
    counters_.bytes_group_gathered += static_cast<int64_t>(b->size);
    // The kernel about to pin the group waits for this copy.
    CountPageInAtPinLocked(b);
  }
}

}  // namespace tflms
