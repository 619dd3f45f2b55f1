// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
#include "host_pool.h"

#include <algorithm>
#include <string>

namespace tflms {
namespace {
// "Unlimited" still needs a number for the arena's region arithmetic.
constexpr size_t kUnlimited = size_t{1} << 62;
}  // namespace

HostPool::HostPool(Device* device, size_t limit)
    : device_(device), limit_(limit), sub_(device) {
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
  if (h != BfcArena::kInvalidChunk) return arena_->chunk(h)->ptr;
  void* scattered = AllocateScatteredLocked(rounded);
  if (scattered == nullptr) {
    *status = ResourceExhausted(
        "LMS host memory pool is full: " + std::to_string(rounded) +
        " bytes needed, " + std::to_string(arena_->bytes_in_use()) +
        " in use of a limit of " +
        (limit_ == 0 ? std::string("(none)") : std::to_string(limit_)) +
        " bytes. Raise TF_GPU_HOST_MEM_LIMIT_IN_MB (the engine's "
        "host_memory_limit) to give reclaimed tensors more room.");
    return nullptr;
  }
  return scattered;
}

void* HostPool::AllocateScatteredLocked(size_t rounded) {
  const size_t growth = arena_->memory_limit() - arena_->bytes_reserved();
  if (arena_->TotalFreeBytes() + growth < rounded) return nullptr;
  const size_t unit = BfcArena::RoundedBytes(1);
  std::vector<Piece> pieces;
  size_t left = rounded;
  while (left > 0 && pieces.size() < kMaxPieces) {
    // A new region first where the limit leaves room: it may hold the rest
    // whole, where the old regions' holes would split it further.
    const size_t room = arena_->memory_limit() - arena_->bytes_reserved();
    const size_t grow = std::min(left, room) / unit * unit;
    if (arena_->LargestFreeChunk() < left && grow > 0) arena_->Extend(grow);
    // Chunk sizes and `left` are multiples of the arena's rounding, so the
    // piece is exactly the chunk FindChunk returns (the pool always splits).
    const size_t take = std::min(arena_->LargestFreeChunk(), left);
    if (take == 0) break;
    BfcArena::ChunkHandle h = arena_->FindChunk(take, take, nullptr);
    if (h == BfcArena::kInvalidChunk) break;
    pieces.push_back({arena_->chunk(h)->ptr, take});
    left -= take;
  }
  if (left > 0) {
    for (const Piece& p : pieces) arena_->FreeChunk(arena_->HandleFor(p.ptr), 0);
    return nullptr;
  }
  void* handle = pieces.front().ptr;
  scattered_.emplace(handle, std::move(pieces));
  ++num_scattered_;
  return handle;
}

void HostPool::Free(void* handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = scattered_.find(handle);
  if (it != scattered_.end()) {
    for (const Piece& p : it->second) {
      arena_->FreeChunk(arena_->HandleFor(p.ptr), 0);
    }
    scattered_.erase(it);
    return;
  }
  BfcArena::ChunkHandle h = arena_->HandleFor(handle);
  if (h != BfcArena::kInvalidChunk) arena_->FreeChunk(h, 0);
}

std::vector<HostPool::Piece> HostPool::PiecesFor(const void* handle,
                                                 size_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = scattered_.find(handle);
  if (it == scattered_.end()) {
    return {{static_cast<char*>(const_cast<void*>(handle)), bytes}};
  }
  return it->second;
}

size_t HostPool::PiecesOf(const void* handle) const {
  return PiecesFor(handle, 0).size();
}

std::vector<std::pair<char*, size_t>> HostPool::RangeOf(const void* handle,
                                                        size_t offset,
                                                        size_t bytes) const {
  std::vector<std::pair<char*, size_t>> out;
  for (const Piece& p : PiecesFor(handle, offset + bytes)) {
    if (bytes == 0) break;
    if (offset >= p.bytes) {
      offset -= p.bytes;
      continue;
    }
    const size_t n = std::min(p.bytes - offset, bytes);
    out.emplace_back(p.ptr + offset, n);
    offset = 0;
    bytes -= n;
  }
  return out;
}

Status HostPool::CopyToHost(Stream* stream, void* handle,
                            const void* device_src, size_t bytes) {
  return CopyPieces(stream, /*to_host=*/true,
                    static_cast<char*>(const_cast<void*>(device_src)), handle,
                    bytes);
}

Status HostPool::CopyToDevice(Stream* stream, void* device_dst,
                              const void* handle, size_t bytes) {
  return CopyPieces(stream, /*to_host=*/false, static_cast<char*>(device_dst),
                    handle, bytes);
}

Status HostPool::CopyPieces(Stream* stream, bool to_host, char* device,
                            const void* handle, size_t bytes) {
  size_t enqueued = 0;
  for (const Piece& p : PiecesFor(handle, bytes)) {
    if (bytes == 0) break;
    const size_t n = std::min(p.bytes, bytes);
    Status s = to_host ? device_->CopyDeviceToHost(stream, p.ptr, device, n)
                       : device_->CopyHostToDevice(stream, device, p.ptr, n);
    if (!s.ok()) {
      // The callers free or reuse both sides of a copy that failed to
      // enqueue; pieces already enqueued must not still be running then.
      if (enqueued > 0) {
        Status ignored;
        EventRef drained = device_->RecordEvent(stream, &ignored);
        if (drained) device_->SynchronizeEvent(drained);
      }
      return s;
    }
    ++enqueued;
    device += n;
    bytes -= n;
  }
  return Status::Ok();
}

size_t HostPool::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_->bytes_in_use();
}

size_t HostPool::peak_bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_->peak_bytes_in_use();
}

size_t HostPool::num_scattered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_scattered_;
}

void HostPool::ClearStats() {
  std::lock_guard<std::mutex> lock(mu_);
  arena_->ClearStats();
  num_scattered_ = 0;
}

}  // namespace tflms
