// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// How prefetch names a buffer across steps, and how far from where the
// learned order expects a pin it looks for it; shared by the files of the
// prefetcher (prefetch.cc, step_finding.cc, step_plan.cc).
//
// Step keys: bit 61 says whether the buffer is of the step itself (0) or of
// the one before (1), then its size and its rank among that size's
// allocations in its step; both saturate (a collision costs a missed
// prefetch, never correctness: a planned buffer is looked up again).
// Negative keys are buffers known by id (-id).

#ifndef TFLMS_CORE_SRC_PREFETCH_KEYS_H_
#define TFLMS_CORE_SRC_PREFETCH_KEYS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace tflms {

// How far ahead of the cursor a pin is searched for in the learned order.
inline constexpr size_t kResyncWindow = 64;
// A pin found at most this far from where the learned order expected it
// counts as in order; further away within kResyncWindow it only moves the
// cursor there (in the TensorFlow steps measured, 93% of the pins found came
// at the expected place and 5% within 4 pins of it).
inline constexpr size_t kNearPins = 4;

inline constexpr int kRankBits = 21;
inline constexpr int kSizeBits = 40;
inline constexpr int64_t kPreviousStepBit = int64_t{1} << (kRankBits + kSizeBits);

// The size field of a key: the size alone, or, where the allocating kernel
// is known, the size and its site mixed (SplitMix64's finalizer) into the
// field's bits; a collision costs a missed prefetch, never correctness.
inline uint64_t KeySize(size_t size, uint64_t site) {
  if (site == 0) return size;
  uint64_t z = site + 0x9e3779b97f4a7c15ULL * (size + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) >> (64 - kSizeBits);
}

inline int64_t StepKey(bool previous, uint64_t size, int64_t rank) {
  const uint64_t max_size = (uint64_t{1} << kSizeBits) - 1;
  const int64_t max_rank = (int64_t{1} << kRankBits) - 1;
  const uint64_t s = std::min(size, max_size);
  return (previous ? kPreviousStepBit : 0) |
         static_cast<int64_t>(s << kRankBits) | std::min(rank, max_rank);
}

}  // namespace tflms

#endif  // TFLMS_CORE_SRC_PREFETCH_KEYS_H_
