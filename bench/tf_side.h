// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// TensorFlow's own tsl::BFCAllocator (from the tensorflow-cpu wheel's
// libtensorflow_framework) behind a tiny interface, so that bench code that
// includes the engine headers never sees TensorFlow's headers and the other
// way round. tf_side.cc is the only file compiled against the wheel.
#ifndef TFLMS_BENCH_TF_SIDE_H_
#define TFLMS_BENCH_TF_SIDE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace tflms_bench {

struct TfBfcOptions {
  size_t memory_limit = 0;
  // Bytes the host arena behind the sub-allocator holds: equal to
  // memory_limit normally; smaller to make the sub-allocator refuse (TF then
  // backs off by 10% at a time).
  size_t device_capacity = 0;
  bool allow_growth = true;
  bool garbage_collection = false;
  double fragmentation_fraction = 0.0;
};

struct TfBfcStats {
  int64_t num_allocs = 0;
  int64_t bytes_in_use = 0;
  int64_t peak_bytes_in_use = 0;
  int64_t largest_alloc_size = 0;
  int64_t bytes_limit = 0;
  int64_t bytes_reserved = 0;       // AllocatorStats::bytes_reserved as TF reports it
  int64_t peak_bytes_reserved = 0;
  int64_t pool_bytes = 0;           // bytes TF's BFC holds in regions
  int64_t peak_pool_bytes = 0;
};

class TfBfc {
 public:
  explicit TfBfc(const TfBfcOptions& options);
  ~TfBfc();
  TfBfc(const TfBfc&) = delete;
  TfBfc& operator=(const TfBfc&) = delete;

  void* Allocate(size_t bytes);  // nullptr when out of memory
  void Deallocate(void* ptr);
  TfBfcStats Stats();
  // Offset of `ptr` from the start of the host arena behind the allocator.
  uint64_t Offset(const void* ptr) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Quiets TensorFlow's logging (an OOM dumps every chunk at WARNING/INFO).
void QuietTensorFlowLogs();

}  // namespace tflms_bench

#endif  // TFLMS_BENCH_TF_SIDE_H_
