// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The public Engine API, raw allocations, and the allocation ladder.
//
// The ladder (AllocateChunk) is where policy meets the arena. A request that
// does not fit climbs, stopping at the first step that yields a chunk:
//   1. a free chunk (best fit), respecting the LMS limit;
//   2. a new region from the device;
//   3. single reclaim: page out the least recently used inactive buffer that,
//      with its free neighbours, makes room (one copy); where the learned
//      step pins that buffer again within a few pins, first a slide, then
//      a page-out of fewer bytes due later and a slide (defrag.cc);
//   4. defragmentation, if enabled: move inactive buffers device-to-device
//      to open a gap (a device copy is an order of magnitude cheaper than a
//      host round trip, so it runs before the costly reclaims below);
//   5. fragments reclaim: page out the cheapest window of adjacent
//      inactive/free chunks that makes room;
//   6. full reclaim: page out every inactive buffer;
//   7. the free chunk again without the LMS limit (the limit is soft);
//   8. out of memory, with a message naming the cause.
// Steps 3-6 release mu_ while bytes are copied, so other threads may take or
// return memory meanwhile; the ladder therefore re-searches after each step
// and repeats while a pass still makes progress.
#include <algorithm>
#include <limits>
#include <string>

#include "engine_impl.h"

namespace tflms {
namespace {

class DeviceSubAllocator : public SubAllocator {
 public:
  explicit DeviceSubAllocator(Device* device) : device_(device) {}
  void* Alloc(size_t bytes, size_t alignment) override {
    return device_->AllocateDeviceMemory(bytes, alignment);
  }
  void Free(void* ptr, size_t bytes) override {
    device_->FreeDeviceMemory(ptr, bytes);
  }

 private:
  Device* device_;
};

// The ladder gives up after this many rounds without a chunk even though
// each round made progress or waited for another thread's copies (other
// threads kept taking the space).
constexpr int kMaxLadderRounds = 64;

}  // namespace

Engine::Impl::Impl(Device* device, const EngineOptions& options)
    : device_(device), options_(options) {}

Engine::Impl::~Impl() {
  // No other thread may use the engine now; waiting without mu_ is safe.
  for (EarlyPageOut& e : early_outs_) {
    device_->SynchronizeEvent(e.done);
    host_pool_->Free(e.host);
  }
  early_outs_.clear();
  for (PendingHostFree& p : pending_host_frees_) {
    device_->SynchronizeEvent(p.event);
    host_pool_->Free(p.ptr);
  }
  pending_host_frees_.clear();
  for (Buffer* b = all_head_; b != nullptr;) {
    Buffer* next = b->all_next;
    if (b->host_ptr != nullptr) host_pool_->Free(b->host_ptr);
    delete b;
    b = next;
  }
  all_head_ = nullptr;
  for (Buffer* b : spare_buffers_) delete b;
  spare_buffers_.clear();
  by_id_.clear();
  if (fixed_ && vbase_ != nullptr) {
    // Queued work may still touch mapped pages: let every stream drain
    // before the pages go.
    for (StreamKind k : {StreamKind::kCompute, StreamKind::kDeviceToHost,
                         StreamKind::kHostToDevice}) {
      Status s;
      EventRef e = device_->RecordEvent(device_->GetStream(k), &s);
      if (e) device_->SynchronizeEvent(e);
    }
    for (size_t i = 0; i < pages_.size(); ++i) {
      if (pages_[i].mapped) {
        device_->UnmapPages(vbase_ + i * page_size_, page_size_);
      }
    }
    arena_.reset();  // returns its regions to the range's bookkeeping
    device_->ReleaseAddressRange(vbase_, vbytes_);
  }
}

Status Engine::Impl::Init() {
  if (device_ == nullptr) return InvalidArgument("device must not be null");
  if (options_.memory_limit < BfcArena::kMinAllocationSize) {
    return InvalidArgument("memory_limit must be at least 256 bytes, got " +
                           std::to_string(options_.memory_limit));
  }
  if (options_.fragmentation_fraction < 0.0 ||
      options_.fragmentation_fraction > 1.0) {
    return InvalidArgument("fragmentation_fraction must be in [0, 1]");
  }
  if (options_.prefetch_lookahead < 0) {
    return InvalidArgument("prefetch_lookahead must be >= 0");
  }
  if (options_.run_ahead_epochs < 0 ||
      options_.run_ahead_epochs > kMaxRunAheadEpochs) {
    return InvalidArgument(
        "run_ahead_epochs must be 0 (no limit) or 1 to " +
        std::to_string(kMaxRunAheadEpochs) +
        ": the engine keeps the events of that many epochs");
  }
  if (options_.unfragmented) {
    if (options_.fixed_addresses) {
      return InvalidArgument(
          "unfragmented takes fragmentation out of the normal mode; "
          "fixed_addresses has none to take out: set one of them");
    }
    if (!options_.lms_enabled) {
      return InvalidArgument(
          "unfragmented measures LMS without fragmentation: it needs "
          "lms_enabled");
    }
    if (options_.memory_limit >
        std::numeric_limits<size_t>::max() / kUnfragmentedAddressFactor) {
      return InvalidArgument("memory_limit too large for unfragmented");
    }
  }
  TFLMS_RETURN_IF_ERROR(SetLmsLimit(options_.lms_limit));
  if (options_.prefetch_budget_bytes == 0) {
    options_.prefetch_budget_bytes = options_.memory_limit / 8;
  }
  if (options_.fixed_addresses) {
    fixed_ = true;
    TFLMS_RETURN_IF_ERROR(InitFixed());
    host_pool_ =
        std::make_unique<HostPool>(device_, options_.host_memory_limit);
    return Status::Ok();
  }
  device_sub_ = std::make_unique<DeviceSubAllocator>(device_);
  BfcArena::Options arena_options;
  arena_options.memory_limit = options_.memory_limit;
  if (options_.unfragmented) {
    arena_options.memory_limit *= kUnfragmentedAddressFactor;
    arena_options.split_always = true;  // a chunk holds what was asked
  }
  arena_options.allow_growth = options_.allow_growth;
  arena_options.fragmentation_fraction = options_.fragmentation_fraction;
  arena_ = std::make_unique<BfcArena>(device_sub_.get(), arena_options);
  host_pool_ =
      std::make_unique<HostPool>(device_, options_.host_memory_limit);
  return Status::Ok();
}

Status Engine::Impl::SetLmsLimit(size_t bytes) {
  if (bytes != 0 && bytes > options_.memory_limit) {
    return InvalidArgument(
        "LMS limit of " + std::to_string(bytes) +
        " bytes exceeds the device memory limit of " +
        std::to_string(options_.memory_limit) +
        " bytes; use 0 for the whole device or a smaller value");
  }
  if (bytes != 0 && bytes < BfcArena::kMinAllocationSize) {
    return InvalidArgument("LMS limit must be 0 or at least 256 bytes");
  }
  std::lock_guard<std::mutex> lock(mu_);
  lms_limit_ = bytes == 0 ? options_.memory_limit : bytes;
  return Status::Ok();
}

bool Engine::Impl::RejectLargerThanDevice(size_t bytes, Status* status) {
  // Regions are whole 256-byte units (BfcArena::Extend), so this is the
  // largest chunk the arena can ever hand out. Comparing the unrounded
  // request with it is exact, since it is a multiple of 256, and cannot
  // overflow, unlike RoundedBytes(bytes) for bytes near SIZE_MAX.
  const size_t largest_possible =
      options_.memory_limit & ~(BfcArena::kMinAllocationSize - 1);
  if (bytes <= largest_possible) return false;
  *status = ResourceExhausted(LargerThanDeviceMessage(bytes));
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.num_ooms;  // an OOM as TensorFlow's BFC would report it
  return true;
}

BfcArena::ChunkHandle Engine::Impl::AllocateChunk(
    std::unique_lock<std::mutex>& lock, size_t bytes, Buffer* owner,
    AllocSource max_source, Status* status, size_t protect_until,
    bool count_oom) {
  if (fixed_) {
    return AllocateChunkFixed(lock, bytes, owner, max_source, status,
                              protect_until);
  }
  // Callers passed RejectLargerThanDevice (buffers were created through it),
  // so rounding cannot overflow here.
  const size_t rounded = BfcArena::RoundedBytes(bytes);
  // Unfragmented (a yardstick), the arena's addresses outnumber the
  // device's bytes, so the LMS limit is what holds the device.
  auto find = [&](bool respect_limit) {
    if ((respect_limit || options_.unfragmented) && options_.lms_enabled &&
        arena_->bytes_in_use() + rounded > lms_limit_) {
      return BfcArena::kInvalidChunk;
    }
    return arena_->FindChunk(rounded, bytes, owner);
  };
  auto done = [&](BfcArena::ChunkHandle h, AllocSource source) {
    CountSource(source);
    AddChunkBytes(owner, static_cast<int64_t>(arena_->chunk(h)->size));
    return h;
  };

  // Under pressure a large request is placed next to what cannot leave
  // (placement.cc) rather than in the tightest free chunk wherever it is.
  if (max_source >= AllocSource::kSingleReclaim) {
    ClusterPlan plan = AllocationClusterPlan(rounded);
    bool ok = plan.lo != nullptr;
    if (ok && !plan.victims.empty()) {
      size_t reclaimed = 0;
      Status s = PageOut(lock, plan.victims, &reclaimed);
      ok = s.ok() && reclaimed > 0;
      if (ok) ++counters_.num_fragment_reclaims;
    }
    if (ok && arena_->bytes_in_use() + rounded <= lms_limit_) {
      BfcArena::ChunkHandle c = TakeClusterRange(plan, rounded, bytes, owner);
      if (c != BfcArena::kInvalidChunk) {
        return done(c, plan.victims.empty() ? AllocSource::kFree
                                            : AllocSource::kFragmentReclaim);
      }
    }
  }
  BfcArena::ChunkHandle h = find(true);
  if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kFree);
  if (arena_->bytes_in_use() + rounded <= lms_limit_ ||
      !options_.lms_enabled) {
    if (arena_->Extend(rounded)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kNewRegion);
    }
    // As TensorFlow does before giving up: wholly free regions go back to
    // the device so that one region large enough can be grown. It moves no
    // bytes, so it comes before any reclaim.
    if (options_.garbage_collection &&
        arena_->DeallocateFreeRegions(rounded) && arena_->Extend(rounded)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kNewRegion);
    }
  }

  // Padding inside chunks in use is room too, and giving it back copies
  // nothing (padding.cc).
  if (TrimPaddingLocked()) {
    h = find(true);
    if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kFree);
  }

  // Copies started ahead of this request (StartEarlyPageOut) free the room
  // it was for: settle them oldest first, only as many as it takes, since
  // the compute stream (or the host) is ordered after each one settled.
  while (!early_outs_.empty()) {
    SettleEarlyPageOutsLocked(lock, /*max=*/1);
    h = find(true);
    if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kFree);
  }

  Status host_status;
  const bool can_make_room = options_.lms_enabled || options_.defrag_enabled;
  for (int round = 0; can_make_room && round < kMaxLadderRounds; ++round) {
    bool progress = false;
    auto reclaim = [&](std::vector<Buffer*> victims, int64_t* counter) {
      if (victims.empty()) return false;
      size_t reclaimed = 0;
      Status s = PageOut(lock, victims, &reclaimed);
      if (!s.ok()) host_status = s;
      if (reclaimed == 0) {
        ++counters_.num_reclaim_failures;
        return false;
      }
      ++*counter;
      progress = true;
      return true;
    };

    const bool single = options_.lms_enabled &&
                        max_source >= AllocSource::kSingleReclaim;
    std::vector<Buffer*> victim;
    if (single) victim = ChooseSingleVictim(rounded, protect_until);
    // Both release mu_ once they act: the victim is chosen again after.
    if (single && round == 0 &&
        SlideRatherThanReclaimLocked(lock, rounded, victim)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kDefrag);
      victim = ChooseSingleVictim(rounded, protect_until);
    }
    if (single && round == 0 && TopUpAndSlideLocked(lock, rounded, victim)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) {
        return done(h, AllocSource::kFragmentReclaim);
      }
      victim = ChooseSingleVictim(rounded, protect_until);
    }
    if (single && reclaim(std::move(victim), &counters_.num_single_reclaims)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) {
        return done(h, AllocSource::kSingleReclaim);
      }
    }
    if (options_.defrag_enabled && max_source >= AllocSource::kDefrag) {
      size_t moved = 0;
      Status s = DefragFor(lock, rounded, &moved);
      if (moved > 0) progress = true;
      h = find(true);
      if (h != BfcArena::kInvalidChunk) return done(h, AllocSource::kDefrag);
      (void)s;
    }
    if (options_.lms_enabled && max_source >= AllocSource::kFragmentReclaim &&
        reclaim(ChooseFragmentVictims(rounded),
                &counters_.num_fragment_reclaims)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) {
        return done(h, AllocSource::kFragmentReclaim);
      }
    }
    if (options_.lms_enabled && max_source >= AllocSource::kFullReclaim &&
        reclaim(ChooseAllInactive(), &counters_.num_full_reclaims)) {
      h = find(true);
      if (h != BfcArena::kInvalidChunk) {
        return done(h, AllocSource::kFullReclaim);
      }
    }
    // The LMS limit is a soft threshold: once reclaim has done what it can,
    // physically free memory is used.
    if (max_source >= AllocSource::kFullReclaim || !progress) {
      h = find(false);
      if (h == BfcArena::kInvalidChunk && arena_->Extend(rounded)) {
        h = find(false);
      }
      if (h != BfcArena::kInvalidChunk) {
        return done(h, progress ? AllocSource::kFullReclaim
                                : AllocSource::kFree);
      }
    }
    if (!progress) {
      // Other threads' page-outs or moves hold the bytes we need; they free
      // them when their copies land.
      if (transitions_in_flight_ == 0) break;
      cv_.wait(lock);
    }
  }
  // The host pool is full, so nothing more can be paged out, yet the device
  // may still hold the request in bytes, split by inactive buffers. Moving
  // those within the device needs no host room, so even with
  // defragmentation off it is tried once before giving up: the alternative
  // is an out-of-memory error. Where every hole is smaller than the buffers
  // around it, no buffer finds a destination elsewhere (DefragFor), but
  // sliding them down within their run does (defrag.cc, SlideFor): UNet3D
  // at 480^3 on a GH200 with prefetch had 32.3 GB free, 11.7 GB at most in
  // one chunk, for a 14.2 GB output, with the 128 GiB pool full and five
  // 14.2 GB buffers around the holes.
  if (max_source >= AllocSource::kFullReclaim && HostRefused(host_status)) {
    size_t moved = 0;
    if (!options_.defrag_enabled) (void)DefragFor(lock, rounded, &moved);
    h = find(false);
    if (h == BfcArena::kInvalidChunk) {
      Status s = SlideFor(lock, rounded, &moved);
      if (!s.ok() && s.code() != Code::kResourceExhausted) {
        *status = s;  // a device fault: not an out-of-memory error
        return BfcArena::kInvalidChunk;
      }
      h = find(false);
    }
    if (h != BfcArena::kInvalidChunk) {
      ++counters_.num_host_full_defrags;
      return done(h, AllocSource::kDefrag);
    }
    // No slide makes the room either: what is on the host may come back
    // into chunks the request cannot use, so that the pool takes a victim
    // whose chunk holds it (exchange.cc).
    if (ExchangeForVictimLocked(lock, rounded, protect_until, &host_status)) {
      h = find(false);
      if (h != BfcArena::kInvalidChunk) {
        return done(h, AllocSource::kSingleReclaim);
      }
    }
  }
  // A prefetch that finds no room without costly reclaims gives up; that is
  // not an out-of-memory anyone sees.
  if (count_oom && max_source >= AllocSource::kFullReclaim) {
    ++counters_.num_ooms;
  }
  *status = ResourceExhausted(OutOfMemoryMessage(bytes, rounded, host_status));
  return BfcArena::kInvalidChunk;
}

void* Engine::Impl::AllocateRaw(size_t bytes, Status* status) {
  if (bytes == 0) {
    *status = InvalidArgument("allocation size must be positive");
    return nullptr;
  }
  if (RejectLargerThanDevice(bytes, status)) return nullptr;
  std::unique_lock<std::mutex> lock(mu_);
  BfcArena::ChunkHandle h =
      AllocateChunk(lock, bytes, nullptr, AllocSource::kFullReclaim, status);
  if (h == BfcArena::kInvalidChunk) return nullptr;
  *status = Status::Ok();
  return arena_->chunk(h)->ptr;
}

void Engine::Impl::DeallocateRaw(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  BfcArena::ChunkHandle h = arena_->HandleFor(ptr);
  if (h == BfcArena::kInvalidChunk || !arena_->chunk(h)->in_use() ||
      arena_->chunk(h)->owner != nullptr) {
    return;  // not a raw allocation of this engine: ignore, never corrupt
  }
  AddChunkBytes(nullptr, -static_cast<int64_t>(arena_->chunk(h)->size));
  if (fixed_) {
    ReleaseRangeFixed(arena_->chunk(h)->ptr, arena_->chunk(h)->size,
                      Release::kFreed);
  }
  arena_->FreeChunk(h, ReuseAfterNowLocked());
}

size_t Engine::Impl::RequestedSize(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  BfcArena::ChunkHandle h = arena_->HandleFor(ptr);
  return h == BfcArena::kInvalidChunk ? 0 : arena_->chunk(h)->requested_size;
}

size_t Engine::Impl::AllocatedSize(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  BfcArena::ChunkHandle h = arena_->HandleFor(ptr);
  return h == BfcArena::kInvalidChunk ? 0 : arena_->chunk(h)->size;
}

Buffer* Engine::Impl::AllocateBuffer(size_t bytes, bool pinned,
                                     Status* status, void** device_ptr) {
  if (bytes == 0) {
    *status = InvalidArgument("buffer size must be positive");
    return nullptr;
  }
  if (RejectLargerThanDevice(bytes, status)) return nullptr;
  std::unique_lock<std::mutex> lock(mu_);
  Buffer* b = NewBufferLocked();
  b->size = bytes;
  b->pin_count = pinned ? 1 : 0;
  b->id = next_buffer_id_++;
  BfcArena::ChunkHandle h =
      AllocateChunk(lock, bytes, b, AllocSource::kFullReclaim, status);
  if (h == BfcArena::kInvalidChunk) {
    RecycleBufferLocked(b);
    return nullptr;
  }
  b->chunk = h;
  if (fixed_) b->vchunk = h;
  b->device_ptr = arena_->chunk(h)->ptr;
  TrackBuffer(b);
  if (!b->active()) LruPush(b);
  NoteAllocationLocked(b);
  if (options_.prefetch_enabled) {
    NoteStepEventLocked(pinned ? StepEvent::kAllocPinned : StepEvent::kAlloc,
                        b);
  }
  if (device_ptr != nullptr) *device_ptr = b->device_ptr;
  *status = Status::Ok();
  return b;
}

void Engine::Impl::TrackBuffer(Buffer* b) {
  b->all_prev = nullptr;
  b->all_next = all_head_;
  if (all_head_ != nullptr) all_head_->all_prev = b;
  all_head_ = b;
  ++num_buffers_;
  if (options_.prefetch_enabled) by_id_.emplace(b->id, b);
}

void Engine::Impl::UntrackBuffer(Buffer* b) {
  if (b->all_prev != nullptr) {
    b->all_prev->all_next = b->all_next;
  } else {
    all_head_ = b->all_next;
  }
  if (b->all_next != nullptr) b->all_next->all_prev = b->all_prev;
  --num_buffers_;
  if (options_.prefetch_enabled) by_id_.erase(b->id);
}

void Engine::Impl::DestroyBufferLocked(Buffer* b) {
  ReleaseCleanCopyLocked(b);  // before b->ready is dropped below
  if (b->ready) {
    // A page-in into this chunk may still be landing and no kernel waited
    // for it; order the chunk's next user (on the compute stream) after it.
    device_->WaitEvent(device_->GetStream(StreamKind::kCompute), b->ready);
    b->ready.reset();
  }
  if (b->resident()) {
    if (b->in_lru) LruRemove(b);
    AddChunkBytes(b, -static_cast<int64_t>(arena_->chunk(b->chunk)->size));
    if (fixed_) {
      ReleaseRangeFixed(arena_->chunk(b->chunk)->ptr,
                        arena_->chunk(b->chunk)->size, Release::kFreed);
    }
    arena_->FreeChunk(b->chunk, ReuseAfterNowLocked());
    b->chunk = BfcArena::kInvalidChunk;
    b->vchunk = BfcArena::kInvalidChunk;
  } else if (b->vchunk != BfcArena::kInvalidChunk) {
    // Fixed-address mode: an evicted buffer still holds its addresses.
    DropEvictedRangeFixed(arena_->chunk(b->vchunk)->ptr,
                          arena_->chunk(b->vchunk)->size);
    arena_->FreeChunk(b->vchunk, ReuseAfterNowLocked());
    b->vchunk = BfcArena::kInvalidChunk;
  }
  if (b->host_ptr != nullptr) {
    counters_.current_bytes_reclaimed -= static_cast<int64_t>(b->host_bytes);
    host_pool_->Free(b->host_ptr);
    b->host_ptr = nullptr;
  }
  EndPrefetchLocked(b);
  ForgetBufferForPrefetch(b);
  UntrackBuffer(b);
  RecycleBufferLocked(b);
}

#if defined(__SANITIZE_ADDRESS__)
#define TFLMS_RECYCLE_BUFFERS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TFLMS_RECYCLE_BUFFERS 0
#endif
#endif
#ifndef TFLMS_RECYCLE_BUFFERS
#define TFLMS_RECYCLE_BUFFERS 1
#endif

Buffer* Engine::Impl::NewBufferLocked() {
  if (TFLMS_RECYCLE_BUFFERS && !spare_buffers_.empty()) {
    Buffer* b = spare_buffers_.back();
    spare_buffers_.pop_back();
    return b;
  }
  return new Buffer();
}

void Engine::Impl::RecycleBufferLocked(Buffer* b) {
  // Bounded: a burst of frees must not pin its peak of Buffer objects.
  constexpr size_t kMaxSpareBuffers = 4096;
  if (!TFLMS_RECYCLE_BUFFERS || spare_buffers_.size() >= kMaxSpareBuffers) {
    delete b;
    return;
  }
  *b = Buffer();  // drops its events; every field as new
  spare_buffers_.push_back(b);
}

Status Engine::Impl::FreeBuffer(Buffer* b) {
  if (b == nullptr) return InvalidArgument("buffer must not be null");
  std::unique_lock<std::mutex> lock(mu_);
  if (b->free_requested) {
    return FailedPrecondition("buffer " + std::to_string(b->id) +
                              " was already freed");
  }
  if (b->pin_count > 0) {
    return FailedPrecondition(
        "buffer " + std::to_string(b->id) + " is pinned " +
        std::to_string(b->pin_count) + " time(s); unpin it before freeing");
  }
  if (b->early_out) CancelEarlyPageOutLocked(b);
  if (b->state != BufferState::kResident &&
      b->state != BufferState::kReclaimed) {
    // A copy is in flight; the thread running it destroys the buffer when
    // the copy settles, so no byte is touched after this returns.
    b->free_requested = true;
    return Status::Ok();
  }
  DestroyBufferLocked(b);
  ReleaseSettledHostCopies(&lock, /*wait=*/false);
  cv_.notify_all();
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Engine: thin forwarding to Impl.

Engine::Engine(Device* device, const EngineOptions& options)
    : impl_(std::make_unique<Impl>(device, options)) {}
Engine::~Engine() = default;

Status Engine::Init() {
  Status s = impl_->Init();
  impl_->init_status_ = s;
  impl_->initialized_.store(s.ok(), std::memory_order_release);
  return s;
}

Status Engine::Impl::NotInitialized() const {
  return FailedPrecondition(
      "the LMS engine is not initialized (" + init_status_.ToString() +
      "); call Engine::Init() and use the engine only once it returned OK");
}

namespace {
bool Ready(const Engine::Impl& impl) {
  return impl.initialized_.load(std::memory_order_acquire);
}
}  // namespace
const EngineOptions& Engine::options() const { return impl_->options_; }
void* Engine::AllocateRaw(size_t bytes, Status* status) {
  if (!Ready(*impl_)) {
    *status = impl_->NotInitialized();
    return nullptr;
  }
  return impl_->AllocateRaw(bytes, status);
}
void Engine::DeallocateRaw(void* ptr) {
  if (Ready(*impl_)) impl_->DeallocateRaw(ptr);
}
size_t Engine::RequestedSize(const void* ptr) const {
  return Ready(*impl_) ? impl_->RequestedSize(ptr) : 0;
}
size_t Engine::AllocatedSize(const void* ptr) const {
  return Ready(*impl_) ? impl_->AllocatedSize(ptr) : 0;
}
Buffer* Engine::AllocateBuffer(size_t bytes, bool pinned, Status* status,
                               void** device_ptr) {
  if (!Ready(*impl_)) {
    *status = impl_->NotInitialized();
    return nullptr;
  }
  return impl_->AllocateBuffer(bytes, pinned, status, device_ptr);
}
Status Engine::FreeBuffer(Buffer* buffer) { return impl_->FreeBuffer(buffer); }
Status Engine::Pin(Buffer* buffer, void** device_ptr) {
  return impl_->Pin(buffer, device_ptr);
}
Status Engine::Unpin(Buffer* buffer) { return impl_->Unpin(buffer); }
void Engine::GatherForPins(Buffer* const* buffers, size_t n) {
  if (Ready(*impl_)) impl_->GatherForPins(buffers, n, Impl::GatherKind::kList);
}
void Engine::GatherForConcat(Buffer* const* buffers, size_t n) {
  if (Ready(*impl_)) impl_->GatherForPins(buffers, n, Impl::GatherKind::kConcat);
}
Status Engine::MarkUnmovable(Buffer* buffer, void** device_ptr) {
  return impl_->MarkUnmovable(buffer, device_ptr);
}
Status Engine::ReadBuffer(Buffer* buffer, size_t offset, void* dst,
                          size_t bytes) {
  return impl_->Access(buffer, offset, dst, bytes, /*write=*/false);
}
Status Engine::WriteBuffer(Buffer* buffer, size_t offset, const void* src,
                           size_t bytes) {
  return impl_->Access(buffer, offset, const_cast<void*>(src), bytes,
                       /*write=*/true);
}
size_t Engine::BufferSize(const Buffer* buffer) const { return buffer->size; }
BufferState Engine::GetBufferState(const Buffer* buffer) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return buffer->state;
}
int Engine::PinCount(const Buffer* buffer) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return buffer->pin_count;
}
Status Engine::ReclaimInactive(size_t* bytes) {
  *bytes = 0;
  if (!Ready(*impl_)) return impl_->NotInitialized();
  return impl_->ReclaimInactive(bytes);
}
Status Engine::Defragment(size_t* bytes_moved) {
  *bytes_moved = 0;
  if (!Ready(*impl_)) return impl_->NotInitialized();
  return impl_->Defragment(bytes_moved);
}
void Engine::StepBegin() { impl_->StepBegin(); }
void Engine::NoteStepId(int64_t step_id) { impl_->NoteStepId(step_id); }
void Engine::NoteAllocationSite(uint64_t site) {
  impl_->NoteAllocationSite(site);
}
Status Engine::SetLmsLimit(size_t bytes) { return impl_->SetLmsLimit(bytes); }
EngineStats Engine::GetStats() const {
  return Ready(*impl_) ? impl_->GetStats() : EngineStats();
}
void Engine::ClearStats() {
  if (Ready(*impl_)) impl_->ClearStats();
}
void Engine::GetFreeSpace(size_t* largest_free, size_t* total_free) const {
  *largest_free = *total_free = 0;
  if (!Ready(*impl_)) return;
  std::lock_guard<std::mutex> lock(impl_->mu_);
  // In fixed-address mode: of the virtual range's regions.
  *largest_free = impl_->arena_->LargestFreeChunk();
  *total_free = impl_->arena_->TotalFreeBytes();
}
Status Engine::CheckInvariants() const {
  if (!Ready(*impl_)) return impl_->NotInitialized();
  return impl_->CheckInvariants();
}

}  // namespace tflms
