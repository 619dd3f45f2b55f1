// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// BfcArena: the best-fit-with-coalescing mechanism of TensorFlow's
// tsl::BFCAllocator, without locking and without policy.
//
// Memory comes from a SubAllocator in regions. Each region is cut into
// chunks; adjacent chunks of a region are doubly linked in address order.
// Free chunks live in one of kNumBins bins, bin i holding chunks of
// [256 << i, 256 << (i+1)) bytes, each bin ordered by (size, address), so the
// first fitting chunk of the first non-empty bin is the best fit.
//
// Invariants kept by every method:
//   * chunks of a region tile it exactly: sum of sizes == region size;
//   * no two free chunks are adjacent (FreeChunk coalesces);
//   * a chunk is in a bin iff it is free;
//   * every size and address is a multiple of kMinAllocationSize (256);
//   * bytes_in_use == sum of sizes of in-use chunks;
//   * a byte's reuse_after never decreases while its region lives.
// These are the exact semantics of tsl::BFCAllocator (same rounding, same
// bins, same split rule, same region growth and back-off), so that with LMS
// off the engine fails and peaks where TensorFlow would.
//
// Thread safety: none. The owner serialises all calls (Engine::Impl::mu_,
// HostPool::mu_).
#ifndef TFLMS_CORE_SRC_BFC_ARENA_H_
#define TFLMS_CORE_SRC_BFC_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <vector>

namespace tflms {

class SubAllocator {
 public:
  virtual ~SubAllocator() = default;
  virtual void* Alloc(size_t bytes, size_t alignment) = 0;
  virtual void Free(void* ptr, size_t bytes) = 0;
};

class BfcArena {
 public:
  using ChunkHandle = size_t;
  static constexpr ChunkHandle kInvalidChunk = ~size_t{0};
  static constexpr int kMinAllocationBits = 8;
  static constexpr size_t kMinAllocationSize = size_t{1} << kMinAllocationBits;
  static constexpr int kNumBins = 21;
  static constexpr size_t kAlignment = 256;

  struct Chunk {
    size_t size = 0;            // bytes of the chunk (a multiple of 256)
    size_t requested_size = 0;  // bytes the client asked for
    int64_t allocation_id = -1; // -1 when free
    char* ptr = nullptr;
    ChunkHandle prev = kInvalidChunk;  // previous chunk in the region
    ChunkHandle next = kInvalidChunk;  // next chunk in the region
    int bin_num = -1;                  // bin while free, -1 while in use
    void* owner = nullptr;             // opaque owner of an in-use chunk
    // Opaque to the arena, kept for the owner: what must finish before
    // these bytes may be written from outside the stream that freed them.
    // Set by FreeChunk (never lowered); split chunks keep it, merged ones
    // take the larger. Not in tsl::BFCAllocator, whose users are all on the
    // stream that frees.
    uint64_t reuse_after = 0;
    bool in_use() const { return allocation_id != -1; }
  };

  struct Options {
    size_t memory_limit = 0;
    bool allow_growth = true;
    double fragmentation_fraction = 0.0;
    // Split every chunk larger than its request instead of following
    // TensorFlow's rule (see ShouldSplit). For pools whose placement no
    // device stream cares about, where a chunk's unused tail is only lost
    // capacity.
    bool split_always = false;
  };

  // `sub` is not owned and must outlive the arena.
  BfcArena(SubAllocator* sub, const Options& options);
  ~BfcArena();

  BfcArena(const BfcArena&) = delete;
  BfcArena& operator=(const BfcArena&) = delete;

  static size_t RoundedBytes(size_t bytes);
  static int BinNumForSize(size_t bytes);

  // Best-fit search; marks the chunk in use. kInvalidChunk when none fits.
  ChunkHandle FindChunk(size_t rounded, size_t requested, void* owner);
  // Grows the arena by one region able to hold `rounded` bytes.
  bool Extend(size_t rounded);
  // Returns every region without an in-use chunk to the sub-allocator, if
  // that together with the unreserved limit could hold `rounded` bytes
  // (TensorFlow's DeallocateFreeRegions). True if any region was returned.
  bool DeallocateFreeRegions(size_t rounded);
  // Frees an in-use chunk and coalesces it with free neighbours; the chunk's
  // reuse_after becomes at least `reuse_after`.
  void FreeChunk(ChunkHandle h, uint64_t reuse_after);
  // Gives back the tail of in-use chunk `h` beyond its rounded request (the
  // padding the split rule leaves, ShouldSplit) if it is at least
  // `min_tail` bytes: the tail becomes a free chunk, merged with a free
  // next chunk; `h` keeps its start, owner and request. Returns the bytes
  // freed. Only the caller knows that nothing reads or writes the tail.
  size_t TrimInUse(ChunkHandle h, size_t min_tail);
  // Takes the specific free chunk `h` for `rounded` bytes (splitting it as
  // FindChunk would). Used by defragmentation to choose destinations.
  ChunkHandle TakeFreeChunk(ChunkHandle h, size_t rounded, size_t requested,
                            void* owner);
  // Takes exactly [lo, lo + rounded) if a free chunk starts or ends there;
  // the rest of that chunk stays free (split whatever its size, so LMS's
  // placement keeps the room it chose). kInvalidChunk otherwise.
  ChunkHandle TakeFreeRange(const char* lo, size_t rounded, size_t requested,
                            void* owner);
  // As TakeFreeRange, and also where [lo, lo + rounded) lies strictly
  // inside a free chunk: the part below it stays a free chunk of its own.
  // For destinations planned before the chunks around them were freed and
  // merged (due_group.cc). `lo` must be 256-byte aligned.
  ChunkHandle TakeFreeRangeInside(const char* lo, size_t rounded,
                                  size_t requested, void* owner);
  // `below` and `h` are adjacent in-use chunks, `below` first. Moves `h`'s
  // allocation (size, request, id, owner) to the start of `below`, and
  // `below`'s to the rest of the pair, which `h` then names: the caller
  // has copied the bytes down and frees `h` next. Handles keep their order
  // in the region, so nothing else needs updating.
  void SlideDown(ChunkHandle below, ChunkHandle h);
  // Gives in-use chunk `h` to a new owner and request, in place (the chunk
  // keeps its address, size and allocation id): a buffer taking another's
  // chunk whose bytes it already holds (swap.cc). `requested` must round to
  // at most the chunk's size.
  void Reown(ChunkHandle h, size_t requested, void* owner);
  // [first, second): chunk `h` with its free neighbours, the room its
  // chunk becomes once freed (coalesced as FreeChunk would).
  std::pair<const char*, const char*> SpanOf(ChunkHandle h) const;
  // Smallest free chunk of at least `rounded` bytes lying wholly outside
  // [lo, hi). kInvalidChunk if none.
  ChunkHandle FindFreeChunkOutside(size_t rounded, const char* lo,
                                   const char* hi) const;

  // Lowest-addressed free chunk of at least `rounded` bytes that ends at or
  // below `limit`. kInvalidChunk if none.
  ChunkHandle FindLowestFreeChunkBelow(size_t rounded, const char* limit) const;

  Chunk* chunk(ChunkHandle h) { return &chunks_[h]; }
  const Chunk* chunk(ChunkHandle h) const { return &chunks_[h]; }
  // Handle of the chunk starting at `ptr`, kInvalidChunk if none.
  ChunkHandle HandleFor(const void* ptr) const;

  // Region walk in address order: calls f(first_chunk_handle) per region.
  template <typename F>
  void ForEachRegion(F f) const {
    for (const Region& r : regions_) f(r.handles[0]);
  }
  // Calls f(const Chunk&) for every in-use chunk that overlaps [lo, hi),
  // in address order.
  template <typename F>
  void ForEachInUseIn(const char* lo, const char* hi, F f) const {
    for (const Region& r : regions_) {
      for (ChunkHandle h = r.handles[0]; h != kInvalidChunk;
           h = chunks_[h].next) {
        const Chunk& c = chunks_[h];
        if (c.ptr >= hi) break;
        if (c.ptr + c.size > lo && c.in_use()) f(c);
      }
    }
  }

  size_t memory_limit() const { return options_.memory_limit; }
  size_t bytes_in_use() const { return bytes_in_use_; }
  size_t peak_bytes_in_use() const { return peak_bytes_in_use_; }
  size_t largest_alloc_size() const { return largest_alloc_size_; }
  // Padding (chunk size beyond the rounded request) of the in-use chunks
  // that have an owner: what TrimInUse could give back from them.
  size_t owned_padding() const { return owned_padding_; }
  size_t bytes_reserved() const { return total_region_allocated_bytes_; }
  size_t peak_bytes_reserved() const { return peak_bytes_reserved_; }
  // Whether the last Extend that got as far as asking for a region was
  // refused it (by the device, or for want of host memory to index it).
  bool device_refused() const { return device_refused_; }
  int64_t num_allocs() const { return num_allocs_; }
  // tsl::BFCAllocator::ClearStats, plus the reserved peak: num_allocs and
  // largest_alloc_size to 0, peaks to the current values.
  void ClearStats();
  size_t LargestFreeChunk() const;
  // The largest free chunk once FindChunk(rounded) took its best fit (0 if
  // nothing fits): what a later request could still get.
  size_t LargestFreeAfterTaking(size_t rounded) const;
  // Whether a free chunk of `chunk_size` bytes taken for `rounded` would be
  // split (FindChunk's rule), for models of the arena (layout_lookahead.cc).
  bool WouldSplit(size_t chunk_size, size_t rounded) const {
    return ShouldSplit(chunk_size, rounded);
  }
  size_t TotalFreeBytes() const;
  // Bumped whenever a chunk enters or leaves a bin, which every change of
  // the free chunks does: equal values mean the same free chunks, so a
  // model of them built at one still holds (layout_lookahead.cc).
  uint64_t free_layout_version() const { return free_layout_version_; }
  // Count of chunks (for invariant checks).
  size_t CheckAndCountChunks(bool* ok) const;

 private:
  // A region's chunk per 256-byte offset. Stored plus one, so that zeroed
  // memory means kInvalidChunk: mapped anonymously, it is backed by the
  // operating system only on the pages that chunk starts touch. TensorFlow
  // fills its table at once, which holds host memory of 1/32 of the region
  // for the process's life (4.4 GB for a 141 GB GPU), memory that LMS would
  // rather give reclaimed tensors; and a planner replay of a multi-terabyte
  // "unlimited" device ran a 24 GB machine out of memory.
  class HandleTable {
   public:
    HandleTable() = default;
    explicit HandleTable(size_t n);  // empty (!ok()) if memory ran out
    bool ok() const { return slots_ != nullptr; }
    ChunkHandle operator[](size_t i) const { return slots_[i] - 1; }
    void Set(size_t i, ChunkHandle h) { slots_[i] = h + 1; }

   private:
    struct FreeSlots {
      size_t bytes;  // of the mapping
      void operator()(ChunkHandle* p) const;
    };
    std::unique_ptr<ChunkHandle[], FreeSlots> slots_;
  };

  struct Region {
    char* ptr = nullptr;
    size_t size = 0;
    // handles[i] is the chunk starting at ptr + i * 256, or kInvalidChunk.
    HandleTable handles;
    char* end() const { return ptr + size; }
  };

  class ChunkComparator {
   public:
    explicit ChunkComparator(const BfcArena* arena) : arena_(arena) {}
    bool operator()(ChunkHandle a, ChunkHandle b) const;

   private:
    const BfcArena* arena_;
  };
  // Recycles the bins' tree nodes. Nearly every allocation and free inserts
  // or erases free chunks; a malloc and free per node cost about a sixth of
  // the time per allocate/free pair (TensorFlow's BFC pays it). Only the
  // arena's owner touches it (same serialisation as the arena).
  class NodePool {
   public:
    NodePool() = default;
    NodePool(const NodePool&) = delete;
    NodePool& operator=(const NodePool&) = delete;
    ~NodePool() {
      while (free_ != nullptr) {
        void* next = *static_cast<void**>(free_);
        ::operator delete(free_);
        free_ = next;
      }
    }
    void* Get(size_t bytes) {
      if (node_bytes_ == 0) node_bytes_ = bytes;
      if (bytes != node_bytes_ || free_ == nullptr) return ::operator new(bytes);
      void* p = free_;
      free_ = *static_cast<void**>(p);
      return p;
    }
    void Put(void* p, size_t bytes) {
      if (bytes != node_bytes_) {
        ::operator delete(p);
        return;
      }
      *static_cast<void**>(p) = free_;
      free_ = p;
    }

   private:
    size_t node_bytes_ = 0;  // std::set allocates one node size only
    void* free_ = nullptr;   // intrusive list of recycled nodes
  };
  template <typename T>
  struct PoolAllocator {
    using value_type = T;
    explicit PoolAllocator(NodePool* p) : pool(p) {}
    template <typename U>
    PoolAllocator(const PoolAllocator<U>& o) : pool(o.pool) {}  // NOLINT
    T* allocate(size_t n) { return static_cast<T*>(pool->Get(n * sizeof(T))); }
    void deallocate(T* p, size_t n) { pool->Put(p, n * sizeof(T)); }
    template <typename U>
    bool operator==(const PoolAllocator<U>& o) const { return pool == o.pool; }
    template <typename U>
    bool operator!=(const PoolAllocator<U>& o) const { return pool != o.pool; }
    NodePool* pool;
  };
  using FreeChunkSet =
      std::set<ChunkHandle, ChunkComparator, PoolAllocator<ChunkHandle>>;

  ChunkHandle AllocateChunkHandle();
  void DeallocateChunkHandle(ChunkHandle h);
  Region* RegionFor(const void* ptr);
  const Region* RegionFor(const void* ptr) const;
  void SetHandle(const void* ptr, ChunkHandle h);
  void InsertFreeChunkIntoBin(ChunkHandle h);
  void RemoveFreeChunkFromBin(ChunkHandle h);
  void SplitChunk(ChunkHandle h, size_t num_bytes);
  void Merge(ChunkHandle h1, ChunkHandle h2);
  ChunkHandle TryToCoalesce(ChunkHandle h);
  ChunkHandle MarkInUse(ChunkHandle h, size_t rounded, size_t requested,
                        void* owner);
  // Takes exactly the top `rounded` bytes of free chunk `h` (always split,
  // unlike MarkInUse), leaving the remainder below it free.
  ChunkHandle MarkInUseHigh(ChunkHandle h, size_t rounded, size_t requested,
                            void* owner);
  bool ShouldSplit(size_t chunk_size, size_t rounded) const;
  size_t MaxInternalFragmentation() const;

  SubAllocator* const sub_;
  const Options options_;
  size_t curr_region_allocation_bytes_;
  size_t total_region_allocated_bytes_ = 0;
  size_t peak_bytes_reserved_ = 0;
  bool device_refused_ = false;
  size_t bytes_in_use_ = 0;
  size_t peak_bytes_in_use_ = 0;
  size_t largest_alloc_size_ = 0;
  size_t owned_padding_ = 0;
  int64_t num_allocs_ = 0;
  int64_t next_allocation_id_ = 1;
  uint64_t free_layout_version_ = 0;

  std::vector<Chunk> chunks_;
  ChunkHandle free_chunk_handles_ = kInvalidChunk;  // intrusive via next
  std::vector<Region> regions_;                     // sorted by ptr
  NodePool node_pool_;  // declared before bins_, so it outlives them
  std::vector<FreeChunkSet> bins_;
};

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_BFC_ARENA_H_
