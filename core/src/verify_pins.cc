// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// verify_pins: a debugging mode that checks the one promise every mechanism
// of the engine makes to the code that pins buffers: the bytes a kernel
// finds when it pins a buffer are the bytes the last kernel left when it
// unpinned it, whatever happened in between (page-out and page-in, early
// page-outs cancelled or settled, prefetches, defragmentation, placement).
//
// Invariants it checks (EngineOptions::verify_pins):
//   * When the last pin of a movable buffer ends, its bytes are read (after
//     every kernel enqueued before the Unpin: ReadDeviceSync follows the
//     compute stream) and hashed, under mu_, before it may move.
//   * When a pin makes it active again, the bytes are read after the pin has
//     ordered the compute stream after any copy still landing, and must hash
//     the same; otherwise the pin fails with kInternal naming the buffer, and
//     holds nothing.
// Only transitions between no pin and one pin are checked: while a buffer is
// pinned its holder may write it (a kernel updating a variable in place), so
// a second pinner may rightly find bytes other than the last unpin's. A buffer
// whose address escaped (unmovable) is written by code no pin covers and is
// not checked; neither is a buffer before its first unpin (its creator still
// writes it).
//
// Cost: two synchronous device reads of the buffer per pin cycle, which
// drain the compute stream, one of them under mu_. For tests and for hunting
// a stale read (tflms.tfcpu, TF_LMS_VERIFY_PINS), never for production runs.
#include <cstring>
#include <string>
#include <vector>

#include "engine_impl.h"

namespace tflms {
namespace {

// 64-bit FNV-1a over 8-byte words, the tail byte by byte: collisions only
// hide a corruption, they never report one that did not happen.
uint64_t HashBytes(const char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < n; ++i) {
    h = (h ^ static_cast<unsigned char>(p[i])) * 1099511628211ull;
  }
  return h;
}

}  // namespace

Status Engine::Impl::HashDeviceBytes(const void* device_ptr, size_t bytes,
                                     uint64_t* hash) {
  std::vector<char> host(bytes);
  if (bytes > 0) {
    TFLMS_RETURN_IF_ERROR(device_->ReadDeviceSync(host.data(), device_ptr,
                                                  bytes));
  }
  *hash = HashBytes(host.data(), bytes);
  return Status::Ok();
}

void Engine::Impl::NoteUnpinnedBytes(Buffer* b) {
  if (!options_.verify_pins || b->pin_count != 1 || b->unmovable) return;
  // Read under mu_, against the rule that no copy runs under it: a debugging
  // mode may stall allocations, but if it let them see the buffer still
  // pinned after its kernel ended, a device at its limit would run out of
  // memory where it does not without the check (the tfcpu harness's
  // variables larger than the device did).
  uint64_t hash = 0;
  const Status s = HashDeviceBytes(b->device_ptr, b->size, &hash);
  b->pin_hash_valid = s.ok();
  b->pin_hash = hash;
}

Status Engine::Impl::VerifyPinnedBytes(Buffer* b, const void* device_ptr,
                                       uint64_t expected) {
  uint64_t hash = 0;
  Status s = HashDeviceBytes(device_ptr, b->size, &hash);
  if (s.ok() && hash == expected) return Status::Ok();
  const int64_t id = b->id;  // fixed at creation; b is pinned
  Unpin(b);
  if (!s.ok()) return s;
  return Internal(
      "verify_pins: buffer " + std::to_string(id) + " (" +
      std::to_string(b->size) +
      " bytes) does not hold the bytes its last unpin left: a page-in, a "
      "move or another buffer changed it while it was unpinned, or a kernel "
      "wrote it without a pin (a bug in LMS; please report it with this "
      "message)");
}

}  // namespace tflms
