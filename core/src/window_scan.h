// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Windows of adjacent chunks that could hold a request once emptied, or
// once their free bytes are gathered.
//
// Both the fragments reclaim (reclaim.cc: empty the window by paging its
// buffers out) and defragmentation (defrag.cc: empty it by moving them) look
// for the same thing: a run of adjacent chunks of one region, each free or
// owned by a buffer that may leave, whose sizes add up to the request. For
// every right end the scan reports the shortest such run (the left end
// advanced as far as the request allows) with its cost, the bytes of the
// in-use chunks in it. Runs that are already wholly free are not reported:
// the best-fit search would have found them. Sliding (defrag.cc, SlideFor)
// gathers a run's free bytes instead of emptying the run, so it measures a
// run by its free chunks alone (ScanFreeRuns); the scan is otherwise the same.
#ifndef TFLMS_CORE_SRC_WINDOW_SCAN_H_
#define TFLMS_CORE_SRC_WINDOW_SCAN_H_

#include "bfc_arena.h"

namespace tflms {

// `may_leave(const Chunk&)` says whether an in-use chunk may be emptied;
// `visit(first, last, cost)` is called per window. With kFreeOnly only free
// chunks count toward `rounded`. Runs under the lock that guards `arena`.
template <bool kFreeOnly, typename MayLeave, typename Visit>
void ScanRuns(const BfcArena& arena, size_t rounded, MayLeave may_leave,
              Visit visit) {
  auto counted = [](const BfcArena::Chunk& c) {
    return kFreeOnly && c.in_use() ? 0 : c.size;
  };
  arena.ForEachRegion([&](BfcArena::ChunkHandle first) {
    BfcArena::ChunkHandle left = first;
    size_t total = 0, cost = 0;
    for (BfcArena::ChunkHandle right = first; right != BfcArena::kInvalidChunk;
         right = arena.chunk(right)->next) {
      const BfcArena::Chunk* rc = arena.chunk(right);
      if (rc->in_use() && !may_leave(*rc)) {
        left = rc->next;
        total = cost = 0;
        continue;
      }
      total += counted(*rc);
      if (rc->in_use()) cost += rc->size;
      while (left != right) {
        const BfcArena::Chunk* lc = arena.chunk(left);
        if (total - counted(*lc) < rounded) break;
        total -= counted(*lc);
        if (lc->in_use()) cost -= lc->size;
        left = lc->next;
      }
      if (total >= rounded && cost > 0) visit(left, right, cost);
    }
  });
}

// Runs whose chunks add up to `rounded`: to be emptied.
template <typename MayLeave, typename Visit>
void ScanWindows(const BfcArena& arena, size_t rounded, MayLeave may_leave,
                 Visit visit) {
  ScanRuns<false>(arena, rounded, may_leave, visit);
}

// Runs whose free chunks add up to `rounded`: to be slid together.
template <typename MayLeave, typename Visit>
void ScanFreeRuns(const BfcArena& arena, size_t rounded, MayLeave may_leave,
                  Visit visit) {
  ScanRuns<true>(arena, rounded, may_leave, visit);
}

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_WINDOW_SCAN_H_
