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
// Two entry points:
//   DefragFor   opens a gap for one request: the window of adjacent free and
//               movable chunks holding it with the fewest bytes to move,
//               whose movable buffers all find destinations outside it.
//   Defragment  explicit compaction: moves buffers from high addresses to the
//               lowest free chunk below them.
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
      b->chunk = m.dst;
      b->device_ptr = m.dst_ptr;
      b->last_use_epoch = 0;  // the new address has never been used
      b->ready.reset();
      counters_.bytes_defragged += static_cast<int64_t>(m.size);
      *moved += m.size;
    }
    b->state = BufferState::kResident;
    if (b->free_requested) DestroyBufferLocked(b);
  }
  if (*moved > 0) ++counters_.num_defragmentations;
  cv_.notify_all();
  return status;
}

Status Engine::Impl::DefragFor(std::unique_lock<std::mutex>& lock,
                               size_t rounded, size_t* moved) {
  *moved = 0;
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

Status Engine::Impl::Defragment(size_t* bytes_moved) {
  *bytes_moved = 0;
  // Fixed-address mode: nothing may move, and there is no physical
  // fragmentation to undo (any page backs any address).
  if (fixed_) return Status::Ok();
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
