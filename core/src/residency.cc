// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Residency: pin/unpin, page-out and page-in.
//
// State machine of a buffer (transient states in brackets, entered and left
// under mu_, with mu_ released in between while bytes are copied):
//
//   Resident --(PageOut)--> [PagingOut] --ok--> Reclaimed
//                                       --failed--> Resident (bytes intact)
//   Reclaimed --(PageIn)--> [PagingIn] --ok--> Resident
//                                      --failed--> Reclaimed (host copy kept)
//   A FreeBuffer that finds a transient state sets free_requested; whoever
//   settles the state destroys the buffer (PageIn leaves that to its caller).
//   Resident --(defrag)--> [Moving] --> Resident (new or old address)
//   In fixed-address mode (fixed_address.cc) the address never changes: a
//   page-out keeps the buffer's virtual chunk and unmaps its unshared pages
//   once the copy is synchronized (a failed first unmap is handled like a
//   failed copy); a page-in maps pages back behind the same chunk.
//
// Guarantees:
//   * A device chunk is freed only after the event that proves its bytes
//     reached the host has been synchronized without error.
//   * A host copy is freed only after the event of the page-in that read it
//     has completed (pending_host_frees_).
//   * Copies out of a chunk are ordered after the buffer's last use (a
//     compute-stream event recorded after the last-use epoch its last Unpin
//     stamped was closed, see engine_impl.h) and after the copy that filled
//     it (ready); copies into a chunk are ordered after all work
//     already enqueued on the compute stream, since that work may still read
//     the chunk's previous owner, which the host already freed.
//   * Pin never returns while the buffer is in a transient state: it waits
//     on cv_, so no kernel ever sees a half-moved buffer.
//   * Every Pin orders the compute stream after the copy that filled the
//     chunk until that copy is known complete, not only the first: two
//     threads' kernels may pin a buffer whose page-in is still landing.
//   * MarkUnmovable returns only after the bytes are resident (host-side
//     wait), since an escaped address is read outside every stream.
#include <algorithm>
#include <chrono>
#include <string>

#include "engine_impl.h"

namespace tflms {

void Engine::Impl::LruPush(Buffer* b) {
  b->lru_prev = lru_tail_;
  b->lru_next = nullptr;
  if (lru_tail_ != nullptr) {
    lru_tail_->lru_next = b;
  } else {
    lru_head_ = b;
  }
  lru_tail_ = b;
  b->in_lru = true;
}

void Engine::Impl::LruRemove(Buffer* b) {
  if (!b->in_lru) return;
  if (b->lru_prev != nullptr) {
    b->lru_prev->lru_next = b->lru_next;
  } else {
    lru_head_ = b->lru_next;
  }
  if (b->lru_next != nullptr) {
    b->lru_next->lru_prev = b->lru_prev;
  } else {
    lru_tail_ = b->lru_prev;
  }
  b->lru_prev = b->lru_next = nullptr;
  b->in_lru = false;
}

Status Engine::Impl::OrderAfterUses(Stream* stream, const EventRef& last_use,
                                    const EventRef& ready) {
  if (last_use) TFLMS_RETURN_IF_ERROR(device_->WaitEvent(stream, last_use));
  if (ready) TFLMS_RETURN_IF_ERROR(device_->WaitEvent(stream, ready));
  return Status::Ok();
}

uint64_t Engine::Impl::CloseEpochLocked(uint64_t* free_seq) {
  *free_seq = free_seq_;
  unpins_in_open_epoch_ = 0;
  return open_epoch_++;
}

void Engine::Impl::PublishEpochEventLocked(uint64_t epoch, EventRef event,
                                           uint64_t free_seq) {
  if (!event) return;
  ClosedEpoch& slot = closed_epochs_[epoch % kEpochRing];
  // Closes are published out of order when threads race; a slot keeps the
  // newer epoch (an older one is then covered by any kept later event).
  if (slot.epoch > epoch) return;
  slot.epoch = epoch;
  slot.event = std::move(event);
  slot.free_seq = free_seq;
}

bool Engine::Impl::LastUseEventLocked(uint64_t epoch, EventRef* event,
                                      uint64_t* covers,
                                      uint64_t* free_seq) const {
  event->reset();
  *covers = 0;
  *free_seq = 0;
  if (epoch == 0 || epoch <= completed_epoch_) return true;
  if (epoch >= open_epoch_) return false;  // still open: needs a close
  const ClosedEpoch& exact = closed_epochs_[epoch % kEpochRing];
  if (exact.epoch == epoch) {
    *event = exact.event;
    *covers = exact.epoch;
    *free_seq = exact.free_seq;
    return true;
  }
  // Not kept (its record failed, is still being published, or the slot was
  // reused): the earliest kept event of a later epoch also follows it.
  const ClosedEpoch* best = nullptr;
  for (const ClosedEpoch& c : closed_epochs_) {
    if (c.epoch > epoch && (best == nullptr || c.epoch < best->epoch)) {
      best = &c;
    }
  }
  if (best == nullptr) return false;
  *event = best->event;
  *covers = best->epoch;
  *free_seq = best->free_seq;
  return true;
}

void Engine::Impl::NoteEpochCompleteLocked(uint64_t epoch,
                                           uint64_t free_seq) {
  completed_epoch_ = std::max(completed_epoch_, epoch);
  // The event followed every free numbered up to free_seq, so the work those
  // frees raced with is complete too (fixed-address mode unmaps on this).
  synced_seq_ = std::max(synced_seq_, free_seq);
}

bool Engine::Impl::LastUseDoneLocked(uint64_t epoch) const {
  EventRef event;
  uint64_t covers = 0;
  uint64_t free_seq = 0;
  if (!LastUseEventLocked(epoch, &event, &covers, &free_seq)) return false;
  return !event || device_->EventDone(event);
}

Status Engine::Impl::SyncLastUses(std::unique_lock<std::mutex>& lock) {
  uint64_t epoch = 0;
  uint64_t free_seq = 0;
  if (unpins_in_open_epoch_ > 0) {
    epoch = CloseEpochLocked(&free_seq);
  } else if (open_epoch_ - 1 > completed_epoch_) {
    // Closed, but maybe without a kept event: a fresh one covers it too.
    epoch = open_epoch_ - 1;
    free_seq = free_seq_;
  } else {
    return Status::Ok();
  }
  lock.unlock();
  Status status;
  EventRef event =
      device_->RecordEvent(device_->GetStream(StreamKind::kCompute), &status);
  if (event) status = device_->SynchronizeEvent(event);
  lock.lock();
  if (!status.ok()) return status;
  NoteEpochCompleteLocked(epoch, free_seq);
  PublishEpochEventLocked(epoch, std::move(event), free_seq);
  return Status::Ok();
}

// The host thread runs up to a launch queue (about a thousand kernels) ahead
// of the GPU, and every choice the engine makes (which chunk a page-in goes
// into, when a page-out may start) is made on the host's clock: a chunk free
// by the host's count may still be read by queued kernels, and a copy into it
// waits for them (PageIn, reuse_after). Holding the host within a few epochs
// of the GPU while tensors are on the host brings those choices to about the
// GPU's clock. It only delays the host: the GPU still has run_ahead_epochs
// epochs of kernels queued when the host resumes. Only with prefetch, whose
// page-ins and early page-outs are the choices made ahead: paging on demand
// the planner's 30 on-demand points stepped 0.8% slower at 8 epochs
// (geometric mean; InceptionV3 at 318 on the AC922 4.3%). With prefetch, at
// its 30 points (docs/how-it-works.md, "The host held near the GPU"), 8
// epochs gave step times 2.4% lower by geometric mean, up to 10.7%, 17
// points within 1.05x of the Ideal instead of 12, and one 2.2% slower
// (InceptionV3 at 636 on the AC922); at 6 epochs the U-Net at 480^3 on the
// H100 ran out of memory. The engine's own default is off (0), as for its
// other policies; the patch and the add-on turn it on at 8
// (lms::kRunAheadEpochsDefault).
void Engine::Impl::ThrottleRunAhead(std::unique_lock<std::mutex>& lock,
                                    uint64_t closed) {
  const uint64_t limit = static_cast<uint64_t>(options_.run_ahead_epochs);
  if (limit == 0 || !options_.prefetch_enabled || closed <= limit ||
      counters_.current_bytes_reclaimed <= 0) {
    return;
  }
  const uint64_t target = closed - limit;
  EventRef event;
  uint64_t covers = 0;
  uint64_t free_seq = 0;
  // Only the target's own event: a later one (the target's was not kept)
  // would hold the host back further than asked, up to draining the GPU.
  if (!LastUseEventLocked(target, &event, &covers, &free_seq) || !event ||
      covers != target) {
    return;
  }
  ++counters_.num_run_ahead_checks;
  // The GPU is within the limit already (a host slower than its kernels):
  // nothing to wait for, so mu_ stays held, and no wait is counted.
  if (device_->EventDone(event)) {
    NoteEpochCompleteLocked(covers, free_seq);
    return;
  }
  const int64_t start = NowNs();
  lock.unlock();
  const Status status = device_->SynchronizeEvent(event);
  lock.lock();
  ++counters_.num_run_ahead_waits;
  counters_.run_ahead_wait_ns += NowNs() - start;
  // A failed wait proves nothing complete; the next close tries again.
  if (status.ok()) NoteEpochCompleteLocked(covers, free_seq);
}

void Engine::Impl::FreeSettledHostCopies(std::unique_lock<std::mutex>* lock,
                                         bool wait) {
  if (wait) {
    std::vector<PendingHostFree> pending;
    pending.swap(pending_host_frees_);
    lock->unlock();
    for (PendingHostFree& p : pending) {
      device_->SynchronizeEvent(p.event);
      host_pool_->Free(p.ptr);
    }
    lock->lock();
    return;
  }
  size_t kept = 0;
  for (PendingHostFree& p : pending_host_frees_) {
    if (device_->EventDone(p.event)) {
      host_pool_->Free(p.ptr);
    } else {
      pending_host_frees_[kept++] = std::move(p);
    }
  }
  pending_host_frees_.resize(kept);
}

Status Engine::Impl::PageOut(std::unique_lock<std::mutex>& lock,
                             const std::vector<Buffer*>& victims,
                             size_t* bytes) {
  *bytes = 0;
  struct Copy {
    Buffer* buffer = nullptr;
    const char* src = nullptr;
    size_t size = 0;
    EventRef ready;
    // The last use: `last_use` (null: nothing to wait for) covers the
    // epochs up to `covers`; `fresh`: the event is recorded below instead.
    EventRef last_use;
    uint64_t covers = 0;
    uint64_t free_seq = 0;
    bool fresh = false;
    void* host = nullptr;
  };
  std::vector<Copy> copies;
  copies.reserve(victims.size());
  bool need_fresh = false;
  for (Buffer* v : victims) {
    if (v->clean_host != nullptr) {
      const size_t chunk_size = arena_->chunk(v->chunk)->size;
      if (TryEvictCleanLocked(v)) {
        *bytes += chunk_size;
        continue;
      }
      ReleaseCleanCopyLocked(v);  // still landing: copied out as any other
    }
    LruRemove(v);
    v->state = BufferState::kPagingOut;
    ++prefetch_.host_generation;
    ++transitions_in_flight_;
    if (v->prefetched) {  // a prefetch that came too early
      NotePrefetchWastedLocked(v);
      EndPrefetchLocked(v);
    }
    copies.emplace_back();
    Copy& c = copies.back();
    c.buffer = v;
    c.src = v->device_ptr;
    c.size = v->size;
    c.ready = v->ready;
    c.fresh = !LastUseEventLocked(v->last_use_epoch, &c.last_use, &c.covers,
                                  &c.free_seq);
    need_fresh = need_fresh || c.fresh;
  }
  // A victim's last use is stamped with an epoch no kept event covers
  // (usually the open one): close it now; the event recorded below, after
  // the close, follows the victim's last use.
  uint64_t fresh_epoch = 0;
  uint64_t fresh_free_seq = 0;
  if (need_fresh) fresh_epoch = CloseEpochLocked(&fresh_free_seq);
  ReleaseSettledHostCopies(&lock, /*wait=*/false);
  const bool retry_after_drain =
      !pending_host_frees_.empty() || clean_copies_ > 0;
  lock.unlock();

  const int64_t start = NowNs();
  Status status;
  Stream* d2h = device_->GetStream(StreamKind::kDeviceToHost);
  EventRef fresh;
  if (need_fresh) {
    Status s;
    fresh = device_->RecordEvent(device_->GetStream(StreamKind::kCompute), &s);
    if (!fresh) {
      // Without it nothing orders the copy after the last use: those
      // victims stay resident (below, as for a failed copy).
      status = s.ok() ? Internal("recording a last-use event failed") : s;
    }
  }
  bool drained = false;
  for (Copy& c : copies) {
    if (c.fresh) {
      if (!fresh) continue;
      c.last_use = fresh;
      c.covers = fresh_epoch;
      c.free_seq = fresh_free_seq;
    }
    Status s;
    c.host = host_pool_->Allocate(c.size, &s);
    if (c.host == nullptr && retry_after_drain && !drained) {
      // Host copies of recent page-ins may still be waiting for their
      // events, and prefetched buffers keep clean copies that are only
      // an optimization: free them all and try once more.
      lock.lock();
      ReleaseAllCleanCopiesLocked();
      ReleaseSettledHostCopies(&lock, /*wait=*/true);
      lock.unlock();
      drained = true;
      c.host = host_pool_->Allocate(c.size, &s);
    }
    if (c.host == nullptr) {
      status = s;
      continue;
    }
    s = OrderAfterUses(d2h, c.last_use, c.ready);
    if (s.ok()) s = host_pool_->CopyToHost(d2h, c.host, c.src, c.size);
    if (!s.ok()) {
      host_pool_->Free(c.host);
      c.host = nullptr;
      status = s;
    }
  }
  Status sync;
  EventRef done = device_->RecordEvent(d2h, &sync);
  if (done) sync = device_->SynchronizeEvent(done);
  const int64_t blocked = NowNs() - start;

  lock.lock();
  counters_.page_out_wait_ns += blocked;
  transitions_in_flight_ -= static_cast<int>(copies.size());
  if (fresh) PublishEpochEventLocked(fresh_epoch, fresh, fresh_free_seq);
  for (Copy& c : copies) {
    Buffer* v = c.buffer;
    bool copied = c.host != nullptr && sync.ok();
    if (copied && c.last_use) {
      // The D2H stream waited for c.last_use before the synchronized copy:
      // the epochs it covers are complete, and (fixed-address mode) so is
      // every free numbered before it was recorded.
      NoteEpochCompleteLocked(c.covers, c.free_seq);
    }
    if (copied && fixed_) {
      const BfcArena::Chunk* vc = arena_->chunk(v->chunk);
      Status us = ReleaseRangeFixed(vc->ptr, vc->size, Release::kEvicted);
      if (!us.ok()) {  // nothing unmapped: v stays resident, intact
        status = us;
        copied = false;
      }
    }
    if (!copied) {
      AbandonPageOutLocked(v, c.host);
      continue;
    }
    const size_t chunk_size = arena_->chunk(v->chunk)->size;
    // The synchronized copy was ordered after v's last use. In fixed-address
    // mode v keeps its virtual chunk (vchunk) and address.
    ReleaseEvictedChunkLocked(v);
    CompletePageOutLocked(v, c.host);
    *bytes += chunk_size;
    if (options_.prefetch_enabled) NoteVictimLocked(v);
    if (v->free_requested) DestroyBufferLocked(v);
  }
  cv_.notify_all();
  if (!sync.ok()) return sync;
  return status;
}

void Engine::Impl::StartEarlyPageOut(std::unique_lock<std::mutex>& lock,
                                     Buffer* v) {
  if (TryEvictCleanLocked(v)) return;
  ReleaseCleanCopyLocked(v);
  LruRemove(v);
  v->state = BufferState::kPagingOut;
  v->early_out = true;
  // Counted while the copy is being enqueued, so that an allocation that
  // finds nothing to reclaim meanwhile waits on cv_ for it; once enqueued,
  // the allocation ladder settles it (SettleEarlyPageOutsLocked) instead.
  ++transitions_in_flight_;
  EventRef last_use;
  uint64_t covers = 0;
  uint64_t free_seq = 0;
  const bool fresh =
      !LastUseEventLocked(v->last_use_epoch, &last_use, &covers, &free_seq);
  if (fresh) covers = CloseEpochLocked(&free_seq);
  const EventRef ready = v->ready;
  const char* src = v->device_ptr;
  const size_t size = v->size;
  lock.unlock();

  Status status;
  if (fresh) {
    last_use =
        device_->RecordEvent(device_->GetStream(StreamKind::kCompute), &status);
    if (!last_use && status.ok()) status = Internal("no last-use event");
  }
  void* host = nullptr;
  EventRef done;
  Stream* d2h = device_->GetStream(StreamKind::kDeviceToHost);
  // The host pool is not drained of settled page-in copies here: an early
  // page-out is an optimization, and a full pool only means it is skipped.
  if (status.ok()) host = host_pool_->Allocate(size, &status);
  if (status.ok()) status = OrderAfterUses(d2h, last_use, ready);
  bool copy_enqueued = false;
  if (status.ok()) status = host_pool_->CopyToHost(d2h, host, src, size);
  if (status.ok()) {
    copy_enqueued = true;
    done = device_->RecordEvent(d2h, &status);
  }

  lock.lock();
  --transitions_in_flight_;
  if (fresh && last_use) PublishEpochEventLocked(covers, last_use, free_seq);
  if (!status.ok() || !done) {
    // Nothing was lost: the buffer never stopped being resident.
    if (host != nullptr && !copy_enqueued) {
      host_pool_->Free(host);
    } else if (host != nullptr) {
      // The copy is enqueued but cannot be tracked: its host copy stays
      // allocated (the copy may still write it) rather than be reused too
      // early; this needs a failing device and costs only pool bytes.
      Status s;
      EventRef passed = device_->RecordEvent(d2h, &s);
      if (passed) {
        pending_host_frees_.push_back({host, size, passed});
        v->ready = std::move(passed);
      }
    }
    v->early_out = false;
    v->state = BufferState::kResident;
    if (v->free_requested) {
      DestroyBufferLocked(v);
    } else {
      LruPush(v);
    }
    cv_.notify_all();
    return;
  }
  ++counters_.num_early_page_outs;
  if (options_.prefetch_enabled) NoteVictimLocked(v);
  prefetch_.early_out_bytes += size;
  early_outs_.push_back({v, host, std::move(done), covers, free_seq});
  cv_.notify_all();
}

bool Engine::Impl::CancelEarlyPageOutLocked(Buffer* b) {
  for (size_t i = 0; i < early_outs_.size(); ++i) {
    if (early_outs_[i].buffer != b) continue;
    EarlyPageOut e = std::move(early_outs_[i]);
    early_outs_.erase(early_outs_.begin() + static_cast<ptrdiff_t>(i));
    prefetch_.early_out_bytes -= b->size;
    // The copy may still be reading the chunk: whoever writes it next (the
    // compute stream, which waits for b->ready) comes after the copy, and
    // the host copy is released once the copy is done.
    pending_host_frees_.push_back({e.host, b->size, e.done});
    b->ready = std::move(e.done);
    b->early_out = false;
    b->state = BufferState::kResident;
    LruPush(b);
    ++counters_.num_early_page_outs_cancelled;
    return true;
  }
  return false;
}

void Engine::Impl::SettleEarlyPageOutsLocked(std::unique_lock<std::mutex>& lock,
                                             size_t max) {
  const size_t n = std::min(max, early_outs_.size());
  if (n == 0) return;
  std::vector<EarlyPageOut> settling(
      std::make_move_iterator(early_outs_.begin()),
      std::make_move_iterator(early_outs_.begin() + static_cast<ptrdiff_t>(n)));
  early_outs_.erase(early_outs_.begin(),
                    early_outs_.begin() + static_cast<ptrdiff_t>(n));
  // The buffers stay kPagingOut with early_out set while mu_ is released
  // below: a Pin or FreeBuffer that finds one not in early_outs_ waits on
  // cv_ for the settle.
  std::vector<Status> results(n);
  std::vector<bool> waited(n, false);
  bool any_wait = false;
  for (size_t i = 0; i < n; ++i) {
    if (device_->EventDone(settling[i].done)) {
      // Done on the device; the freed chunk's next user is on the compute
      // stream, ordered after the copy (a no-op on a GPU, where done means
      // done; the simulated device's clocks need it).
      results[i] = device_->WaitEvent(device_->GetStream(StreamKind::kCompute),
                                      settling[i].done);
    } else {
      waited[i] = any_wait = true;
    }
  }
  if (any_wait) {
    // Counted as in flight while mu_ is released, so that an allocation on
    // another thread that finds no room waits on cv_ for these chunks.
    transitions_in_flight_ += static_cast<int>(n);
    lock.unlock();
    const int64_t start = NowNs();
    for (size_t i = 0; i < n; ++i) {
      if (waited[i]) results[i] = device_->SynchronizeEvent(settling[i].done);
    }
    const int64_t blocked = NowNs() - start;
    lock.lock();
    transitions_in_flight_ -= static_cast<int>(n);
    counters_.page_out_wait_ns += blocked;
  }
  for (size_t i = 0; i < settling.size(); ++i) {
    EarlyPageOut& e = settling[i];
    Buffer* v = e.buffer;
    v->early_out = false;
    prefetch_.early_out_bytes -= v->size;
    if (!results[i].ok()) {
      // The copy failed: the chunk still holds the bytes.
      AbandonPageOutLocked(v, e.host);
      continue;
    }
    NoteEpochCompleteLocked(e.covers, e.free_seq);
    ReleaseEvictedChunkLocked(v);  // the copy is done
    CompletePageOutLocked(v, e.host);
    if (v->free_requested) DestroyBufferLocked(v);
  }
  if (!settling.empty()) cv_.notify_all();
}

Status Engine::Impl::PageIn(std::unique_lock<std::mutex>& lock, Buffer* b,
                            bool for_prefetch, size_t protect_until,
                            bool no_reclaim, BfcArena::ChunkHandle into) {
  b->state = BufferState::kPagingIn;
  Status status;
  const AllocSource max_source =
      no_reclaim     ? AllocSource::kNewRegion
      : for_prefetch ? AllocSource::kSingleReclaim
                     : AllocSource::kFullReclaim;
  BfcArena::ChunkHandle h = BfcArena::kInvalidChunk;
  if (fixed_) {
    // Same address: map pages back behind the buffer's own virtual chunk.
    AllocSource source;
    status = MakeResidentFixed(lock, arena_->chunk(b->vchunk)->ptr,
                               arena_->chunk(b->vchunk)->size,
                               /*from_evicted=*/true, max_source,
                               protect_until, &source);
    if (status.ok()) {
      h = b->vchunk;
      AddChunkBytes(b, static_cast<int64_t>(arena_->chunk(h)->size));
    } else if (status.code() == Code::kResourceExhausted && !for_prefetch) {
      ++counters_.num_ooms;
    }
  } else if (into != BfcArena::kInvalidChunk) {
    h = into;
    CountSource(AllocSource::kFree);
    AddChunkBytes(b, static_cast<int64_t>(arena_->chunk(h)->size));
  } else {
    h = AllocateChunk(lock, b->size, b, max_source, &status, protect_until,
                      /*count_oom=*/false);
    if (h == BfcArena::kInvalidChunk && max_source == AllocSource::kFullReclaim &&
        status.code() == Code::kResourceExhausted) {
      // Neither memory had room: trade places with a victim (swap.cc).
      Status swapped = SwapInLocked(lock, b);
      if (swapped.ok()) return swapped;
      ++counters_.num_ooms;
      if (swapped.code() != Code::kResourceExhausted) status = swapped;
    }
  }
  if (h == BfcArena::kInvalidChunk) {
    b->state = BufferState::kReclaimed;
    cv_.notify_all();
    return status;
  }
  // Counted only from here: while it looked for a chunk this buffer held no
  // bytes an allocation could wait for (and counting it earlier would make
  // the allocation it runs wait for itself).
  ++transitions_in_flight_;
  b->chunk = h;
  b->device_ptr = arena_->chunk(h)->ptr;
  char* dst = b->device_ptr;
  void* host = b->host_ptr;
  const size_t size = b->size;
  // The copy writes bytes that kernels enqueued before their free may still
  // use: it waits for the event of the epoch stamped at that free
  // (reuse_after), not for all compute enqueued by now, which, with the host
  // up to a launch queue ahead of the GPU, held every page-in back until the
  // GPU caught up with the host. Most prefetches go into memory freed just
  // before, so the gain is small (the planner's 26 prefetch points: 0.5%
  // by geometric mean, up to 2.6%). Fixed-address mode maps pages whose
  // earlier users it does not track this way: it waits for everything.
  EventRef after;
  uint64_t covers = 0;
  uint64_t free_seq = 0;
  const bool fresh =
      fixed_ || !LastUseEventLocked(arena_->chunk(h)->reuse_after, &after,
                                    &covers, &free_seq);
  uint64_t fresh_epoch = 0;
  if (fresh && !fixed_) fresh_epoch = CloseEpochLocked(&free_seq);
  lock.unlock();

  Stream* h2d = device_->GetStream(StreamKind::kHostToDevice);
  if (fresh) {
    after = device_->RecordEvent(device_->GetStream(StreamKind::kCompute),
                                 &status);
  }
  if (status.ok() && after) status = device_->WaitEvent(h2d, after);
  if (status.ok()) status = host_pool_->CopyToDevice(h2d, dst, host, size);
  EventRef ready;
  if (status.ok()) ready = device_->RecordEvent(h2d, &status);

  lock.lock();
  --transitions_in_flight_;
  if (fresh && !fixed_) PublishEpochEventLocked(fresh_epoch, after, free_seq);
  if (!status.ok()) {
    AddChunkBytes(b, -static_cast<int64_t>(arena_->chunk(h)->size));
    if (fixed_) {
      ReleaseRangeFixed(arena_->chunk(h)->ptr, arena_->chunk(h)->size,
                        Release::kEvictedKeepMapped);
    } else {
      arena_->FreeChunk(h, ReuseAfterNowLocked());
      b->device_ptr = nullptr;
    }
    b->chunk = BfcArena::kInvalidChunk;
    b->state = BufferState::kReclaimed;
    cv_.notify_all();
    return status;
  }
  if (for_prefetch && !fixed_) {
    // Kept until the first pin: an eviction before it needs no copy.
    b->clean_host = host;
    b->clean_host_bytes = b->host_bytes;
    ++clean_copies_;
  } else {
    // The copy reads the host copy asynchronously: free it once it landed.
    pending_host_frees_.push_back({host, b->host_bytes, ready});
  }
  counters_.current_bytes_reclaimed -= static_cast<int64_t>(b->host_bytes);
  b->host_ptr = nullptr;
  b->host_bytes = 0;
  b->ready = ready;
  if (options_.prefetch_enabled) NotePageInLocked(ready, size);
  b->state = BufferState::kResident;
  ++counters_.num_page_ins;
  counters_.bytes_paged_in += static_cast<int64_t>(size);
  if (!b->active()) LruPush(b);
  cv_.notify_all();
  return Status::Ok();
}

Status Engine::Impl::Pin(Buffer* b, void** device_ptr) {
  if (b == nullptr) return InvalidArgument("buffer must not be null");
  std::unique_lock<std::mutex> lock(mu_);
  if (b->free_requested) {
    return FailedPrecondition("buffer " + std::to_string(b->id) +
                              " was freed; it cannot be pinned");
  }
  if (options_.prefetch_enabled) TakeNotedStepLocked();
  int64_t waited_since = -1;
  bool relocation_tried = false;
  // The first pin of a kernel whose large output the learned step expects:
  // its inputs may need placing together first (due_group.cc).
  if (b->pin_count == 0 && options_.lms_enabled &&
      counters_.current_bytes_reclaimed > 0 &&
      PlaceDueGroupLocked(lock, b)) {
    relocation_tried = true;
  }
  for (;;) {
    if (b->state == BufferState::kResident) {
      // A large buffer stranded mid-gap under pressure moves to a gap end
      // first (placement.cc); the lock may have been released, so the
      // state is looked at again either way.
      if (!relocation_tried && b->pin_count == 0 && !b->unmovable &&
          UnderPlacementPressure(*b)) {
        relocation_tried = true;
        RelocateStrandedLocked(lock, b);
        continue;
      }
      break;
    }
    if (b->state == BufferState::kReclaimed) {
      // PageIn returns with mu_ held and the buffer resident, so nothing can
      // evict it before the pin below.
      Status s = PageIn(lock, b, /*for_prefetch=*/false);
      if (b->free_requested) {
        // FreeBuffer ran while the copy was in flight and left the buffer
        // to us; it is gone for the caller either way.
        DestroyBufferLocked(b);
        return FailedPrecondition("buffer was freed while being pinned");
      }
      TFLMS_RETURN_IF_ERROR(s);
      CountPageInAtPinLocked(b);
      if (options_.prefetch_enabled) NotePrefetchMissLocked(b);
      continue;
    }
    if (b->early_out && CancelEarlyPageOutLocked(b)) continue;
    if (waited_since < 0) waited_since = NowNs();
    cv_.wait(lock);
    if (b->free_requested) {
      return FailedPrecondition("buffer " + std::to_string(b->id) +
                                " was freed while being pinned");
    }
  }
  if (waited_since >= 0) counters_.page_in_stall_ns += NowNs() - waited_since;
  ReleaseSettledHostCopies(&lock, /*wait=*/false);
  ReleaseCleanCopyLocked(b);  // the kernel may write it from now on
  // Every pin orders its kernel after the copy until the copy is known done
  // (Buffer::ready): the first pinner may not have reached the compute
  // stream yet when a second kernel is launched.
  EventRef ready = b->ready;
  if (ready && device_->EventDone(ready)) {
    b->ready.reset();
    ready.reset();
  }
  b->prefetch_wasted = false;
  if (b->prefetched) {
    ++counters_.prefetch_hits;
    if (ready) {  // still landing when the kernel is launched
      ++counters_.prefetch_hits_in_flight;
      counters_.bytes_prefetched_in_flight += static_cast<int64_t>(b->size);
    }
    EndPrefetchLocked(b);
  }
  const bool was_active = b->active();
  const bool verify = options_.verify_pins && b->pin_count == 0 &&
                      !b->unmovable && b->pin_hash_valid;
  const uint64_t expected_hash = b->pin_hash;
  ++b->pin_count;
  SetActivity(b, was_active);
  *device_ptr = b->device_ptr;
  std::vector<Buffer*> plan;
  if (options_.prefetch_enabled) plan = NotePinAndPlan(b);
  if (!plan.empty()) RunPrefetch(lock, plan);
  if (options_.prefetch_enabled) {
    StartPlannedPageOutsLocked(lock);
    StartPlannedPageInsLocked(lock);
  }
  lock.unlock();
  Status status;
  if (ready) {
    // The page-in is enqueued; kernels on the compute stream wait for it
    // without blocking this thread.
    status =
        device_->WaitEvent(device_->GetStream(StreamKind::kCompute), ready);
  }
  if (status.ok() && verify) {
    status = VerifyPinnedBytes(b, *device_ptr, expected_hash);
  }
  return status;
}

void Engine::Impl::AbandonPageOutLocked(Buffer* v, void* host) {
  if (host != nullptr) host_pool_->Free(host);
  v->state = BufferState::kResident;
  if (v->free_requested) {
    DestroyBufferLocked(v);
  } else {
    LruPush(v);
  }
}

void Engine::Impl::FreeCleanCopyLocked(Buffer* b) {
  if (b->ready) {
    // The page-in may still be reading it.
    pending_host_frees_.push_back(
        {b->clean_host, b->clean_host_bytes, b->ready});
  } else {
    host_pool_->Free(b->clean_host);
  }
  b->clean_host = nullptr;
  b->clean_host_bytes = 0;
  --clean_copies_;
}

void Engine::Impl::EndPrefetchLocked(Buffer* b) {
  if (!b->prefetched) return;
  if (!b->prefetch_planned) prefetch_.inflight_bytes -= b->size;
  b->prefetch_planned = false;
  b->prefetched = false;
}

void Engine::Impl::ReleaseAllCleanCopiesLocked() {
  for (Buffer* b = all_head_; b != nullptr && clean_copies_ > 0;
       b = b->all_next) {
    ReleaseCleanCopyLocked(b);
  }
}

bool Engine::Impl::TryEvictCleanLocked(Buffer* v) {
  // Until the page-in has landed its copy still reads the host copy and
  // writes the chunk; evicted then, the buffer's next page-in, or the
  // chunk's next user, would race it.
  if (v->clean_host == nullptr || (v->ready && !device_->EventDone(v->ready))) {
    return false;
  }
  LruRemove(v);
  if (v->prefetched) {  // a prefetch that came too early
    NotePrefetchWastedLocked(v);
    EndPrefetchLocked(v);
  }
  // Its last writer was the page-in, landed, and nothing pinned it since.
  ReleaseEvictedChunkLocked(v);
  void* host = v->clean_host;
  v->clean_host = nullptr;
  v->clean_host_bytes = 0;
  --clean_copies_;
  CompletePageOutLocked(v, host, /*copied=*/false);
  ++counters_.num_clean_evictions;
  counters_.bytes_evicted_clean += static_cast<int64_t>(v->size);
  if (options_.prefetch_enabled) NoteVictimLocked(v);
  if (v->free_requested) DestroyBufferLocked(v);
  return true;
}

void Engine::Impl::ReleaseEvictedChunkLocked(Buffer* v) {
  AddChunkBytes(v, -static_cast<int64_t>(arena_->chunk(v->chunk)->size));
  if (fixed_) return;
  arena_->FreeChunk(v->chunk, kReusableAtOnce);
  v->device_ptr = nullptr;
}

void Engine::Impl::CompletePageOutLocked(Buffer* v, void* host,
                                         bool copied) {
  v->chunk = BfcArena::kInvalidChunk;
  v->host_ptr = host;
  v->host_bytes = v->size;
  v->last_use_epoch = 0;
  v->ready.reset();
  v->state = BufferState::kReclaimed;
  ++prefetch_.host_generation;
  if (copied) counters_.bytes_reclaimed += static_cast<int64_t>(v->size);
  counters_.current_bytes_reclaimed += static_cast<int64_t>(v->size);
  counters_.peak_bytes_reclaimed = std::max(
      counters_.peak_bytes_reclaimed, counters_.current_bytes_reclaimed);
}

Status Engine::Impl::Unpin(Buffer* b) {
  if (b == nullptr) return InvalidArgument("buffer must not be null");
  std::unique_lock<std::mutex> lock(mu_);
  if (b->pin_count <= 0) {
    return FailedPrecondition("unpin of buffer " + std::to_string(b->id) +
                              " without a matching pin");
  }
  NoteUnpinnedBytes(b);
  const bool was_active = b->active();
  --b->pin_count;
  // The kernels that used the buffer were enqueued before this call; the
  // stamp, taken under mu_ like every close of an epoch, puts them before
  // any event recorded once this epoch has closed.
  b->last_use_epoch = open_epoch_;
  SetActivity(b, was_active);
  if (options_.prefetch_enabled) {
    // Early page-outs follow a learned step, which only prefetch records.
    NoteStepEventLocked(StepEvent::kUnpin, b);
    if (ShouldPageOutEarlyLocked(b)) StartEarlyPageOut(lock, b);
  }
  if (++unpins_in_open_epoch_ < kUnpinsPerEpoch) return Status::Ok();
  // Every kUnpinsPerEpoch unpins: close the epoch and keep an event for it,
  // so that a page-out finds its victim's last use already covered by an
  // event close behind it (it would otherwise record one that follows all
  // work queued until then). The record runs with mu_ released, as copies
  // and waits do; the event is kept under mu_ again.
  uint64_t free_seq = 0;
  const uint64_t epoch = CloseEpochLocked(&free_seq);
  lock.unlock();
  Status status;
  EventRef event =
      device_->RecordEvent(device_->GetStream(StreamKind::kCompute), &status);
  // A failed record loses nothing: a page-out that needs this epoch falls
  // back to a later kept event or records a fresh one.
  if (!event) return Status::Ok();
  lock.lock();
  PublishEpochEventLocked(epoch, std::move(event), free_seq);
  ThrottleRunAhead(lock, epoch);
  return Status::Ok();
}

Status Engine::Impl::MarkUnmovable(Buffer* b, void** device_ptr) {
  TFLMS_RETURN_IF_ERROR(Pin(b, device_ptr));
  // The address escapes to readers no stream orders (DLPack consumers, the
  // C API): return only once a page-in that Pin enqueued has landed, which
  // the compute stream waits for.
  Status status;
  EventRef landed =
      device_->RecordEvent(device_->GetStream(StreamKind::kCompute), &status);
  if (status.ok() && landed) status = device_->SynchronizeEvent(landed);
  if (!status.ok()) {
    Unpin(b);
    return status;
  }
  std::lock_guard<std::mutex> lock(mu_);
  const bool was_active = b->active();
  b->unmovable = true;
  --b->pin_count;
  SetActivity(b, was_active);
  return Status::Ok();
}

Status Engine::Impl::Access(Buffer* b, size_t offset, void* host,
                            size_t bytes, bool write) {
  if (b == nullptr) return InvalidArgument("buffer must not be null");
  if (offset > b->size || bytes > b->size - offset) {
    return InvalidArgument("access of " + std::to_string(bytes) +
                           " bytes at offset " + std::to_string(offset) +
                           " is outside the buffer of " +
                           std::to_string(b->size) + " bytes");
  }
  if (bytes == 0) return Status::Ok();
  void* ptr = nullptr;
  TFLMS_RETURN_IF_ERROR(Pin(b, &ptr));
  char* device = static_cast<char*>(ptr) + offset;
  Status s = write ? device_->WriteDeviceSync(device, host, bytes)
                   : device_->ReadDeviceSync(host, device, bytes);
  Status u = Unpin(b);
  return s.ok() ? u : s;
}

int64_t Engine::Impl::NowNs() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace tflms
