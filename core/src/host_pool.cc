// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
#include "host_pool.h"

#include <string>

namespace tflms {
namespace {
// "Unlimited" still needs a number for the arena's region arithmetic.
constexpr size_t kUnlimited = size_t{1} << 62;
}  // namespace

HostPool::HostPool(Device* device, size_t limit)
    : limit_(limit), sub_(device) {
  BfcArena::Options options;
  options.memory_limit = limit == 0 ? kUnlimited : limit;
  options.allow_growth = true;
  // TensorFlow's split rule gives a request a whole chunk when the rest is
  // under 128 MB and under the request: on a device that keeps large holes
  // whole, but here the tail is only host capacity lost. ResNet152 at batch
  // 382 on the DGX-1 (48 GiB of host) ran out of host with prefetch with
  // 0.31 GB of its pool in such tails and 2.4 MB needed.
  options.split_always = true;
  arena_ = std::make_unique<BfcArena>(&sub_, options);
}

HostPool::~HostPool() = default;

void* HostPool::Allocate(size_t bytes, Status* status) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t rounded = BfcArena::RoundedBytes(bytes);
  BfcArena::ChunkHandle h = arena_->FindChunk(rounded, bytes, nullptr);
  if (h == BfcArena::kInvalidChunk && arena_->Extend(rounded)) {
    h = arena_->FindChunk(rounded, bytes, nullptr);
  }
  if (h == BfcArena::kInvalidChunk) {
    *status = ResourceExhausted(
        "LMS host memory pool is full: " + std::to_string(rounded) +
        " bytes needed, " + std::to_string(arena_->bytes_in_use()) +
        " in use of a limit of " +
        (limit_ == 0 ? std::string("(none)") : std::to_string(limit_)) +
        " bytes. Raise TF_GPU_HOST_MEM_LIMIT_IN_MB (the engine's "
        "host_memory_limit) to give reclaimed tensors more room.");
    return nullptr;
  }
  return arena_->chunk(h)->ptr;
}

void HostPool::Free(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  BfcArena::ChunkHandle h = arena_->HandleFor(ptr);
  if (h != BfcArena::kInvalidChunk) arena_->FreeChunk(h, 0);
}

size_t HostPool::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_->bytes_in_use();
}

size_t HostPool::peak_bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_->peak_bytes_in_use();
}

void HostPool::ClearStats() {
  std::lock_guard<std::mutex> lock(mu_);
  arena_->ClearStats();
}

}  // namespace tflms
