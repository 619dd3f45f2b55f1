// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Windows of adjacent chunks that could hold a request once emptied.
//
// Both the fragments reclaim (reclaim.cc: empty the window by paging its
// buffers out) and defragmentation (defrag.cc: empty it by moving them) look
// for the same thing: a run of adjacent chunks of one region, each free or
// owned by a buffer that may leave, whose sizes add up to the request. For
// every right end the scan reports the shortest such run (the left end
// advanced as far as the request allows) with its cost, the bytes of the
// in-use chunks in it. Runs that are already wholly free are not reported:
// the best-fit search would have found them.
#ifndef TFLMS_CORE_SRC_WINDOW_SCAN_H_
#define TFLMS_CORE_SRC_WINDOW_SCAN_H_

#include "bfc_arena.h"

namespace tflms {

// `may_leave(const Chunk&)` says whether an in-use chunk may be emptied;
// `visit(first, last, cost)` is called per window. Runs under the lock that
// guards `arena`.
template <typename MayLeave, typename Visit>
void ScanWindows(const BfcArena& arena, size_t rounded, MayLeave may_leave,
                 Visit visit) {
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
      total += rc->size;
      if (rc->in_use()) cost += rc->size;
      while (left != right) {
        const BfcArena::Chunk* lc = arena.chunk(left);
        if (total - lc->size < rounded) break;
        total -= lc->size;
        if (lc->in_use()) cost -= lc->size;
        left = lc->next;
      }
      if (total >= rounded && cost > 0) visit(left, right, cost);
    }
  });
}

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_WINDOW_SCAN_H_
