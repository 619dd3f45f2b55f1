// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Statistics, invariant checks and out-of-memory messages.
//
// Counters are updated under mu_ in the same critical section as the state
// they describe, so a snapshot (GetStats, under mu_) always satisfies the
// invariants listed in stats.h; CheckInvariants recomputes them from the
// chunks and buffers to prove it.
#include <sstream>
#include <string>
#include <unordered_set>

#include "engine_impl.h"

namespace tflms {

std::vector<std::pair<std::string, int64_t>> EngineStats::Items() const {
  return {
      {"num_allocs", num_allocs},
      {"bytes_in_use", bytes_in_use},
      {"peak_bytes_in_use", peak_bytes_in_use},
      {"largest_alloc_size", largest_alloc_size},
      {"bytes_limit", bytes_limit},
      {"bytes_reserved", bytes_reserved},
      {"peak_bytes_reserved", peak_bytes_reserved},
      {"bytes_reservable_limit", bytes_reservable_limit},
      {"bytes_inactive", bytes_inactive},
      {"bytes_active", bytes_active},
      {"peak_bytes_active", peak_bytes_active},
      {"bytes_reclaimed", bytes_reclaimed},
      {"current_bytes_reclaimed", current_bytes_reclaimed},
      {"peak_bytes_reclaimed", peak_bytes_reclaimed},
      {"num_single_reclaims", num_single_reclaims},
      {"num_fragment_reclaims", num_fragment_reclaims},
      {"num_full_reclaims", num_full_reclaims},
      {"num_reclaim_failures", num_reclaim_failures},
      {"num_page_ins", num_page_ins},
      {"bytes_paged_in", bytes_paged_in},
      {"host_bytes_in_use", host_bytes_in_use},
      {"host_peak_bytes_in_use", host_peak_bytes_in_use},
      {"host_bytes_limit", host_bytes_limit},
      {"num_scattered_host_copies", num_scattered_host_copies},
      {"num_defragmentations", num_defragmentations},
      {"bytes_defragged", bytes_defragged},
      {"num_group_gathers", num_group_gathers},
      {"bytes_group_gathered", bytes_group_gathered},
      {"num_stranded_round_trips", num_stranded_round_trips},
      {"num_due_group_placements", num_due_group_placements},
      {"bytes_due_group_placed", bytes_due_group_placed},
      {"num_host_full_defrags", num_host_full_defrags},
      {"num_host_exchanges", num_host_exchanges},
      {"bytes_host_exchanged", bytes_host_exchanged},
      {"num_swaps_in_place", num_swaps_in_place},
      {"bytes_swapped_in_place", bytes_swapped_in_place},
      {"num_prefetches", num_prefetches},
      {"prefetch_hits", prefetch_hits},
      {"prefetch_misses", prefetch_misses},
      {"bytes_paged_in_on_demand", bytes_paged_in_on_demand},
      {"prefetch_hits_in_flight", prefetch_hits_in_flight},
      {"bytes_prefetched_in_flight", bytes_prefetched_in_flight},
      {"num_planned_prefetches", num_planned_prefetches},
      {"num_planned_prefetches_queued", num_planned_prefetches_queued},
      {"num_clean_evictions", num_clean_evictions},
      {"bytes_evicted_clean", bytes_evicted_clean},
      {"bytes_padding_trimmed", bytes_padding_trimmed},
      {"num_prefetch_steps", num_prefetch_steps},
      {"prefetch_pins", prefetch_pins},
      {"prefetch_pins_in_order", prefetch_pins_in_order},
      {"num_prefetch_paused_steps", num_prefetch_paused_steps},
      {"num_early_page_outs", num_early_page_outs},
      {"num_early_page_outs_cancelled", num_early_page_outs_cancelled},
      {"num_layout_looks", num_layout_looks},
      {"num_layout_looks_refused", num_layout_looks_refused},
      {"num_layout_looks_repeated", num_layout_looks_repeated},
      {"layout_look_events", layout_look_events},
      {"layout_look_ranges_scanned", layout_look_ranges_scanned},
      {"page_in_stall_ns", page_in_stall_ns},
      {"page_out_wait_ns", page_out_wait_ns},
      {"num_run_ahead_checks", num_run_ahead_checks},
      {"num_run_ahead_waits", num_run_ahead_waits},
      {"run_ahead_wait_ns", run_ahead_wait_ns},
      {"num_allocs_from_free", num_allocs_from_free},
      {"num_allocs_from_new_region", num_allocs_from_new_region},
      {"num_allocs_from_single_reclaim", num_allocs_from_single_reclaim},
      {"num_allocs_from_fragment_reclaim", num_allocs_from_fragment_reclaim},
      {"num_allocs_from_full_reclaim", num_allocs_from_full_reclaim},
      {"num_allocs_from_defrag", num_allocs_from_defrag},
      {"num_ooms", num_ooms},
      {"page_size", page_size},
      {"physical_bytes_in_use", physical_bytes_in_use},
      {"physical_bytes_cached", physical_bytes_cached},
      {"physical_bytes_free", physical_bytes_free},
      {"physical_bytes_evicted", physical_bytes_evicted},
      {"virtual_bytes_reserved", virtual_bytes_reserved},
      {"virtual_bytes_in_use", virtual_bytes_in_use},
      {"num_pages_mapped", num_pages_mapped},
      {"num_pages_unmapped", num_pages_unmapped},
      {"num_map_failures", num_map_failures},
  };
}

void Engine::Impl::AddChunkBytes(const Buffer* owner, int64_t delta) {
  resident_bytes_ += delta;
  peak_resident_bytes_ = std::max(peak_resident_bytes_, resident_bytes_);
  if (owner == nullptr || owner->active()) {
    bytes_active_ += delta;
    counters_.peak_bytes_active =
        std::max(counters_.peak_bytes_active, bytes_active_);
  } else {
    bytes_inactive_ += delta;
  }
}

void Engine::Impl::SetActivity(Buffer* b, bool was_active) {
  const bool now_active = b->active();
  if (now_active == was_active || !b->resident()) return;
  const int64_t size = static_cast<int64_t>(arena_->chunk(b->chunk)->size);
  if (now_active) {
    LruRemove(b);
    bytes_inactive_ -= size;
    bytes_active_ += size;
    counters_.peak_bytes_active =
        std::max(counters_.peak_bytes_active, bytes_active_);
  } else {
    bytes_active_ -= size;
    bytes_inactive_ += size;
    LruPush(b);
  }
}

void Engine::Impl::CountSource(AllocSource source) {
  switch (source) {
    case AllocSource::kFree: ++counters_.num_allocs_from_free; break;
    case AllocSource::kNewRegion: ++counters_.num_allocs_from_new_region; break;
    case AllocSource::kSingleReclaim:
      ++counters_.num_allocs_from_single_reclaim;
      break;
    case AllocSource::kDefrag: ++counters_.num_allocs_from_defrag; break;
    case AllocSource::kFragmentReclaim:
      ++counters_.num_allocs_from_fragment_reclaim;
      break;
    case AllocSource::kFullReclaim:
      ++counters_.num_allocs_from_full_reclaim;
      break;
  }
}

EngineStats Engine::Impl::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = counters_;
  s.num_allocs = arena_->num_allocs();
  s.bytes_in_use = static_cast<int64_t>(arena_->bytes_in_use());
  s.peak_bytes_in_use = static_cast<int64_t>(arena_->peak_bytes_in_use());
  s.largest_alloc_size = static_cast<int64_t>(arena_->largest_alloc_size());
  // The device's bytes (the arena's addresses are more, unfragmented).
  s.bytes_limit = static_cast<int64_t>(options_.memory_limit);
  s.bytes_reserved = static_cast<int64_t>(arena_->bytes_reserved());
  s.peak_bytes_reserved = static_cast<int64_t>(arena_->peak_bytes_reserved());
  s.bytes_reservable_limit = static_cast<int64_t>(arena_->memory_limit());
  s.bytes_active = bytes_active_;
  s.bytes_inactive = bytes_inactive_;
  s.host_bytes_in_use = static_cast<int64_t>(host_pool_->bytes_in_use());
  s.host_peak_bytes_in_use =
      static_cast<int64_t>(host_pool_->peak_bytes_in_use());
  s.host_bytes_limit = static_cast<int64_t>(host_pool_->limit());
  s.num_scattered_host_copies =
      static_cast<int64_t>(host_pool_->num_scattered());
  if (fixed_) FillFixedStats(&s);
  return s;
}

Status Engine::Impl::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  bool arena_ok = true;
  arena_->CheckAndCountChunks(&arena_ok);
  if (!arena_ok) return Internal("BFC arena chunk structure is inconsistent");

  int64_t active = 0, inactive = 0;
  // Recompute activity from the chunks' owners.
  std::unordered_set<const Buffer*> live;
  ForEachBuffer([&](const Buffer* b) { live.insert(b); });
  if (live.size() != num_buffers_) return Internal("buffer list is corrupt");
  bool owners_ok = true;
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      if (!c->in_use() || c->owner == &claiming_tag_) continue;
      const Buffer* b = static_cast<const Buffer*>(c->owner);
      if (b != nullptr && live.count(b) == 0) {
        owners_ok = false;
        continue;
      }
      // Fixed-address mode: an evicted buffer keeps its virtual chunk.
      if (b != nullptr && !b->resident()) continue;
      if (b == nullptr || b->active()) {
        active += static_cast<int64_t>(c->size);
      } else {
        inactive += static_cast<int64_t>(c->size);
      }
    }
  });
  if (!owners_ok) return Internal("a chunk is owned by an unknown buffer");
  if (active != bytes_active_ || inactive != bytes_inactive_) {
    std::ostringstream m;
    m << "activity accounting drifted: counted active " << bytes_active_
      << " inactive " << bytes_inactive_ << ", chunks say active " << active
      << " inactive " << inactive;
    return Internal(m.str());
  }
  const int64_t in_use = fixed_ ? resident_bytes_
                                : static_cast<int64_t>(arena_->bytes_in_use());
  if (active + inactive != in_use) {
    return Internal("bytes_active + bytes_inactive != bytes_in_use");
  }
  int64_t reclaimed = 0;
  int64_t clean_bytes = 0;
  int64_t clean_copies = 0;
  size_t lru_count = 0;
  for (const Buffer* b : live) {
    if (b->clean_host != nullptr) {
      // Only a prefetched buffer not pinned since holds its host copy.
      if (!b->resident() || !b->prefetched || b->pin_count != 0 || fixed_) {
        return Internal("clean host copy on a buffer that may have changed");
      }
      clean_bytes += static_cast<int64_t>(b->clean_host_bytes);
      ++clean_copies;
    }
    if (b->state == BufferState::kReclaimed) {
      if (b->resident() || b->host_ptr == nullptr) {
        return Internal("reclaimed buffer without a host copy");
      }
      if (fixed_ && (b->vchunk == BfcArena::kInvalidChunk ||
                     arena_->chunk(b->vchunk)->ptr != b->device_ptr)) {
        return Internal("evicted buffer lost its fixed address");
      }
    }
    // A buffer paging in still holds (and is counted by) its host copy
    // while the ladder makes room for it with mu_ released.
    if (b->host_ptr != nullptr) {
      reclaimed += static_cast<int64_t>(b->host_bytes);
    }
    if (b->resident()) {
      const BfcArena::Chunk* c = arena_->chunk(b->chunk);
      if (c->owner != b || c->ptr != b->device_ptr || c->size < b->size) {
        return Internal("resident buffer does not own its chunk");
      }
    }
    if (b->in_lru) {
      ++lru_count;
      if (b->active()) return Internal("active buffer on the inactive LRU");
    } else if (b->resident() && !b->active() &&
               b->state == BufferState::kResident) {
      return Internal("inactive resident buffer missing from the LRU");
    }
  }
  size_t walked = 0;
  for (const Buffer* b = lru_head_; b != nullptr; b = b->lru_next) ++walked;
  if (walked != lru_count) return Internal("LRU list is corrupt");
  if (reclaimed != counters_.current_bytes_reclaimed) {
    return Internal("current_bytes_reclaimed drifted");
  }
  if (clean_copies != clean_copies_) {
    return Internal("clean host copies miscounted");
  }
  if (reclaimed + clean_bytes >
      static_cast<int64_t>(host_pool_->bytes_in_use())) {
    return Internal("reclaimed bytes exceed host bytes in use");
  }
  if (fixed_) return CheckPagesLocked();
  return Status::Ok();
}

std::string Engine::Impl::LargerThanDeviceMessage(size_t bytes) const {
  const size_t limit = options_.memory_limit;
  std::ostringstream m;
  m << "Out of memory on " << options_.name << " allocating " << bytes
    << " bytes: the request exceeds the device memory limit of " << limit
    << " bytes";
  if (bytes <= limit) {
    // Only the rounding makes it too large; bytes <= limit cannot overflow.
    m << " once rounded to the allocator's 256-byte units ("
      << BfcArena::RoundedBytes(bytes) << " bytes)";
  }
  m << ", so no tensor was moved to host memory: nothing could make room for "
       "it. Reduce the size of this tensor (batch or model size) or give the "
       "device a larger memory limit.";
  return m.str();
}

void Engine::Impl::ClearStats() {
  std::lock_guard<std::mutex> lock(mu_);
  arena_->ClearStats();
  host_pool_->ClearStats();
  // Everything in counters_ is cumulative except current_bytes_reclaimed
  // (state) and the peaks, which restart from the current values.
  const int64_t current_reclaimed = counters_.current_bytes_reclaimed;
  counters_ = EngineStats();
  counters_.current_bytes_reclaimed = current_reclaimed;
  counters_.peak_bytes_reclaimed = current_reclaimed;
  counters_.peak_bytes_active = bytes_active_;
  peak_resident_bytes_ = resident_bytes_;
  peak_mapped_bytes_ = static_cast<int64_t>(mapped_pages_ * page_size_);
}

namespace {

std::string ShortBytes(size_t bytes) {
  std::ostringstream m;
  m.setf(std::ios::fixed);
  m.precision(1);
  if (bytes >= (size_t{1} << 30)) {
    m << static_cast<double>(bytes) / (1 << 30) << " GiB";
  } else if (bytes >= (size_t{1} << 20)) {
    m << static_cast<double>(bytes) / (1 << 20) << " MiB";
  } else if (bytes >= 1024) {
    m << static_cast<double>(bytes) / 1024 << " KiB";
  } else {
    return std::to_string(bytes) + " B";
  }
  return m.str();
}

}  // namespace

std::string Engine::Impl::FragmentationLayout() const {
  // The chunks in address order, runs of the same kind merged, so that a
  // user sees what splits the free memory (e.g. small tensors in use every
  // 512 KiB); at most kShown runs per region.
  constexpr int kShown = 16;
  std::ostringstream m;
  arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
    std::string kind;
    size_t run_bytes = 0;
    int runs = 0;
    auto flush = [&] {
      if (run_bytes == 0) return;
      if (runs < kShown) {
        m << (runs == 0 ? " [" : " | ") << kind << " " << ShortBytes(run_bytes);
      }
      ++runs;
    };
    for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
         h = arena_->chunk(h)->next) {
      const BfcArena::Chunk* c = arena_->chunk(h);
      std::string k;
      if (!c->in_use()) {
        k = "free";
      } else if (c->owner == nullptr) {
        k = "raw";
      } else {
        const Buffer* b = static_cast<const Buffer*>(c->owner);
        k = b->unmovable ? "unmovable" : b->pin_count > 0 ? "pinned" : "idle";
      }
      if (k != kind) {
        flush();
        kind = k;
        run_bytes = 0;
      }
      run_bytes += c->size;
    }
    flush();
    if (runs > kShown) m << " | ... " << runs - kShown << " more";
    m << "]";
  });
  return m.str();
}

std::string Engine::Impl::OutOfMemoryMessage(size_t bytes, size_t rounded,
                                             const Status& host_status) const {
  const size_t largest = arena_->LargestFreeChunk();
  const size_t reserved = arena_->bytes_reserved();
  const size_t limit = arena_->memory_limit();
  // Free bytes include memory the arena could still take from the device.
  const size_t free_total = arena_->TotalFreeBytes() + (limit - reserved);
  std::ostringstream m;
  m << "Out of memory on " << options_.name << " allocating " << bytes
    << " bytes (" << rounded << " rounded). Device limit " << limit
    << " bytes; in use " << arena_->bytes_in_use() << " (active "
    << bytes_active_ << ", inactive " << bytes_inactive_ << "); "
    << counters_.current_bytes_reclaimed
    << " bytes reclaimed to host; largest free chunk " << largest
    << "; free " << free_total << ".";
  if (!host_status.ok()) m << " " << host_status.message();
  const bool refused = arena_->device_refused() && limit - reserved >= rounded;
  if (refused) {
    // The free bytes above count what the limit allows but the device did
    // not give: no fragmentation or LMS advice applies to those.
    m << " The device refused the arena the " << limit - reserved
      << " bytes still under its limit: another process (or another "
         "TensorFlow device on this GPU) may hold that memory; free it or "
         "lower the memory limit (per_process_gpu_memory_fraction, "
         "tf.config.set_logical_device_configuration).";
  }
  if (!refused && free_total >= rounded && largest < rounded) {
    m << " Enough memory is free but it is fragmented";
    if (bytes_inactive_ == 0) {
      m << " by tensors in use, which nothing can move (device memory in "
           "address order:"
        << FragmentationLayout() << ")";
    } else if (HostRefused(host_status)) {
      // The host was full, so SlideFor (defrag.cc) ran whatever
      // lms_defrag_enabled says: the knob would not help.
      m << "; moving the inactive tensors within the device did not join "
           "enough of it either";
    } else if (!options_.defrag_enabled) {
      m << "; enabling LMS defragmentation may help "
           "(tf.config.experimental.set_lms_defrag_enabled(True) or "
           "gpu_options.experimental.lms_defrag_enabled)";
    }
    m << ".";
  }
  if (!options_.lms_enabled &&
      static_cast<size_t>(bytes_inactive_) + free_total >= rounded) {
    m << " Enabling Large Model Support "
         "(tf.config.experimental.set_lms_enabled(True) or "
         "gpu_options.experimental.lms_enabled) may avoid this: "
      << bytes_inactive_ << " bytes are held by tensors no running op uses.";
  }
  if (options_.lms_enabled && host_status.ok() && !refused) {
    m << " Every byte left on the device is used by running ops or "
         "allocations LMS cannot move; reduce the batch or model size.";
  }
  return m.str();
}

}  // namespace tflms
