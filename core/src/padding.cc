// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Padding trim: the bytes TensorFlow's split rule leaves inside chunks in
// use, given back to the free lists before anything is paged out.
//
// BFC splits a free chunk for a request only if the rest is at least as
// large as the request or at least 128 MiB (bfc_arena.cc, ShouldSplit), so a
// 42 MB tensor takes a 66 MB chunk whole. The arena keeps that rule: with LMS
// off the engine fails and peaks where TensorFlow does. Under LMS the padding
// is device memory that no tensor uses, and the step's plan (step_plan.cc),
// which counts bytes, does not know it is gone: DenseNet201 at batch 166 on
// a 16 GiB V100 held 17.12 GB of chunks for 14.80 GB of resident tensors
// when allocations found no room, and those allocations paged out on demand
// 36 victims (2.97 GB each way per step) beyond the plan's 16.62 GB, the
// Ideal schedule's exact figure. Trimming the padding at that point instead
// took the step from 3.416 s to 2.993 s (PCIe 3; Ideal 2.844 s).
//
// Only while the engine follows a plan. Without one (on-demand paging, the
// first steps, a step that does not repeat), the free pieces trimming makes
// change where the next large tensors go without a plan to make use of the
// room, and over the planner's 26 on-demand points it was a mixed gain:
// faster by 1-8.4% at 11 of them, slower by 1-1.7% at 3 and by 11% at
// DenseNet201 batch 332 on the AC922, and InceptionV3 at batch 712 there
// ran out of memory (a MaxPoolGrad's 3.9 GB output found its three inputs
// pinned apart). Trimming every free chunk's rest at allocation instead
// (splitting always, or whenever the rest is 2 MiB or more) did the same to
// the 3D U-Net's 8 GB tensors with prefetch too (UNet3D 272^3 on the
// DGX-1: 4.60 s -> 6.60 s always, 4.53 s from 2 MiB; 400^3 on the A100-40:
// 9.66 s -> 10.70 s always, 10.46 s from 2 MiB).
//
// Invariants: runs under mu_ and moves no byte. Only chunks of buffers in
// the resident state are trimmed: no copy is reading or writing them (page
// copies and moves cover the buffer's size, never its chunk's tail), and a
// kernel using a pinned buffer touches its size only. A tail that a freed
// chunk's reuse_after guarded keeps it (split chunks inherit it). Tails
// under kMinTail stay, as they would make slivers no request fits.
// Raw allocations (no owner) are not trimmed: TensorFlow's tracking
// allocators read their AllocatedSize at allocation and again at free.
#include "engine_impl.h"

namespace tflms {
namespace {

// Tails shorter than this are left (the smallest region the arena grows by).
constexpr size_t kMinTail = size_t{2} << 20;

}  // namespace

bool Engine::Impl::TrimPaddingLocked() {
  if (!options_.lms_enabled || fixed_ || arena_ == nullptr ||
      arena_->owned_padding() < kMinTail || !FollowingPlan()) {
    return false;
  }
  // Trimming files each tail as the chunk after the trimmed one (free, so
  // the walk passes over it); handles stay valid however the table grows.
  size_t trimmed = 0;
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (!c->in_use() || c->owner == nullptr) continue;
      Buffer* b = static_cast<Buffer*>(c->owner);
      if (b->state != BufferState::kResident) continue;
      const size_t tail = arena_->TrimInUse(h, kMinTail);
      if (tail == 0) continue;
      AddChunkBytes(b, -static_cast<int64_t>(tail));
      trimmed += tail;
    }
  });
  counters_.bytes_padding_trimmed += static_cast<int64_t>(trimmed);
  return trimmed > 0;
}

}  // namespace tflms
