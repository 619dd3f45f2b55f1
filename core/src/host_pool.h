// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// HostPool: the pinned host memory that reclaimed bytes live in.
//
// A BfcArena over the device's page-locked host allocations, with a byte
// limit (TF_GPU_HOST_MEM_LIMIT_IN_MB inside TensorFlow). Pinned host
// allocation is slow on real drivers (cudaHostAlloc maps pages), so regions
// are kept and reused exactly as TensorFlow's gpu_host_bfc allocator does.
//
// Invariant: bytes_in_use() <= limit() at all times; an allocation that would
// pass the limit fails cleanly and leaves the pool as it was.
//
// Thread safety: all methods take mu_, which is a leaf lock (nothing else is
// locked while it is held; the lock order is Engine::Impl::mu_ -> mu_).
// Allocate must be called without the engine lock because growing the pool
// calls into the driver; Free never does and may be called under it.
#ifndef TFLMS_CORE_SRC_HOST_POOL_H_
#define TFLMS_CORE_SRC_HOST_POOL_H_

#include <memory>
#include <mutex>

#include "bfc_arena.h"
#include "tflms/device.h"

namespace tflms {

class HostPool {
 public:
  // `device` is not owned. `limit` 0 means unlimited.
  HostPool(Device* device, size_t limit);
  ~HostPool();

  // nullptr with *status set (kResourceExhausted) when the pool is full.
  void* Allocate(size_t bytes, Status* status);
  void Free(void* ptr);

  size_t limit() const { return limit_; }
  size_t bytes_in_use() const;
  size_t peak_bytes_in_use() const;
  // Restarts the peak from the bytes in use now (Engine::ClearStats).
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

  const size_t limit_;
  HostSubAllocator sub_;
  mutable std::mutex mu_;
  std::unique_ptr<BfcArena> arena_;  // guarded by mu_
};

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_HOST_POOL_H_
