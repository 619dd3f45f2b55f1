// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Defragmentation: move inactive buffers within the device so free space
// coalesces.
//
// TFLMS shipped defragmentation for TF 2.1 and removed it in 2.2 because it
// moved tensors whose old addresses queued kernels could still read. Here a
// buffer is moved only when all of these hold, checked under mu_:
//   * it is resident, unpinned and not unmovable (no address escaped);
//   * its last use and the copy that filled it are proven complete by their
//     events (EventDone), so no queued kernel references the old address.
//     Unpins stamp last-use epochs rather than record events (engine_impl.h),
//     so both entry points first close the open epoch and wait for an event
//     after it (SyncLastUses, mu_ released): the moves drain the compute
//     stream anyway, and every unpinned buffer is then provably idle;
//   * nothing can pin it while it moves: its state is kMoving and Pin waits.
// The copy itself runs on the compute stream (ordered after everything
// enqueued) with mu_ released; the source chunk is freed only after the
// copy's event has been synchronized without error, and, with verify_moves,
// after source and destination compare equal. A failed move leaves the
// buffer at its old address, intact.
//
// Three entry points:
//   DefragFor   opens a gap for one request: the window of adjacent free and
//               movable chunks holding it with the fewest bytes to move,
//               whose movable buffers all find destinations outside it.
//   SlideFor    the last resort before an out-of-memory error once the host
//               pool is full (engine.cc): where no buffer finds a
//               destination elsewhere (free bytes enough, but every hole
//               smaller than the buffers around it), the movable buffers of
//               the run whose free chunks add up to the request, with the
//               fewest bytes to move, slide down into the free chunk below
//               each, so the run's free bytes gather at its top.
//   Defragment  explicit compaction: moves buffers from high addresses to the
//               lowest free chunk below them.
// SlideFor also runs before a single reclaim whose victim the learned step
// pins again within a few pins (SlideRatherThanReclaimLocked), after paging
// out smaller buffers due later where a slide alone cannot make the room
// (TopUpAndSlideLocked; the choice is reclaim.cc's ChooseTopUpVictims).
// A slide's source and destination overlap, so it copies in pieces no
// longer than the distance moved, in order on one stream: each piece's
// destination was the source of the piece before, already copied. The free
// chunk below is held (in use, owned by the buffer) while the copy runs, and
// the pair is re-split only after the copy's event was synchronized
// (BfcArena::SlideDown). Unlike a move, a slide cannot be undone: a copy that
// fails after its first piece leaves the buffer's bytes partly overwritten,
// and the error is returned. Only a device fault fails a device-to-device
// copy, and on a CUDA device that fault is sticky, so no tensor would be read
// again either way.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "engine_impl.h"
#include "window_scan.h"

namespace tflms {
namespace {

// Windows tried per request before giving up (each costs a scan of bins).
constexpr int kMaxWindowsTried = 16;
// Buffers moved per compaction pass.
constexpr size_t kMaxMovesPerPass = 256;
// Compaction passes per Defragment() call.
constexpr int kMaxCompactionPasses = 8;
// Buffers slid per SlideFor call.
constexpr int kMaxSlides = 256;

// Unfragmented (EngineOptions::unfragmented), a free chunk holds any request
// whose bytes are free, and a move would take its destination's bytes
// before freeing its source's, past the LMS limit that holds the device
// there: nothing moves.
Status NothingToUndo() {
  return ResourceExhausted("unfragmented: no fragmentation to undo");
}

}  // namespace

bool Engine::Impl::Movable(const Buffer* b) const {
  if (b == nullptr || b->state != BufferState::kResident || b->pin_count > 0 ||
      b->unmovable || b->free_requested) {
    return false;
  }
  if (!LastUseDoneLocked(b->last_use_epoch)) return false;
  if (b->ready && !device_->EventDone(b->ready)) return false;
  return true;
}

Status Engine::Impl::MoveBuffers(
    std::unique_lock<std::mutex>& lock,
    const std::vector<std::pair<Buffer*, BfcArena::ChunkHandle>>& moves,
    size_t* moved) {
  *moved = 0;
  if (moves.empty()) return Status::Ok();
  struct Move {
    Buffer* buffer;
    BfcArena::ChunkHandle dst;
    char* src_ptr;
    char* dst_ptr;
    size_t size;
  };
  std::vector<Move> plan;
  plan.reserve(moves.size());
  for (const auto& m : moves) {
    Buffer* b = m.first;
    b->state = BufferState::kMoving;  // stays on the LRU, at its age
    ++transitions_in_flight_;
    AddChunkBytes(b, static_cast<int64_t>(arena_->chunk(m.second)->size));
    plan.push_back(
        {b, m.second, b->device_ptr, arena_->chunk(m.second)->ptr, b->size});
  }
  lock.unlock();

  Stream* compute = device_->GetStream(StreamKind::kCompute);
  Status status;
  for (const Move& m : plan) {
    status = device_->CopyDeviceToDevice(compute, m.dst_ptr, m.src_ptr, m.size);
    if (!status.ok()) break;
  }
  if (status.ok()) {
    EventRef done = device_->RecordEvent(compute, &status);
    if (done) status = device_->SynchronizeEvent(done);
  }
  if (status.ok() && options_.verify_moves) {
    std::string a, b;
    for (const Move& m : plan) {
      a.resize(m.size);
      b.resize(m.size);
      status = device_->ReadDeviceSync(&a[0], m.src_ptr, m.size);
      if (status.ok()) status = device_->ReadDeviceSync(&b[0], m.dst_ptr, m.size);
      if (status.ok() && a != b) {
        status = Internal("defragmentation verification failed: a moved "
                          "buffer differs from its source; nothing was freed");
      }
      if (!status.ok()) break;
    }
  }

  lock.lock();
  transitions_in_flight_ -= static_cast<int>(plan.size());
  for (const Move& m : plan) {
    Buffer* b = m.buffer;
    BfcArena::ChunkHandle drop = status.ok() ? b->chunk : m.dst;
    AddChunkBytes(b, -static_cast<int64_t>(arena_->chunk(drop)->size));
    arena_->FreeChunk(drop, ReuseAfterNowLocked());  // moves ran on compute
    if (status.ok()) {
      NoteMovedLocked(b, m.dst);
      *moved += m.size;
    }
    EndMoveLocked(b);
  }
  if (*moved > 0) ++counters_.num_defragmentations;
  cv_.notify_all();
  return status;
}

Status Engine::Impl::DefragFor(std::unique_lock<std::mutex>& lock,
                               size_t rounded, size_t* moved) {
  *moved = 0;
  if (options_.unfragmented) return NothingToUndo();
  TFLMS_RETURN_IF_ERROR(SyncLastUses(lock));
  struct Window {
    size_t cost;
    BfcArena::ChunkHandle first, last;
  };
  std::vector<Window> windows;
  ScanWindows(
      *arena_, rounded,
      [&](const BfcArena::Chunk& c) {
        return Movable(static_cast<const Buffer*>(c.owner));
      },
      [&](BfcArena::ChunkHandle first, BfcArena::ChunkHandle last,
          size_t cost) { windows.push_back({cost, first, last}); });
  std::sort(windows.begin(), windows.end(),
            [](const Window& a, const Window& b) { return a.cost < b.cost; });
  if (windows.size() > kMaxWindowsTried) windows.resize(kMaxWindowsTried);

  for (const Window& w : windows) {
    const BfcArena::Chunk* fc = arena_->chunk(w.first);
    const BfcArena::Chunk* lc = arena_->chunk(w.last);
    const char* lo = fc->ptr;
    const char* hi = lc->ptr + lc->size;
    std::vector<Buffer*> movers;
    for (BfcArena::ChunkHandle h = w.first;; h = arena_->chunk(h)->next) {
      if (arena_->chunk(h)->in_use()) {
        movers.push_back(static_cast<Buffer*>(arena_->chunk(h)->owner));
      }
      if (h == w.last) break;
    }
    // Largest first: they are the hardest to place.
    std::sort(movers.begin(), movers.end(), [&](Buffer* a, Buffer* b) {
      return arena_->chunk(a->chunk)->size > arena_->chunk(b->chunk)->size;
    });
    std::vector<std::pair<Buffer*, BfcArena::ChunkHandle>> moves;
    bool placed_all = true;
    for (Buffer* b : movers) {
      const size_t size = arena_->chunk(b->chunk)->size;
      BfcArena::ChunkHandle dst = arena_->FindFreeChunkOutside(size, lo, hi);
      if (dst == BfcArena::kInvalidChunk) {
        placed_all = false;
        break;
      }
      moves.emplace_back(b, arena_->TakeFreeChunk(dst, size, b->size, b));
    }
    if (!placed_all) {
      if (moves.empty()) continue;
      // Releasing the reserved destinations coalesces free chunks, which can
      // retire handles the remaining windows name: stop here.
      for (auto& m : moves) {
        arena_->FreeChunk(m.second, kReusableAtOnce);  // never written
      }
      break;
    }
    return MoveBuffers(lock, moves, moved);
  }
  return ResourceExhausted("no window can be defragmented");
}

Status Engine::Impl::SlideFor(std::unique_lock<std::mutex>& lock,
                              size_t rounded, size_t* moved) {
  *moved = 0;
  if (options_.unfragmented) return NothingToUndo();
  TFLMS_RETURN_IF_ERROR(SyncLastUses(lock));
  // The run whose free bytes reach `rounded` with the fewest bytes to move.
  const char* lo = nullptr;
  const char* hi = nullptr;
  size_t best_cost = std::numeric_limits<size_t>::max();
  ScanFreeRuns(
      *arena_, rounded,
      [&](const BfcArena::Chunk& c) {
        return Movable(static_cast<const Buffer*>(c.owner));
      },
      [&](BfcArena::ChunkHandle first, BfcArena::ChunkHandle last,
          size_t cost) {
        if (cost >= best_cost) return;
        best_cost = cost;
        lo = arena_->chunk(first)->ptr;
        hi = arena_->chunk(last)->ptr + arena_->chunk(last)->size;
      });
  if (lo == nullptr) return ResourceExhausted("no run of chunks can slide");
  // Walk up from the run's first (free) chunk. Each slide releases mu_, so
  // the walk goes by address, never by a chunk or buffer seen before it.
  const char* pos = lo;
  for (int i = 0; i < kMaxSlides && arena_->LargestFreeChunk() < rounded;
       ++i) {
    BfcArena::ChunkHandle h = arena_->HandleFor(pos);
    if (h == BfcArena::kInvalidChunk) break;
    const BfcArena::Chunk* c = arena_->chunk(h);
    const BfcArena::ChunkHandle up = c->next;
    if (c->in_use() || up == BfcArena::kInvalidChunk ||
        arena_->chunk(up)->ptr >= hi) {
      if (c->in_use()) {  // taken meanwhile: go on above it
        pos = c->ptr + c->size;
        continue;
      }
      break;
    }
    const BfcArena::Chunk* uc = arena_->chunk(up);
    Buffer* b = static_cast<Buffer*>(uc->owner);
    const size_t size = uc->size;
    if (!Movable(b) || c->size < size / kMaxSlidePieces) {
      pos = uc->ptr + size;  // stays: the free chunk below it stays too
      continue;
    }
    TFLMS_RETURN_IF_ERROR(SlideDownLocked(lock, b, h));
    *moved += size;
    pos += size;
  }
  if (*moved > 0) ++counters_.num_defragmentations;
  return Status::Ok();
}

bool Engine::Impl::ReclaimVictimDueSoon(const std::vector<Buffer*>& victim,
                                        size_t rounded,
                                        size_t* next_use) const {
  // The single reclaim would page out a buffer the step pins again within a
  // few pins: a round trip over the host link for nothing but the layout.
  // The 3D U-Net at 304^3 on a V100 paged out four 3.6-7.2 GB tensors a
  // step that way, each needed again 0 to 9 pins later. Where the victim
  // comes back later the page-out is worth its copy (the plan would evict
  // it anyway): sliding for any victim made ResNet50 at 1880 on a 40 GB
  // A100 7.4% slower. And only for a victim of a fifth of the device or
  // more: from a sixth, InceptionV3 at its largest batch on a V100 (673)
  // ran out of memory in its 6th step, its MaxPoolGrad's inputs left apart
  // by earlier slides.
  if (victim.empty() || !FollowingLearnedOrder()) return false;
  const size_t victim_bytes = arena_->chunk(victim[0]->chunk)->size;
  if (victim_bytes < rounded ||
      victim_bytes < options_.memory_limit / kSlideRatherThanReclaimDivisor) {
    return false;
  }
  *next_use = NextUse(victim[0]);
  return *next_use != SIZE_MAX &&
         *next_use <= LearnedCursor() + kSlideRatherThanReclaimPins;
}

bool Engine::Impl::SlideRatherThanReclaimLocked(
    std::unique_lock<std::mutex>& lock, size_t rounded,
    const std::vector<Buffer*>& victim) {
  // The bytes are free but in holes too small (two of the U-Net's victims
  // above with 4.5 GB free in holes of 1.8 and 3.2 GB): sliding the run
  // between them down moves bytes at device speed instead.
  size_t next = 0;
  if (arena_->bytes_in_use() + rounded > lms_limit_ ||
      !ReclaimVictimDueSoon(victim, rounded, &next)) {
    return false;
  }
  size_t moved = 0;
  (void)SlideFor(lock, rounded, &moved);  // "no run": the ladder goes on
  return true;
}

bool Engine::Impl::TopUpAndSlideLocked(std::unique_lock<std::mutex>& lock,
                                       size_t rounded,
                                       const std::vector<Buffer*>& victim) {
  // Where a slide alone cannot make the room (too few bytes free, or the
  // run broken by a buffer that cannot move yet), paging out something
  // smaller that the step needs later than the victim, and sliding, often
  // can: the U-Net at 304^3 on a V100 paged out a 3.6 GB tensor needed by
  // the very next kernel with 2.8 GB free, where two 0.9 GB ones needed 13
  // and 61 pins later (prefetched, still landing, so splitting the run)
  // and a 3.6 GB slide made the room.
  size_t next = 0;
  if (!ReclaimVictimDueSoon(victim, rounded, &next)) return false;
  const size_t victim_bytes = arena_->chunk(victim[0]->chunk)->size;
  // Movable() counts only last uses the host has seen completed. From here
  // on mu_ may have been released: the victim is not looked at again.
  if (!SyncLastUses(lock).ok()) return true;
  size_t cost = 0;
  std::vector<Buffer*> leaving = ChooseTopUpVictims(rounded, next, &cost);
  // Only cheaper than the victim: the same bytes due later would be
  // Belady's choice, but the slide and the layout it leaves are not free.
  if (leaving.empty() || cost >= victim_bytes) return true;
  size_t out = 0;
  if (!PageOut(lock, leaving, &out).ok() || out == 0) return true;
  ++counters_.num_fragment_reclaims;
  size_t moved = 0;
  (void)SlideFor(lock, rounded, &moved);
  return true;
}

Status Engine::Impl::SlideDownLocked(std::unique_lock<std::mutex>& lock,
                                     Buffer* b, BfcArena::ChunkHandle below) {
  const size_t gap = arena_->chunk(below)->size;
  // Held while the copy runs, so that nothing is placed where it writes.
  const BfcArena::ChunkHandle held =
      arena_->TakeFreeChunk(below, gap, gap, b);
  AddChunkBytes(b, static_cast<int64_t>(gap));
  char* const dst = arena_->chunk(held)->ptr;
  const char* const src = b->device_ptr;
  const size_t bytes = b->size;
  b->state = BufferState::kMoving;  // Pin waits; stays on the LRU
  ++transitions_in_flight_;
  lock.unlock();

  Stream* compute = device_->GetStream(StreamKind::kCompute);
  Status status;
  std::string before;
  if (options_.verify_moves) {
    before.resize(bytes);
    status = device_->ReadDeviceSync(&before[0], src, bytes);
  }
  bool written = false;
  for (size_t off = 0; status.ok() && off < bytes; off += gap) {
    status = device_->CopyDeviceToDevice(compute, dst + off, src + off,
                                         std::min(gap, bytes - off));
    written = written || status.ok();
  }
  if (status.ok()) {
    EventRef done = device_->RecordEvent(compute, &status);
    if (done) status = device_->SynchronizeEvent(done);
  }
  if (status.ok() && options_.verify_moves) {
    std::string after(bytes, '\0');
    status = device_->ReadDeviceSync(&after[0], dst, bytes);
    if (status.ok() && after != before) {
      status = Internal("defragmentation verification failed: a buffer "
                        "slid within the device differs from its bytes "
                        "before the slide");
    }
  }

  lock.lock();
  --transitions_in_flight_;
  if (status.ok()) {
    const BfcArena::ChunkHandle old = b->chunk;
    arena_->SlideDown(held, old);  // `old` now names the bytes left behind
    NoteMovedLocked(b, held);
    AddChunkBytes(b, -static_cast<int64_t>(gap));
    arena_->FreeChunk(old, ReuseAfterNowLocked());  // copies ran on compute
  } else {
    AddChunkBytes(b, -static_cast<int64_t>(gap));
    arena_->FreeChunk(held, ReuseAfterNowLocked());
    if (written) {
      status = Internal("sliding a buffer within the device failed after "
                        "part of it was copied, so its bytes are lost: " +
                        status.ToString());
    }
  }
  EndMoveLocked(b);
  cv_.notify_all();
  return status;
}

void Engine::Impl::NoteMovedLocked(Buffer* b, BfcArena::ChunkHandle chunk) {
  b->chunk = chunk;
  b->device_ptr = arena_->chunk(chunk)->ptr;
  b->last_use_epoch = 0;  // the new address has never been used
  b->ready.reset();
  counters_.bytes_defragged += static_cast<int64_t>(b->size);
}

void Engine::Impl::EndMoveLocked(Buffer* b) {
  b->state = BufferState::kResident;
  if (b->free_requested) DestroyBufferLocked(b);
}

Status Engine::Impl::Defragment(size_t* bytes_moved) {
  *bytes_moved = 0;
  // Fixed-address mode: nothing may move, and there is no physical
  // fragmentation to undo (any page backs any address); nor is there
  // unfragmented.
  if (fixed_ || options_.unfragmented) return Status::Ok();
  std::unique_lock<std::mutex> lock(mu_);
  TFLMS_RETURN_IF_ERROR(SyncLastUses(lock));
  for (int pass = 0; pass < kMaxCompactionPasses; ++pass) {
    // Movable buffers, highest address first.
    std::vector<Buffer*> candidates;
    ForEachBuffer([&](Buffer* b) {
      if (Movable(b)) candidates.push_back(b);
    });
    std::sort(candidates.begin(), candidates.end(),
              [](Buffer* a, Buffer* b) { return a->device_ptr > b->device_ptr; });
    std::vector<std::pair<Buffer*, BfcArena::ChunkHandle>> moves;
    for (Buffer* b : candidates) {
      if (moves.size() >= kMaxMovesPerPass) break;
      const size_t size = arena_->chunk(b->chunk)->size;
      BfcArena::ChunkHandle dst =
          arena_->FindLowestFreeChunkBelow(size, b->device_ptr);
      if (dst == BfcArena::kInvalidChunk) continue;
      moves.emplace_back(b, arena_->TakeFreeChunk(dst, size, b->size, b));
    }
    if (moves.empty()) break;
    size_t moved = 0;
    Status s = MoveBuffers(lock, moves, &moved);
    *bytes_moved += moved;
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace tflms
