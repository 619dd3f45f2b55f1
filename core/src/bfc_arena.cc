// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// BfcArena: see bfc_arena.h for the invariants. The algorithm follows
// tsl::BFCAllocator step for step; where a choice looks arbitrary (the 2x
// split rule, the 0.9 back-off, doubling region sizes) it is TensorFlow's,
// kept so the engine with LMS off fails and peaks exactly where TF does.
#include "bfc_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cstring>

namespace tflms {
namespace {

// TensorFlow tolerates up to 128 MiB of padding in a chunk before it splits.
constexpr size_t kDefaultMaxInternalFragmentation = size_t{128} << 20;
// TensorFlow starts growing regions at 2 MiB with allow_growth.
constexpr size_t kInitialGrowthRegion = size_t{2} << 20;
constexpr float kBackpedalFactor = 0.9f;

int Log2Floor(uint64_t v) { return 63 - __builtin_clzll(v); }

}  // namespace

static_assert(BfcArena::kInvalidChunk + 1 == 0,
              "HandleTable stores handles plus one, kInvalidChunk as zero");

// Anonymous mappings are zero and the kernel backs their pages on first
// touch. MAP_NORESERVE keeps Linux's heuristic overcommit from refusing a
// table larger than the machine's memory (a 14 TB what-if device in the
// planner), most of which no chunk ever touches.
BfcArena::HandleTable::HandleTable(size_t n) {
  if (n == 0) return;
  const size_t bytes = n * sizeof(ChunkHandle);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return;
  slots_.get_deleter().bytes = bytes;
  slots_.reset(static_cast<ChunkHandle*>(p));
}

void BfcArena::HandleTable::FreeSlots::operator()(ChunkHandle* p) const {
  munmap(p, bytes);
}

bool BfcArena::ChunkComparator::operator()(ChunkHandle a,
                                           ChunkHandle b) const {
  const Chunk* ca = arena_->chunk(a);
  const Chunk* cb = arena_->chunk(b);
  if (ca->size != cb->size) return ca->size < cb->size;
  return ca->ptr < cb->ptr;
}

BfcArena::BfcArena(SubAllocator* sub, const Options& options)
    : sub_(sub), options_(options) {
  curr_region_allocation_bytes_ =
      options.allow_growth
          ? RoundedBytes(std::min(options.memory_limit, kInitialGrowthRegion))
          : RoundedBytes(options.memory_limit);
  bins_.reserve(kNumBins);
  for (int i = 0; i < kNumBins; ++i) {
    bins_.emplace_back(ChunkComparator(this),
                       PoolAllocator<ChunkHandle>(&node_pool_));
  }
}

BfcArena::~BfcArena() {
  for (Region& r : regions_) sub_->Free(r.ptr, r.size);
}

void BfcArena::ClearStats() {
  num_allocs_ = 0;
  largest_alloc_size_ = 0;
  peak_bytes_in_use_ = bytes_in_use_;
  peak_bytes_reserved_ = total_region_allocated_bytes_;
}

size_t BfcArena::RoundedBytes(size_t bytes) {
  return (std::max(bytes, kMinAllocationSize) + kMinAllocationSize - 1) &
         ~(kMinAllocationSize - 1);
}

int BfcArena::BinNumForSize(size_t bytes) {
  uint64_t v = std::max(bytes, kMinAllocationSize) >> kMinAllocationBits;
  return std::min(kNumBins - 1, Log2Floor(v));
}

size_t BfcArena::MaxInternalFragmentation() const {
  if (options_.fragmentation_fraction > 0.0) {
    return static_cast<size_t>(options_.fragmentation_fraction *
                               static_cast<double>(options_.memory_limit));
  }
  return kDefaultMaxInternalFragmentation;
}

BfcArena::ChunkHandle BfcArena::AllocateChunkHandle() {
  if (free_chunk_handles_ != kInvalidChunk) {
    ChunkHandle h = free_chunk_handles_;
    free_chunk_handles_ = chunks_[h].next;
    chunks_[h] = Chunk();
    return h;
  }
  chunks_.emplace_back();
  return chunks_.size() - 1;
}

void BfcArena::DeallocateChunkHandle(ChunkHandle h) {
  chunks_[h] = Chunk();
  chunks_[h].next = free_chunk_handles_;
  free_chunk_handles_ = h;
}

BfcArena::Region* BfcArena::RegionFor(const void* ptr) {
  return const_cast<Region*>(
      static_cast<const BfcArena*>(this)->RegionFor(ptr));
}

const BfcArena::Region* BfcArena::RegionFor(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  auto it = std::upper_bound(
      regions_.begin(), regions_.end(), p,
      [](const char* q, const Region& r) { return q < r.end(); });
  if (it == regions_.end() || p < it->ptr) return nullptr;
  return &*it;
}

void BfcArena::SetHandle(const void* ptr, ChunkHandle h) {
  Region* r = RegionFor(ptr);
  assert(r != nullptr);
  size_t index =
      static_cast<size_t>(static_cast<const char*>(ptr) - r->ptr) >>
      kMinAllocationBits;
  r->handles.Set(index, h);
}

BfcArena::ChunkHandle BfcArena::HandleFor(const void* ptr) const {
  const Region* r = RegionFor(ptr);
  if (r == nullptr) return kInvalidChunk;
  size_t offset = static_cast<size_t>(static_cast<const char*>(ptr) - r->ptr);
  if (offset % kMinAllocationSize != 0) return kInvalidChunk;
  return r->handles[offset >> kMinAllocationBits];
}

bool BfcArena::Extend(size_t rounded) {
  size_t available = options_.memory_limit - total_region_allocated_bytes_;
  available = (available / kMinAllocationSize) * kMinAllocationSize;
  if (rounded > available) return false;

  bool increased_allocation = false;
  while (rounded > curr_region_allocation_bytes_) {
    curr_region_allocation_bytes_ *= 2;
    increased_allocation = true;
  }
  size_t bytes = std::min(curr_region_allocation_bytes_, available);
  void* mem = sub_->Alloc(bytes, kAlignment);
  // The device refused: back off by 10% at a time, as TensorFlow does, while
  // the request still fits.
  // (Rounding up can stop the shrinking near 1 KiB, where TensorFlow's loop
  // would spin forever; stop there instead.)
  while (mem == nullptr) {
    // TensorFlow multiplies in float (its factor is a float 0.9), which
    // after a few steps gives other sizes than double arithmetic would.
    const size_t smaller = RoundedBytes(
        static_cast<size_t>(static_cast<float>(bytes) * kBackpedalFactor));
    if (smaller < rounded || smaller >= bytes) break;
    bytes = smaller;
    mem = sub_->Alloc(bytes, kAlignment);
  }
  Region region;
  if (mem != nullptr) {
    region.handles = HandleTable(bytes >> kMinAllocationBits);
    if (!region.handles.ok()) {
      sub_->Free(mem, bytes);  // no host memory to index it
      mem = nullptr;
    }
  }
  device_refused_ = mem == nullptr;
  if (mem == nullptr) return false;
  if (!increased_allocation) curr_region_allocation_bytes_ *= 2;

  region.ptr = static_cast<char*>(mem);
  region.size = bytes;
  auto pos = std::upper_bound(
      regions_.begin(), regions_.end(), region.ptr,
      [](const char* q, const Region& r) { return q < r.ptr; });
  regions_.insert(pos, std::move(region));

  total_region_allocated_bytes_ += bytes;
  peak_bytes_reserved_ =
      std::max(peak_bytes_reserved_, total_region_allocated_bytes_);

  ChunkHandle h = AllocateChunkHandle();
  Chunk* c = chunk(h);
  c->ptr = static_cast<char*>(mem);
  c->size = bytes;
  SetHandle(c->ptr, h);
  InsertFreeChunkIntoBin(h);
  return true;
}

bool BfcArena::DeallocateFreeRegions(size_t rounded) {
  size_t free_bytes = 0;
  std::vector<bool> unused(regions_.size(), false);
  for (size_t i = 0; i < regions_.size(); ++i) {
    bool any_use = false;
    for (ChunkHandle h = regions_[i].handles[0]; h != kInvalidChunk;
         h = chunk(h)->next) {
      if (chunk(h)->in_use()) {
        any_use = true;
        break;
      }
    }
    if (!any_use) {
      unused[i] = true;
      free_bytes += regions_[i].size;
    }
  }
  if (free_bytes == 0) return false;
  if (rounded > options_.memory_limit - total_region_allocated_bytes_ +
                    free_bytes) {
    return false;
  }
  std::vector<Region> kept;
  kept.reserve(regions_.size());
  for (size_t i = 0; i < regions_.size(); ++i) {
    Region& r = regions_[i];
    if (!unused[i]) {
      kept.push_back(std::move(r));
      continue;
    }
    ChunkHandle h = r.handles[0];
    while (h != kInvalidChunk) {
      ChunkHandle next = chunk(h)->next;
      RemoveFreeChunkFromBin(h);
      DeallocateChunkHandle(h);
      h = next;
    }
    sub_->Free(r.ptr, r.size);
    total_region_allocated_bytes_ -= r.size;
  }
  regions_ = std::move(kept);
  return true;
}

void BfcArena::InsertFreeChunkIntoBin(ChunkHandle h) {
  Chunk* c = chunk(h);
  assert(!c->in_use() && c->bin_num == -1);
  int b = BinNumForSize(c->size);
  c->bin_num = b;
  bins_[b].insert(h);
  ++free_layout_version_;
}

void BfcArena::RemoveFreeChunkFromBin(ChunkHandle h) {
  Chunk* c = chunk(h);
  assert(!c->in_use() && c->bin_num != -1);
  size_t erased = bins_[c->bin_num].erase(h);
  (void)erased;
  assert(erased == 1);
  c->bin_num = -1;
  ++free_layout_version_;
}

void BfcArena::SplitChunk(ChunkHandle h, size_t num_bytes) {
  ChunkHandle h_new = AllocateChunkHandle();  // may move chunks_
  Chunk* c = chunk(h);
  Chunk* n = chunk(h_new);
  n->ptr = c->ptr + num_bytes;
  n->size = c->size - num_bytes;
  n->reuse_after = c->reuse_after;
  c->size = num_bytes;
  SetHandle(n->ptr, h_new);
  n->prev = h;
  n->next = c->next;
  c->next = h_new;
  if (n->next != kInvalidChunk) chunk(n->next)->prev = h_new;
  InsertFreeChunkIntoBin(h_new);
}

void BfcArena::Merge(ChunkHandle h1, ChunkHandle h2) {
  Chunk* c1 = chunk(h1);
  Chunk* c2 = chunk(h2);
  assert(!c1->in_use() && !c2->in_use() && c1->next == h2);
  c1->next = c2->next;
  if (c2->next != kInvalidChunk) chunk(c2->next)->prev = h1;
  c1->size += c2->size;
  c1->reuse_after = std::max(c1->reuse_after, c2->reuse_after);
  SetHandle(c2->ptr, kInvalidChunk);
  DeallocateChunkHandle(h2);
}

BfcArena::ChunkHandle BfcArena::TryToCoalesce(ChunkHandle h) {
  Chunk* c = chunk(h);
  if (c->next != kInvalidChunk && !chunk(c->next)->in_use()) {
    RemoveFreeChunkFromBin(c->next);
    Merge(h, c->next);
  }
  c = chunk(h);
  if (c->prev != kInvalidChunk && !chunk(c->prev)->in_use()) {
    ChunkHandle prev = c->prev;
    RemoveFreeChunkFromBin(prev);
    Merge(prev, h);
    h = prev;
  }
  return h;
}

bool BfcArena::ShouldSplit(size_t chunk_size, size_t rounded) const {
  if (options_.split_always) return chunk_size > rounded;
  return chunk_size >= rounded * 2 ||
         chunk_size - rounded >= MaxInternalFragmentation();
}

BfcArena::ChunkHandle BfcArena::MarkInUseHigh(ChunkHandle h, size_t rounded,
                                              size_t requested, void* owner) {
  if (chunk(h)->size > rounded) {
    // SplitChunk keeps `h` as the low part and files the high part as free;
    // swap the roles so the low part is what stays free.
    SplitChunk(h, chunk(h)->size - rounded);
    ChunkHandle high = chunk(h)->next;
    RemoveFreeChunkFromBin(high);
    InsertFreeChunkIntoBin(h);
    h = high;
  }
  return MarkInUse(h, rounded, requested, owner);
}

BfcArena::ChunkHandle BfcArena::MarkInUse(ChunkHandle h, size_t rounded,
                                          size_t requested, void* owner) {
  Chunk* c = chunk(h);
  if (ShouldSplit(c->size, rounded)) {
    SplitChunk(h, rounded);
    c = chunk(h);
  }
  c->requested_size = requested;
  c->allocation_id = next_allocation_id_++;
  c->owner = owner;
  if (owner != nullptr) owned_padding_ += c->size - RoundedBytes(requested);
  ++num_allocs_;
  bytes_in_use_ += c->size;
  peak_bytes_in_use_ = std::max(peak_bytes_in_use_, bytes_in_use_);
  largest_alloc_size_ = std::max(largest_alloc_size_, c->size);
  return h;
}

BfcArena::ChunkHandle BfcArena::FindChunk(size_t rounded, size_t requested,
                                          void* owner) {
  for (int b = BinNumForSize(rounded); b < kNumBins; ++b) {
    FreeChunkSet& bin = bins_[b];
    for (auto it = bin.begin(); it != bin.end(); ++it) {
      ChunkHandle h = *it;
      if (chunk(h)->size >= rounded) {
        bin.erase(it);
        chunk(h)->bin_num = -1;
        return MarkInUse(h, rounded, requested, owner);
      }
    }
  }
  return kInvalidChunk;
}

BfcArena::ChunkHandle BfcArena::TakeFreeChunk(ChunkHandle h, size_t rounded,
                                              size_t requested, void* owner) {
  assert(!chunk(h)->in_use() && chunk(h)->size >= rounded);
  RemoveFreeChunkFromBin(h);
  return MarkInUse(h, rounded, requested, owner);
}

BfcArena::ChunkHandle BfcArena::TakeFreeRange(const char* lo, size_t rounded,
                                              size_t requested, void* owner) {
  const Region* r = RegionFor(lo);
  if (r == nullptr || lo + rounded > r->end()) return kInvalidChunk;
  for (ChunkHandle h = r->handles[0]; h != kInvalidChunk; h = chunk(h)->next) {
    const Chunk* c = chunk(h);
    if (c->ptr > lo) break;
    if (c->ptr + c->size < lo + rounded) continue;
    if (c->in_use()) return kInvalidChunk;
    if (c->ptr == lo) {
      RemoveFreeChunkFromBin(h);
      // Always split: the rest of the chunk is the room this placement
      // keeps whole (MarkInUse's 2x rule would hand it out as padding).
      if (c->size > rounded) SplitChunk(h, rounded);
      return MarkInUse(h, rounded, requested, owner);
    }
    if (c->ptr + c->size == lo + rounded) {
      RemoveFreeChunkFromBin(h);
      return MarkInUseHigh(h, rounded, requested, owner);
    }
    return kInvalidChunk;
  }
  return kInvalidChunk;
}

BfcArena::ChunkHandle BfcArena::TakeFreeRangeInside(const char* lo,
                                                    size_t rounded,
                                                    size_t requested,
                                                    void* owner) {
  const Region* r = RegionFor(lo);
  if (r == nullptr || lo + rounded > r->end()) return kInvalidChunk;
  for (ChunkHandle h = r->handles[0]; h != kInvalidChunk; h = chunk(h)->next) {
    const Chunk* c = chunk(h);
    if (c->ptr > lo) return kInvalidChunk;
    if (c->ptr + c->size < lo + rounded) continue;
    if (c->in_use()) return kInvalidChunk;
    // Strictly inside: split off the part below, so that the range starts
    // a free chunk; TakeFreeRange takes ranges at either end itself.
    if (c->ptr < lo && c->ptr + c->size > lo + rounded) {
      const size_t below = static_cast<size_t>(lo - c->ptr);
      assert(below % kMinAllocationSize == 0);
      RemoveFreeChunkFromBin(h);
      SplitChunk(h, below);  // the part from `lo` on goes into a bin
      InsertFreeChunkIntoBin(h);
    }
    return TakeFreeRange(lo, rounded, requested, owner);
  }
  return kInvalidChunk;
}

void BfcArena::SlideDown(ChunkHandle below, ChunkHandle h) {
  Chunk* lo = chunk(below);
  Chunk* hi = chunk(h);
  assert(lo->in_use() && hi->in_use() && lo->next == h);
  SetHandle(hi->ptr, kInvalidChunk);
  std::swap(lo->size, hi->size);
  std::swap(lo->requested_size, hi->requested_size);
  std::swap(lo->allocation_id, hi->allocation_id);
  std::swap(lo->owner, hi->owner);
  hi->ptr = lo->ptr + lo->size;
  SetHandle(hi->ptr, h);
}

void BfcArena::Reown(ChunkHandle h, size_t requested, void* owner) {
  Chunk* c = chunk(h);
  assert(c->in_use() && RoundedBytes(requested) <= c->size);
  if (c->owner != nullptr) {
    owned_padding_ -= c->size - RoundedBytes(c->requested_size);
  }
  c->requested_size = requested;
  c->owner = owner;
  if (owner != nullptr) owned_padding_ += c->size - RoundedBytes(requested);
}

std::pair<const char*, const char*> BfcArena::SpanOf(ChunkHandle h) const {
  const Chunk* c = chunk(h);
  const char* lo = c->ptr;
  const char* hi = c->ptr + c->size;
  if (c->prev != kInvalidChunk && !chunk(c->prev)->in_use()) {
    lo = chunk(c->prev)->ptr;
  }
  if (c->next != kInvalidChunk && !chunk(c->next)->in_use()) {
    hi += chunk(c->next)->size;
  }
  return {lo, hi};
}

BfcArena::ChunkHandle BfcArena::FindFreeChunkOutside(size_t rounded,
                                                     const char* lo,
                                                     const char* hi) const {
  for (int b = BinNumForSize(rounded); b < kNumBins; ++b) {
    for (ChunkHandle h : bins_[b]) {
      const Chunk* c = chunk(h);
      if (c->size < rounded) continue;
      bool outside = c->ptr + c->size <= lo || c->ptr >= hi;
      if (outside) return h;
    }
  }
  return kInvalidChunk;
}

BfcArena::ChunkHandle BfcArena::FindLowestFreeChunkBelow(
    size_t rounded, const char* limit) const {
  ChunkHandle best = kInvalidChunk;
  for (int b = BinNumForSize(rounded); b < kNumBins; ++b) {
    for (ChunkHandle h : bins_[b]) {
      const Chunk* c = chunk(h);
      if (c->size < rounded || c->ptr + rounded > limit) continue;
      if (best == kInvalidChunk || c->ptr < chunk(best)->ptr) best = h;
    }
  }
  return best;
}

void BfcArena::FreeChunk(ChunkHandle h, uint64_t reuse_after) {
  Chunk* c = chunk(h);
  assert(c->in_use());
  c->reuse_after = std::max(c->reuse_after, reuse_after);
  bytes_in_use_ -= c->size;
  if (c->owner != nullptr) {
    owned_padding_ -= c->size - RoundedBytes(c->requested_size);
  }
  c->allocation_id = -1;
  c->requested_size = 0;
  c->owner = nullptr;
  InsertFreeChunkIntoBin(TryToCoalesce(h));
}

size_t BfcArena::TrimInUse(ChunkHandle h, size_t min_tail) {
  Chunk* c = chunk(h);
  assert(c->in_use());
  const size_t keep = RoundedBytes(c->requested_size);
  if (c->size <= keep || c->size - keep < min_tail) return 0;
  const size_t tail = c->size - keep;
  if (c->owner != nullptr) owned_padding_ -= tail;
  SplitChunk(h, keep);  // files the tail as free, not merged yet
  const ChunkHandle t = chunk(h)->next;
  RemoveFreeChunkFromBin(t);
  InsertFreeChunkIntoBin(TryToCoalesce(t));  // `h`, in use, stays apart
  bytes_in_use_ -= tail;
  return tail;
}

size_t BfcArena::LargestFreeChunk() const {
  for (int b = kNumBins - 1; b >= 0; --b) {
    if (!bins_[b].empty()) return chunk(*bins_[b].rbegin())->size;
  }
  return 0;
}

size_t BfcArena::LargestFreeAfterTaking(size_t rounded) const {
  ChunkHandle taken = kInvalidChunk;
  for (int b = BinNumForSize(rounded); b < kNumBins && taken == kInvalidChunk;
       ++b) {
    for (ChunkHandle h : bins_[b]) {
      if (chunk(h)->size >= rounded) {
        taken = h;
        break;
      }
    }
  }
  if (taken == kInvalidChunk) return 0;
  // The largest chunk other than the one taken, and what is left of it.
  size_t largest = chunk(taken)->size - rounded;
  for (int b = kNumBins - 1; b >= 0; --b) {
    for (auto it = bins_[b].rbegin(); it != bins_[b].rend(); ++it) {
      if (*it == taken) continue;
      return std::max(largest, chunk(*it)->size);
    }
  }
  return largest;
}

size_t BfcArena::TotalFreeBytes() const {
  return total_region_allocated_bytes_ - bytes_in_use_;
}

size_t BfcArena::CheckAndCountChunks(bool* ok) const {
  *ok = true;
  size_t count = 0, in_use = 0;
  for (const Region& r : regions_) {
    size_t covered = 0;
    bool prev_free = false;
    ChunkHandle prev = kInvalidChunk;
    for (ChunkHandle h = r.handles[0]; h != kInvalidChunk;
         h = chunk(h)->next) {
      const Chunk* c = chunk(h);
      ++count;
      if (c->prev != prev || c->ptr != r.ptr + covered) *ok = false;
      if (c->size % kMinAllocationSize != 0) *ok = false;
      if (!c->in_use() && prev_free) *ok = false;  // uncoalesced
      if (c->in_use() != (c->bin_num == -1)) *ok = false;
      if (c->in_use()) in_use += c->size;
      prev_free = !c->in_use();
      covered += c->size;
      prev = h;
    }
    if (covered != r.size) *ok = false;
  }
  if (in_use != bytes_in_use_) *ok = false;
  return count;
}

}  // namespace tflms
