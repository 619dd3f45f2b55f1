// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Swap in place: a page-in for which neither memory has room, done by trading
// places with a victim through a staging piece of free device memory.
//
// At the peak of a model that fills the device and the host pool together, a
// tensor on the host can be due while the two memories together have less
// free than its size. UNet3D at 480^3 on an H100 (80 GB, TensorFlow's 128 GiB
// pool) keeps 217.8 GB live at its largest gradient ops, 2.2 GB less than the
// two hold, and with prefetch it found a 14.2 GB activation on the host
// there. Whole copies cannot bring it in: the victim needs host room that the
// page-in frees only once it has landed, and the page-in needs the device
// room that the victim frees only once it has left (exchange.cc cannot help
// either: 2.2 GB is all it could bring back). In pieces they can. For each
// piece, on the compute stream and in this order: the victim's bytes go to a
// staging chunk on the device, the incoming bytes take their place in the
// victim's chunk, and the staged bytes go to the host where the incoming
// piece was read from. The victim's host copy is then the incoming buffer's
// former host allocation, and the incoming buffer lives in the victim's
// former chunk. It costs what the two copies cost, with less overlap.
//
// Invariants: the victim's chunk holds the incoming buffer (rounded) and the
// incoming buffer's host allocation (rounded; it may be scattered over
// several pieces of the pool, host_pool.h) holds the victim. Every copy runs on the compute stream, after every kernel enqueued
// before it (the victim's last use among them, and any user of the staging
// chunk's bytes), and after the copy that filled the victim; the host waits
// for all of them before any state changes, so nothing else sees a
// half-swapped pair (both are in transient states, which Pin waits out). A
// copy that fails before the first incoming piece was written leaves both
// buffers as they were; one that fails after is a device fault that loses
// bytes, reported as a failed slide is (defrag.cc). Never in fixed-address
// mode, where any free page can back the incoming buffer.
#include <algorithm>
#include <string>

#include "engine_impl.h"

namespace tflms {

Status Engine::Impl::SwapInLocked(std::unique_lock<std::mutex>& lock,
                                  Buffer* x) {
  if (fixed_ || x->host_ptr == nullptr) {
    return ResourceExhausted("no swap in place");
  }
  const size_t need = BfcArena::RoundedBytes(x->size);

  // The victim: as the single reclaim orders them (reclaim.cc), among the
  // buffers whose chunk holds x and which x's host allocation holds.
  const bool learned = FollowingLearnedOrder();
  Buffer* v = nullptr;
  size_t v_next = 0;
  for (Buffer* b = lru_head_; b != nullptr; b = b->lru_next) {
    if (!Reclaimable(b) || b->clean_host != nullptr || b->size > need ||
        arena_->chunk(b->chunk)->size < need) {
      continue;
    }
    if (!learned) {
      v = b;
      break;
    }
    const size_t next = NextUse(b);
    if (v == nullptr || next > v_next) {
      v = b;
      v_next = next;
    }
  }
  if (v == nullptr) {
    return ResourceExhausted("no swap in place: no victim of that size");
  }
  // The staging chunk: the largest free one.
  BfcArena::ChunkHandle stage = BfcArena::kInvalidChunk;
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (!c->in_use() &&
          (stage == BfcArena::kInvalidChunk ||
           c->size > arena_->chunk(stage)->size)) {
        stage = h;
      }
    }
  });
  // Unfragmented, the largest free chunk may span more addresses than the
  // device has bytes free: the piece is what the bytes allow.
  const size_t piece =
      stage == BfcArena::kInvalidChunk
          ? 0
          : std::min(arena_->chunk(stage)->size,
                     DeviceBytesLeftLocked() / BfcArena::kMinAllocationSize *
                         BfcArena::kMinAllocationSize);
  const size_t longest = std::max(x->size, v->size);
  if (piece == 0 || piece < longest / kMaxSwapPieces) {
    return ResourceExhausted("no swap in place: no staging chunk");
  }

  // Held while the copies run, so that nothing is placed where they write.
  const BfcArena::ChunkHandle held = arena_->TakeFreeChunk(stage, piece, piece, x);
  AddChunkBytes(x, static_cast<int64_t>(piece));
  char* const staged = arena_->chunk(held)->ptr;
  const BfcArena::ChunkHandle vchunk = v->chunk;
  char* const vptr = v->device_ptr;
  const void* const host = x->host_ptr;
  const size_t vsize = v->size;
  const size_t xsize = x->size;
  const EventRef v_ready = v->ready;
  LruRemove(v);
  v->state = BufferState::kPagingOut;
  ++prefetch_.host_generation;
  if (v->prefetched) {  // a prefetch that came too early
    NotePrefetchWastedLocked(v);
    EndPrefetchLocked(v);
  }
  transitions_in_flight_ += 2;
  lock.unlock();

  Stream* compute = device_->GetStream(StreamKind::kCompute);
  Status status;
  std::string v_before;
  std::string x_before;
  if (options_.verify_moves) {
    v_before.resize(vsize);
    status = device_->ReadDeviceSync(&v_before[0], vptr, vsize);
    x_before.reserve(xsize);
    for (const auto& [p, n] : host_pool_->RangeOf(host, 0, xsize)) {
      x_before.append(p, n);
    }
  }
  if (status.ok() && v_ready) status = device_->WaitEvent(compute, v_ready);
  bool written = false;
  for (size_t off = 0; status.ok() && off < longest; off += piece) {
    const size_t nv = off < vsize ? std::min(piece, vsize - off) : 0;
    const size_t nx = off < xsize ? std::min(piece, xsize - off) : 0;
    if (nv > 0) {
      status = device_->CopyDeviceToDevice(compute, staged, vptr + off, nv);
    }
    size_t done = 0;
    for (const auto& [p, n] : host_pool_->RangeOf(host, off, nx)) {
      if (!status.ok()) break;
      status = device_->CopyHostToDevice(compute, vptr + off + done, p, n);
      written = written || status.ok();
      done += n;
    }
    done = 0;
    for (const auto& [p, n] : host_pool_->RangeOf(host, off, nv)) {
      if (!status.ok()) break;
      status = device_->CopyDeviceToHost(compute, p, staged + done, n);
      done += n;
    }
  }
  if (status.ok()) {
    EventRef done = device_->RecordEvent(compute, &status);
    if (done) status = device_->SynchronizeEvent(done);
  }
  if (status.ok() && options_.verify_moves) {
    std::string x_after(xsize, '\0');
    status = device_->ReadDeviceSync(&x_after[0], vptr, xsize);
    std::string v_after;
    v_after.reserve(vsize);
    for (const auto& [p, n] : host_pool_->RangeOf(host, 0, vsize)) {
      v_after.append(p, n);
    }
    if (status.ok() && (x_after != x_before || v_after != v_before)) {
      status = Internal("swap verification failed: a buffer swapped in "
                        "place differs from its bytes before the swap");
    }
  }

  lock.lock();
  transitions_in_flight_ -= 2;
  AddChunkBytes(x, -static_cast<int64_t>(piece));
  arena_->FreeChunk(held, ReuseAfterNowLocked());  // copies ran on compute
  if (!status.ok()) {
    AbandonPageOutLocked(v, nullptr);  // resident again, or destroyed
    cv_.notify_all();
    if (written) {
      return Internal("swapping a buffer in place failed after part of it "
                      "was copied, so bytes of two buffers are lost: " +
                      status.ToString());
    }
    return status;
  }
  // The victim is on the host, in what was x's host copy.
  const size_t chunk_size = arena_->chunk(vchunk)->size;
  AddChunkBytes(v, -static_cast<int64_t>(chunk_size));
  v->device_ptr = nullptr;
  // x's host bytes leave the count before v's join it: the two share one
  // host allocation, and the peak must not count it twice.
  counters_.current_bytes_reclaimed -= static_cast<int64_t>(x->host_bytes);
  CompletePageOutLocked(v, const_cast<void*>(host), /*copied=*/true);
  ++counters_.num_single_reclaims;
  if (options_.prefetch_enabled) NoteVictimLocked(v);
  // x is resident in what was the victim's chunk, every copy into it done.
  arena_->Reown(vchunk, xsize, x);
  x->chunk = vchunk;
  x->device_ptr = vptr;
  AddChunkBytes(x, static_cast<int64_t>(chunk_size));
  x->host_ptr = nullptr;
  x->host_bytes = 0;
  x->ready.reset();
  x->state = BufferState::kResident;
  ++counters_.num_page_ins;
  counters_.bytes_paged_in += static_cast<int64_t>(xsize);
  ++counters_.num_swaps_in_place;
  counters_.bytes_swapped_in_place += static_cast<int64_t>(xsize);
  if (!x->active()) LruPush(x);
  if (v->free_requested) DestroyBufferLocked(v);
  cv_.notify_all();
  return Status::Ok();
}

}  // namespace tflms
