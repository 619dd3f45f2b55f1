// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The only translation unit compiled against the tensorflow-cpu wheel's
// headers (included with -isystem: their deprecation warnings are not ours).
#include "tf_side.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "xla/tsl/framework/allocator.h"
#include "xla/tsl/framework/bfc_allocator.h"

namespace tflms_bench {
namespace {

// A "device" of `capacity` bytes: one anonymous mapping, never touched by the
// allocators (BFC keeps its metadata elsewhere), handed out first-fit at the
// lowest address with 256-byte granularity, like the sim device's memory.
class HostArenaSubAllocator : public tsl::SubAllocator {
 public:
  explicit HostArenaSubAllocator(size_t capacity)
      : tsl::SubAllocator({}, {}), capacity_(capacity) {
    void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of the host arena failed");
    base_ = static_cast<char*>(p);
    free_[0] = capacity;
  }
  ~HostArenaSubAllocator() override { munmap(base_, capacity_); }

  void* Alloc(size_t alignment, size_t num_bytes,
              size_t* bytes_received) override {
    const size_t bytes = (num_bytes + 255) & ~size_t{255};
    (void)alignment;  // every offset handed out is a multiple of 256
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      const size_t offset = it->first;
      const size_t rest = it->second - bytes;
      free_.erase(it);
      if (rest > 0) free_[offset + bytes] = rest;
      *bytes_received = bytes;
      refused_size_ = 0;
      refusals_ = 0;
      return base_ + offset;
    }
    // TF 2.21's Extend backs off by RoundedBytes(bytes * 0.9), which for
    // 512..2560 bytes rounds back to the same size: if the device refuses
    // that, TensorFlow asks again forever. Report it instead of spinning.
    refusals_ = bytes == refused_size_ ? refusals_ + 1 : 1;
    refused_size_ = bytes;
    if (refusals_ >= kLivelockRefusals) {
      std::printf("{\"livelock\": \"tf\", \"bytes\": %zu}\n", bytes);
      std::fflush(stdout);
      std::_Exit(3);
    }
    return nullptr;
  }

  void Free(void* ptr, size_t num_bytes) override {
    size_t offset = static_cast<char*>(ptr) - base_;
    size_t bytes = (num_bytes + 255) & ~size_t{255};
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + bytes == next->first) {
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += bytes;
        return;
      }
    }
    free_[offset] = bytes;
  }

  // GPU device memory (DeviceMemAllocator) does not coalesce regions.
  bool SupportsCoalescing() const override { return false; }

  const char* base() const { return base_; }

 private:
  static constexpr int kLivelockRefusals = 100000;
  size_t capacity_;
  char* base_ = nullptr;
  std::map<size_t, size_t> free_;  // offset -> bytes
  size_t refused_size_ = 0;
  int refusals_ = 0;
};

}  // namespace

struct TfBfc::Impl {
  HostArenaSubAllocator* sub = nullptr;  // owned by bfc
  std::unique_ptr<tsl::BFCAllocator> bfc;
};

TfBfc::TfBfc(const TfBfcOptions& options) : impl_(new Impl) {
  size_t capacity =
      options.device_capacity ? options.device_capacity : options.memory_limit;
  auto sub = std::make_unique<HostArenaSubAllocator>(capacity);
  impl_->sub = sub.get();
  tsl::BFCAllocator::Options opts;
  opts.allow_growth = options.allow_growth;
  // Without this an OOM waits up to 10 s for a free that never comes.
  opts.allow_retry_on_failure = false;
  opts.garbage_collection = options.garbage_collection;
  opts.fragmentation_fraction = options.fragmentation_fraction;
  impl_->bfc = std::make_unique<tsl::BFCAllocator>(
      std::move(sub), options.memory_limit, "tf_bfc", opts);
}

TfBfc::~TfBfc() = default;

void* TfBfc::Allocate(size_t bytes) {
  return impl_->bfc->AllocateRaw(tsl::Allocator::kAllocatorAlignment, bytes);
}

void TfBfc::Deallocate(void* ptr) { impl_->bfc->DeallocateRaw(ptr); }

TfBfcStats TfBfc::Stats() {
  std::optional<tsl::AllocatorStats> s = impl_->bfc->GetStats();
  TfBfcStats out;
  if (!s) return out;
  out.num_allocs = s->num_allocs;
  out.bytes_in_use = s->bytes_in_use;
  out.peak_bytes_in_use = s->peak_bytes_in_use;
  out.largest_alloc_size = s->largest_alloc_size;
  out.bytes_limit = s->bytes_limit.value_or(-1);
  out.bytes_reserved = s->bytes_reserved;
  out.peak_bytes_reserved = s->peak_bytes_reserved;
  out.pool_bytes = s->pool_bytes.value_or(-1);
  out.peak_pool_bytes = s->peak_pool_bytes.value_or(-1);
  return out;
}

uint64_t TfBfc::Offset(const void* ptr) const {
  return static_cast<const char*>(ptr) - impl_->sub->base();
}

void QuietTensorFlowLogs() {
  // Read by TensorFlow's logging on first use; set before any allocator
  // exists. 3 keeps even ERROR quiet: OOM dumps are expected here.
  setenv("TF_CPP_MIN_LOG_LEVEL", "3", /*overwrite=*/0);
}

}  // namespace tflms_bench
