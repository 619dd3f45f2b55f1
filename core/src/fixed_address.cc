// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Fixed-address mode: buffers keep their address for life; physical pages
// come and go behind it (the foundation of the add-on for the stock
// TensorFlow wheel, whose tensors cannot change address).
//
// Layout. The BFC arena manages a reserved virtual range (Device::
// ReserveAddressRange, 4 x memory_limit by default) exactly as it manages
// device memory otherwise: 256-byte chunks, bins, coalescing. The physical
// budget is memory_limit / page_size pages. A page table (pages_) says, for
// every page of the range, how many resident allocations' chunks lie on it
// (`resident`), how many evicted buffers' chunks (`evicted`), and whether a
// physical page backs it (`mapped`).
//
// Page sharing: chunks are packed at 256 bytes as in normal mode, so chunks
// below a page share pages and any chunk may straddle a page boundary. A
// page is mapped while any resident chunk lies on it (reference counts);
// evicting a buffer unmaps only the pages no resident chunk shares. Hence a
// small evicted buffer whose page a resident neighbour shares keeps that
// page mapped (stale bytes, no fault) until the neighbour goes too; victim
// choice (ChoosePageVictims) therefore takes cold neighbours together. The
// alternative, rounding chunks to whole pages, wastes up to a page per
// allocation; docs/design.md records the measured waste of both.
//
// Invariants (hold whenever mu_ is held):
//   * resident > 0 implies mapped; mapped_pages_ <= budget_pages_;
//   * a page is exactly one of free, evicted, in use, cached (Classify) and
//     page_count_ counts each class;
//   * `resident` and `evicted` equal what the arena's chunks say: a resident
//     buffer's or raw allocation's chunk adds 1 to `resident` of each page it
//     touches, an evicted buffer's chunk 1 to `evicted` (CheckPagesLocked).
// Safety of unmapping (unmapping does not wait for streams):
//   * a page is unmapped only if every free that touched it is known to be
//     complete on the device: frees are numbered (free_seq_), and synced_seq_
//     advances when a compute-stream event recorded after those frees has
//     completed -- either the last-use event of a buffer whose page-out copy
//     was synchronized (its D2H copy waited for it; it was recorded after
//     free_seq_ was read when its epoch closed, NoteEpochCompleteLocked), or
//     an event that TrimCachedPages records and waits for;
//   * an evicted buffer's pages are unmapped only after the D2H copy of its
//     bytes (ordered after its last use and after the copy that filled it)
//     has been synchronized without error. A failed copy, or a failed first
//     unmap, leaves the buffer resident with every byte in place.
// Freed pages stay mapped ("cached") so the next allocation there needs no
// map call; they are unmapped only when an allocation or page-in needs
// pages, before any buffer is evicted. Mapping happens under mu_ (it is a
// driver call, not a wait); waits for events release mu_ as everywhere.
#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>

#include "engine_impl.h"

namespace tflms {
namespace {

// The ladder gives up after this many rounds (as in engine.cc).
constexpr int kMaxFixedRounds = 64;

// Regions of the virtual range for the arena: first fit over page-aligned
// pieces (so that regions never share a page with each other's tails in a
// way the page table could not describe: they may, harmlessly). Called only
// by the arena, whose owner serialises it (mu_).
class VirtualSubAllocator : public SubAllocator {
 public:
  VirtualSubAllocator(char* base, size_t bytes, size_t page)
      : base_(base), page_(page) {
    free_[0] = bytes;
  }
  void* Alloc(size_t bytes, size_t) override {
    const size_t need = RoundUp(bytes);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const size_t offset = it->first;
      const size_t rest = it->second - need;
      free_.erase(it);
      if (rest > 0) free_[offset + need] = rest;
      return base_ + offset;
    }
    return nullptr;
  }
  void Free(void* ptr, size_t bytes) override {
    size_t offset = static_cast<size_t>(static_cast<char*>(ptr) - base_);
    size_t size = RoundUp(bytes);
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + size) {
      size += next->second;
      free_.erase(next);
    }
    auto it = free_.lower_bound(offset);
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == offset) {
        prev->second += size;
        return;
      }
    }
    free_[offset] = size;
  }

 private:
  size_t RoundUp(size_t b) const { return (b + page_ - 1) / page_ * page_; }
  char* const base_;
  const size_t page_;
  std::map<size_t, size_t> free_;  // offset -> bytes
};

}  // namespace

// Applies `f` to page i, keeping the class counts exact.
template <typename F>
static void UpdatePage(Engine::Impl* e, size_t i, F f) {
  Engine::Impl::Page& p = e->pages_[i];
  const Engine::Impl::PageClass before = Engine::Impl::Classify(p);
  f(p);
  const Engine::Impl::PageClass after = Engine::Impl::Classify(p);
  --e->page_count_[before];
  ++e->page_count_[after];
  e->mapped_pages_ = e->page_count_[Engine::Impl::kPageInUse] +
                     e->page_count_[Engine::Impl::kPageCached];
}

Status Engine::Impl::InitFixed() {
  const size_t granularity = device_->VmGranularity();
  if (granularity == 0) {
    void* base = nullptr;
    Status s = device_->ReserveAddressRange(0, 0, &base);
    return s.ok() ? Unimplemented("device has no virtual memory management")
                  : s;
  }
  page_size_ = options_.page_size;
  if (page_size_ == 0 || page_size_ % granularity != 0) {
    return InvalidArgument("page_size must be a positive multiple of the "
                           "device's mapping granularity of " +
                           std::to_string(granularity) + " bytes, got " +
                           std::to_string(page_size_));
  }
  budget_pages_ = options_.memory_limit / page_size_;
  if (budget_pages_ == 0) {
    return InvalidArgument("memory_limit of " +
                           std::to_string(options_.memory_limit) +
                           " bytes holds no page of " +
                           std::to_string(page_size_) + " bytes");
  }
  const size_t budget_bytes = budget_pages_ * page_size_;
  vbytes_ = options_.virtual_address_bytes == 0
                ? 4 * budget_bytes
                : (options_.virtual_address_bytes + page_size_ - 1) /
                      page_size_ * page_size_;
  if (vbytes_ < budget_bytes) {
    return InvalidArgument("virtual_address_bytes must be at least "
                           "memory_limit");
  }
  void* base = nullptr;
  TFLMS_RETURN_IF_ERROR(device_->ReserveAddressRange(vbytes_, page_size_,
                                                      &base));
  vbase_ = static_cast<char*>(base);
  pages_.assign(vbytes_ / page_size_, Page());
  page_count_[kPageFree] = pages_.size();
  // Nothing may move in this mode, and nothing needs to: any physical page
  // backs any address, so physical fragmentation does not exist, and the
  // virtual range is several times the device.
  options_.defrag_enabled = false;
  device_sub_ = std::make_unique<VirtualSubAllocator>(vbase_, vbytes_,
                                                      page_size_);
  BfcArena::Options arena_options;
  arena_options.memory_limit = vbytes_;
  // Regions are carved from the range on demand whatever allow_growth says:
  // physical memory is mapped per page anyway, and a single region of the
  // whole range would cost the arena's per-256-byte handle table for it all.
  arena_options.allow_growth = true;
  // TensorFlow's split rule leaves a chunk under twice the request (and less
  // than 128 MiB over it) whole, to spare device memory a sliver it could not
  // use. Here the padding would cost mapped pages, which are the device
  // memory: a 512 KiB tensor in an 832 KiB chunk mapped 832 KiB, and ran
  // the tfcpu host_exchange case out of memory. A virtual sliver costs only
  // address space, of which there is several times the device.
  arena_options.split_always = true;
  arena_options.fragmentation_fraction = options_.fragmentation_fraction;
  arena_ = std::make_unique<BfcArena>(device_sub_.get(), arena_options);
  return Status::Ok();
}

Status Engine::Impl::ReleaseRangeFixed(const char* ptr, size_t size,
                                       Release how) {
  size_t lo, hi;
  PageSpan(ptr, size, &lo, &hi);
  if (how == Release::kFreed || how == Release::kEvictedKeepMapped) {
    ++free_seq_;
    const bool evicted = how == Release::kEvictedKeepMapped;
    for (size_t i = lo; i < hi; ++i) {
      UpdatePage(this, i, [&](Page& p) {
        --p.resident;
        if (evicted) ++p.evicted;
        p.last_free_seq = free_seq_;
      });
    }
    return Status::Ok();
  }
  // kEvicted: unmap the pages that this chunk alone keeps resident, in runs
  // (only the first and last page can be shared, so it is one run unless a
  // page waits for a free to complete).
  std::vector<bool> unmapped(hi - lo, false);
  bool first_call = true;
  for (size_t i = lo; i < hi;) {
    auto can = [&](size_t j) {
      return pages_[j].resident == 1 && pages_[j].last_free_seq <= synced_seq_;
    };
    if (!can(i)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < hi && can(j)) ++j;
    Status s = device_->UnmapPages(vbase_ + i * page_size_,
                                   (j - i) * page_size_);
    if (!s.ok()) {
      ++counters_.num_map_failures;
      // Nothing unmapped yet: the caller keeps the buffer resident. Later
      // failures leave those pages mapped (cached; trimmed later): the bytes
      // are safe on the host already.
      if (first_call) return s;
      break;
    }
    first_call = false;
    counters_.num_pages_unmapped += static_cast<int64_t>(j - i);
    for (size_t k = i; k < j; ++k) unmapped[k - lo] = true;
    i = j;
  }
  for (size_t i = lo; i < hi; ++i) {
    UpdatePage(this, i, [&](Page& p) {
      --p.resident;
      ++p.evicted;
      if (unmapped[i - lo]) p.mapped = false;
    });
  }
  return Status::Ok();
}

void Engine::Impl::DropEvictedRangeFixed(const char* ptr, size_t size) {
  size_t lo, hi;
  PageSpan(ptr, size, &lo, &hi);
  for (size_t i = lo; i < hi; ++i) {
    UpdatePage(this, i, [](Page& p) { --p.evicted; });
  }
}

size_t Engine::Impl::TrimCachedPages(std::unique_lock<std::mutex>& lock,
                                     size_t want, size_t lo, size_t hi,
                                     Status* status) {
  std::vector<size_t> candidates;
  bool need_sync = false;
  // Safe pages first, then those a recent free may still be used by.
  for (int pass = 0; pass < 2 && candidates.size() < want; ++pass) {
    for (size_t i = 0; i < pages_.size() && candidates.size() < want; ++i) {
      if (i >= lo && i < hi) continue;
      if (Classify(pages_[i]) != kPageCached) continue;
      const bool safe = pages_[i].last_free_seq <= synced_seq_;
      if (safe != (pass == 0)) continue;
      candidates.push_back(i);
      if (!safe) need_sync = true;
    }
  }
  if (need_sync) {
    // Work enqueued before those frees may still read the pages: wait for
    // everything on the compute stream up to now (mu_ released).
    const uint64_t seq = free_seq_;
    Status s;
    EventRef e =
        device_->RecordEvent(device_->GetStream(StreamKind::kCompute), &s);
    ++transitions_in_flight_;
    lock.unlock();
    if (e) s = device_->SynchronizeEvent(e);
    lock.lock();
    --transitions_in_flight_;
    if (s.ok()) {
      synced_seq_ = std::max(synced_seq_, seq);
    } else {
      *status = s;
    }
  }
  std::sort(candidates.begin(), candidates.end());
  size_t done = 0;
  // Re-check: another thread may have taken, trimmed or freed them again.
  auto ok = [&](size_t i) {
    return Classify(pages_[i]) == kPageCached &&
           pages_[i].last_free_seq <= synced_seq_;
  };
  for (size_t k = 0; k < candidates.size();) {
    if (!ok(candidates[k])) {
      ++k;
      continue;
    }
    size_t m = k + 1;
    while (m < candidates.size() && candidates[m] == candidates[m - 1] + 1 &&
           ok(candidates[m])) {
      ++m;
    }
    const size_t first = candidates[k];
    const size_t n = m - k;
    Status s = device_->UnmapPages(vbase_ + first * page_size_, n * page_size_);
    if (!s.ok()) {
      ++counters_.num_map_failures;
      *status = s;
      break;
    }
    counters_.num_pages_unmapped += static_cast<int64_t>(n);
    for (size_t i = first; i < first + n; ++i) {
      UpdatePage(this, i, [](Page& p) { p.mapped = false; });
    }
    done += n;
    k = m;
  }
  cv_.notify_all();
  return done;
}

std::vector<Buffer*> Engine::Impl::ChoosePageVictims(size_t deficit,
                                                     size_t lo, size_t hi,
                                                     size_t protect_until,
                                                     size_t max_victims) {
  const bool learned = FollowingLearnedOrder();
  // Pages each victim would free, given the victims chosen before it.
  std::unordered_map<size_t, int32_t> dec;
  auto gain_of = [&](const Buffer* b) {
    const BfcArena::Chunk* c = arena_->chunk(b->chunk);
    size_t blo, bhi;
    PageSpan(c->ptr, c->size, &blo, &bhi);
    size_t gain = 0;
    for (size_t p = blo; p < bhi; ++p) {
      if (p >= lo && p < hi) continue;  // the request keeps those
      auto it = dec.find(p);
      const int32_t d = it == dec.end() ? 0 : it->second;
      if (pages_[p].resident - d == 1) ++gain;
    }
    return gain;
  };
  auto eligible = [&](const Buffer* b) {
    if (!Reclaimable(b)) return false;
    return !(learned && protect_until != 0 && NextUse(b) <= protect_until);
  };
  // One victim that frees enough on its own: one copy.
  for (Buffer* b = lru_head_; b != nullptr; b = b->lru_next) {
    if (eligible(b) && gain_of(b) >= deficit) return {b};
  }
  if (max_victims <= 1) return {};
  // Otherwise the least recently used that together free enough. A page is
  // freed once every resident chunk on it is a victim, so a victim that frees
  // nothing alone may free pages together with its neighbours (chunks packed
  // at 256 bytes straddle page boundaries): count pages as the set grows, then
  // drop the victims none of whose pages ended up freed.
  std::vector<Buffer*> victims;
  size_t freed = 0;
  for (Buffer* b = lru_head_; b != nullptr && freed < deficit;
       b = b->lru_next) {
    if (!eligible(b)) continue;
    const BfcArena::Chunk* c = arena_->chunk(b->chunk);
    size_t blo, bhi;
    PageSpan(c->ptr, c->size, &blo, &bhi);
    for (size_t p = blo; p < bhi; ++p) {
      if (++dec[p] == pages_[p].resident && (p < lo || p >= hi)) ++freed;
    }
    victims.push_back(b);
  }
  if (freed < deficit) return {};  // evicting all would not do
  std::vector<Buffer*> useful;
  for (Buffer* b : victims) {
    const BfcArena::Chunk* c = arena_->chunk(b->chunk);
    size_t blo, bhi;
    PageSpan(c->ptr, c->size, &blo, &bhi);
    for (size_t p = blo; p < bhi; ++p) {
      if (dec[p] == pages_[p].resident && (p < lo || p >= hi)) {
        useful.push_back(b);
        break;
      }
    }
  }
  return useful;
}

Status Engine::Impl::MakeResidentFixed(std::unique_lock<std::mutex>& lock,
                                       char* ptr, size_t size,
                                       bool from_evicted,
                                       AllocSource max_source,
                                       size_t protect_until,
                                       AllocSource* source) {
  *source = AllocSource::kFree;
  size_t lo, hi;
  PageSpan(ptr, size, &lo, &hi);
  // The LMS limit, in pages, is soft as in normal mode.
  size_t cap = budget_pages_;
  if (options_.lms_enabled && lms_limit_ < options_.memory_limit) {
    cap = std::max<size_t>(1, lms_limit_ / page_size_);
  }
  Status last_error;
  for (int round = 0; round < kMaxFixedRounds; ++round) {
    size_t need = 0;
    for (size_t i = lo; i < hi; ++i) need += pages_[i].mapped ? 0 : 1;
    if (mapped_pages_ + need <= cap) {
      // Map the unmapped runs; all or nothing.
      std::vector<std::pair<size_t, size_t>> runs;
      Status s;
      for (size_t i = lo; i < hi && s.ok();) {
        if (pages_[i].mapped) {
          ++i;
          continue;
        }
        size_t j = i;
        while (j < hi && !pages_[j].mapped) ++j;
        s = device_->MapPages(vbase_ + i * page_size_, (j - i) * page_size_);
        if (s.ok()) runs.emplace_back(i, j);
        i = j;
      }
      if (!s.ok()) {
        ++counters_.num_map_failures;
        // Nothing was enqueued on the pages this call mapped.
        for (const auto& r : runs) {
          device_->UnmapPages(vbase_ + r.first * page_size_,
                              (r.second - r.first) * page_size_);
        }
        return s;
      }
      for (const auto& r : runs) {
        counters_.num_pages_mapped += static_cast<int64_t>(r.second - r.first);
      }
      for (size_t i = lo; i < hi; ++i) {
        UpdatePage(this, i, [&](Page& p) {
          p.mapped = true;
          ++p.resident;
          if (from_evicted) --p.evicted;
        });
      }
      peak_mapped_bytes_ = std::max(
          peak_mapped_bytes_, static_cast<int64_t>(mapped_pages_ * page_size_));
      return Status::Ok();
    }
    const size_t deficit = mapped_pages_ + need - cap;
    bool progress = false;
    // 1. Cached pages (freed, still mapped): no copy at all.
    if (page_count_[kPageCached] > 0) {
      Status s;
      if (TrimCachedPages(lock, deficit, lo, hi, &s) > 0) progress = true;
      if (!s.ok()) last_error = s;
    }
    // 2. Evict: one buffer that frees enough, else the least recently used.
    if (!progress && options_.lms_enabled &&
        max_source >= AllocSource::kSingleReclaim) {
      const size_t max_victims =
          max_source >= AllocSource::kFullReclaim ? SIZE_MAX : 1;
      std::vector<Buffer*> victims =
          ChoosePageVictims(deficit, lo, hi, protect_until, max_victims);
      if (!victims.empty()) {
        const bool single = victims.size() == 1;
        size_t reclaimed = 0;
        Status s = PageOut(lock, victims, &reclaimed);
        if (!s.ok()) last_error = s;
        if (reclaimed > 0) {
          progress = true;
          ++(single ? counters_.num_single_reclaims
                    : counters_.num_full_reclaims);
          *source = single ? AllocSource::kSingleReclaim
                           : AllocSource::kFullReclaim;
        } else {
          ++counters_.num_reclaim_failures;
        }
      }
    }
    if (!progress) {
      if (cap < budget_pages_) {  // the limit is soft
        cap = budget_pages_;
        continue;
      }
      if (transitions_in_flight_ == 0) break;
      cv_.wait(lock);
    }
  }
  size_t need = 0;
  for (size_t i = lo; i < hi; ++i) need += pages_[i].mapped ? 0 : 1;
  std::string m =
      "Out of memory on " + options_.name + " making " + std::to_string(size) +
      " bytes resident at a fixed address: " + std::to_string(need) +
      " more page(s) of " + std::to_string(page_size_) + " bytes needed; " +
      std::to_string(mapped_pages_) + " of " + std::to_string(budget_pages_) +
      " pages mapped (" + std::to_string(page_count_[kPageInUse]) +
      " in use, " + std::to_string(page_count_[kPageCached]) +
      " cached); " + std::to_string(bytes_active_) + " bytes active, " +
      std::to_string(bytes_inactive_) + " inactive.";
  if (!last_error.ok()) m += " " + last_error.message();
  if (!options_.lms_enabled && bytes_inactive_ > 0) {
    m += " Enabling Large Model Support "
         "(tf.config.experimental.set_lms_enabled(True)) may avoid this.";
  }
  return ResourceExhausted(m);
}

BfcArena::ChunkHandle Engine::Impl::AllocateChunkFixed(
    std::unique_lock<std::mutex>& lock, size_t bytes, Buffer* owner,
    AllocSource max_source, Status* status, size_t protect_until) {
  const size_t rounded = BfcArena::RoundedBytes(bytes);
  // The virtual chunk first; it is owned by claiming_tag_ until its pages
  // are mapped, since mu_ may be released meanwhile.
  BfcArena::ChunkHandle h = arena_->FindChunk(rounded, bytes, &claiming_tag_);
  if (h == BfcArena::kInvalidChunk && arena_->Extend(rounded)) {
    h = arena_->FindChunk(rounded, bytes, &claiming_tag_);
  }
  if (h == BfcArena::kInvalidChunk && options_.garbage_collection &&
      arena_->DeallocateFreeRegions(rounded) && arena_->Extend(rounded)) {
    h = arena_->FindChunk(rounded, bytes, &claiming_tag_);
  }
  if (h == BfcArena::kInvalidChunk) {
    ++counters_.num_ooms;
    *status = ResourceExhausted(
        "Out of memory on " + options_.name + " allocating " +
        std::to_string(bytes) + " bytes: the virtual address range of " +
        std::to_string(vbytes_) +
        " bytes is exhausted (it holds resident and evicted buffers alike; "
        "raise virtual_address_bytes)");
    return BfcArena::kInvalidChunk;
  }
  AllocSource source;
  Status s = MakeResidentFixed(lock, arena_->chunk(h)->ptr,
                               arena_->chunk(h)->size, /*from_evicted=*/false,
                               max_source, protect_until, &source);
  if (!s.ok()) {
    arena_->FreeChunk(h, ReuseAfterNowLocked());
    if (s.code() == Code::kResourceExhausted) ++counters_.num_ooms;
    *status = s;
    return BfcArena::kInvalidChunk;
  }
  arena_->chunk(h)->owner = owner;
  CountSource(source);
  AddChunkBytes(owner, static_cast<int64_t>(arena_->chunk(h)->size));
  return h;
}

Status Engine::Impl::CheckPagesLocked() const {
  std::vector<int32_t> resident(pages_.size(), 0), evicted(pages_.size(), 0);
  bool ok = true;
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (!c->in_use() || c->owner == &claiming_tag_) continue;
      const Buffer* b = static_cast<const Buffer*>(c->owner);
      size_t lo, hi;
      PageSpan(c->ptr, c->size, &lo, &hi);
      const bool is_resident = b == nullptr || b->resident();
      if (b != nullptr && b->vchunk != h) ok = false;
      for (size_t i = lo; i < hi; ++i) {
        ++(is_resident ? resident[i] : evicted[i]);
      }
    }
  });
  if (!ok) return Internal("a buffer's virtual chunk is not its own");
  size_t count[4] = {0, 0, 0, 0};
  for (size_t i = 0; i < pages_.size(); ++i) {
    const Page& p = pages_[i];
    if (p.resident != resident[i] || p.evicted != evicted[i]) {
      return Internal("page " + std::to_string(i) + " counts " +
                      std::to_string(p.resident) + " resident and " +
                      std::to_string(p.evicted) + " evicted chunk(s); the " +
                      "arena says " + std::to_string(resident[i]) + " and " +
                      std::to_string(evicted[i]));
    }
    if (p.resident > 0 && !p.mapped) {
      return Internal("page " + std::to_string(i) +
                      " holds a resident chunk but is not mapped");
    }
    ++count[Classify(p)];
  }
  for (int k = 0; k < 4; ++k) {
    if (count[k] != page_count_[k]) return Internal("page classes drifted");
  }
  if (mapped_pages_ != count[kPageInUse] + count[kPageCached] ||
      mapped_pages_ > budget_pages_) {
    return Internal("mapped pages " + std::to_string(mapped_pages_) +
                    " inconsistent or above the budget of " +
                    std::to_string(budget_pages_));
  }
  if (resident_bytes_ > static_cast<int64_t>(count[kPageInUse] * page_size_)) {
    return Internal("resident bytes exceed the pages in use");
  }
  return Status::Ok();
}

void Engine::Impl::FillFixedStats(EngineStats* s) const {
  const int64_t ps = static_cast<int64_t>(page_size_);
  s->bytes_in_use = resident_bytes_;
  s->peak_bytes_in_use = peak_resident_bytes_;
  s->bytes_reserved = static_cast<int64_t>(mapped_pages_) * ps;
  s->peak_bytes_reserved = peak_mapped_bytes_;
  s->bytes_limit = static_cast<int64_t>(options_.memory_limit);
  s->bytes_reservable_limit = s->bytes_limit;
  s->page_size = ps;
  s->physical_bytes_in_use = static_cast<int64_t>(page_count_[kPageInUse]) * ps;
  s->physical_bytes_cached =
      static_cast<int64_t>(page_count_[kPageCached]) * ps;
  s->physical_bytes_free =
      static_cast<int64_t>(budget_pages_ - mapped_pages_) * ps;
  s->physical_bytes_evicted =
      static_cast<int64_t>(page_count_[kPageEvicted]) * ps;
  s->virtual_bytes_reserved = static_cast<int64_t>(vbytes_);
  s->virtual_bytes_in_use = static_cast<int64_t>(arena_->bytes_in_use());
}

}  // namespace tflms
