// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// HostPool: the pinned host memory that reclaimed bytes live in.
//
// A BfcArena over the device's page-locked host allocations, with a byte
// limit (TF_GPU_HOST_MEM_LIMIT_IN_MB inside TensorFlow). Pinned host
// allocation is slow on real drivers (cudaHostAlloc maps pages), so regions
// are kept and reused exactly as TensorFlow's gpu_host_bfc allocator does.
//
// A host copy is one chunk of the pool when a chunk can hold it. When none
// can although the pool's free bytes suffice (its chunks and regions split by
// earlier copies of other sizes), the copy is *scattered* over several
// chunks: its handle is the first piece's address and the pool keeps the
// list. 3D U-Net at 464^3 on an 80 GB A100 needed 12.8 GB with prefetch while
// 17.4 GB of its 137 GB pool were free, none of it in one piece, and ran out
// of host memory. The engine therefore never copies to or from a handle
// itself: CopyToHost/CopyToDevice issue one device copy per piece.
//
// Invariants: bytes_in_use() <= limit() at all times; an allocation that
// would pass the limit, or that would need more than kMaxPieces pieces,
// fails cleanly and leaves the pool as it was; the pieces of a scattered
// copy are in use exactly as long as its handle is.
//
// Thread safety: all methods take mu_, which is a leaf lock (nothing else is
// locked while it is held; the lock order is Engine::Impl::mu_ -> mu_).
// Allocate must be called without the engine lock because growing the pool
// calls into the driver; Free never does and may be called under it.
#ifndef TFLMS_CORE_SRC_HOST_POOL_H_
#define TFLMS_CORE_SRC_HOST_POOL_H_

#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bfc_arena.h"
#include "tflms/device.h"

namespace tflms {

class HostPool {
 public:
  // `device` is not owned. `limit` 0 means unlimited.
  HostPool(Device* device, size_t limit);
  ~HostPool();

  // Scattering stops at this many pieces: each piece is one more copy (10 us
  // of link latency), and a pool split that finely is better reported full.
  static constexpr size_t kMaxPieces = 64;

  // A handle for `bytes` of host copy; nullptr with *status set
  // (kResourceExhausted) when the pool is full.
  void* Allocate(size_t bytes, Status* status);
  // Frees every piece of the copy `handle` names.
  void Free(void* handle);

  // Enqueue on `stream` the copy of `bytes` between device memory and the
  // host copy `handle`, one device copy per piece, in order.
  Status CopyToHost(Stream* stream, void* handle, const void* device_src,
                    size_t bytes);
  Status CopyToDevice(Stream* stream, void* device_dst, const void* handle,
                      size_t bytes);
  // How many copies `handle` is scattered over (1 for a single chunk).
  size_t PiecesOf(const void* handle) const;
  // The host ranges that hold bytes [offset, offset + bytes) of the copy
  // `handle` names, in order: one per piece the range touches. The caller
  // keeps the range within the copy's rounded size.
  std::vector<std::pair<char*, size_t>> RangeOf(const void* handle,
                                                size_t offset,
                                                size_t bytes) const;

  size_t limit() const { return limit_; }
  size_t bytes_in_use() const;
  size_t peak_bytes_in_use() const;
  // Copies scattered since the last ClearStats.
  size_t num_scattered() const;
  // Restarts the peak from the bytes in use now and the scattered count
  // (Engine::ClearStats).
  void ClearStats();

 private:
  class HostSubAllocator : public SubAllocator {
   public:
    explicit HostSubAllocator(Device* device) : device_(device) {}
    void* Alloc(size_t bytes, size_t) override {
      return device_->AllocateHostMemory(bytes);
    }
    void Free(void* ptr, size_t bytes) override {
      device_->FreeHostMemory(ptr, bytes);
    }

   private:
    Device* device_;
  };

  struct Piece {
    char* ptr;
    size_t bytes;
  };

  // Takes pieces of `rounded` bytes in total, largest free chunk first,
  // growing the pool where the limit leaves room. All or nothing.
  void* AllocateScatteredLocked(size_t rounded);
  // The pieces of `handle` (one for a single chunk), copied out under mu_ so
  // that the copies are enqueued without it.
  std::vector<Piece> PiecesFor(const void* handle, size_t bytes) const;
  // CopyToHost / CopyToDevice. An error means no piece of this call is
  // still running: pieces already enqueued are waited for first.
  Status CopyPieces(Stream* stream, bool to_host, char* device,
                    const void* handle, size_t bytes);

  Device* const device_;
  const size_t limit_;
  HostSubAllocator sub_;
  mutable std::mutex mu_;
  std::unique_ptr<BfcArena> arena_;  // guarded by mu_
  // Scattered copies by handle (their first piece's address); guarded by mu_.
  std::unordered_map<const void*, std::vector<Piece>> scattered_;
  size_t num_scattered_ = 0;  // guarded by mu_
};

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_HOST_POOL_H_
