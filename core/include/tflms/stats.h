// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Allocator statistics: every counter TFLMS v2 exposed, plus defragmentation,
// prefetch, stall and allocation-source counters.
//
// Invariants (hold in every snapshot, because a snapshot is taken under the
// engine lock and every update happens under it):
//   bytes_active + bytes_inactive == bytes_in_use
//   bytes_in_use <= bytes_reserved <= bytes_limit
//   peak_X >= X for every pair
//   current_bytes_reclaimed <= host_bytes_in_use
//   fixed-address mode: the page identity below
// All sizes are in bytes, all times in nanoseconds.
#ifndef TFLMS_CORE_STATS_H_
#define TFLMS_CORE_STATS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tflms {

struct EngineStats {
  // --- BFC (same meaning as tsl::AllocatorStats) ---
  int64_t num_allocs = 0;            // successful allocations, cumulative
  int64_t bytes_in_use = 0;          // device bytes in allocated chunks
  int64_t peak_bytes_in_use = 0;
  int64_t largest_alloc_size = 0;    // largest chunk handed out
  int64_t bytes_limit = 0;           // device bytes the allocator may use
  int64_t bytes_reserved = 0;        // device bytes obtained in regions
  int64_t peak_bytes_reserved = 0;
  int64_t bytes_reservable_limit = 0;

  // --- LMS (TFLMS v2 names) ---
  int64_t bytes_inactive = 0;        // resident, unpinned, reclaimable
  int64_t bytes_active = 0;          // in use and not reclaimable
  int64_t peak_bytes_active = 0;
  int64_t bytes_reclaimed = 0;       // cumulative bytes copied device->host
  int64_t current_bytes_reclaimed = 0;  // bytes that live only on the host now
  int64_t peak_bytes_reclaimed = 0;
  int64_t num_single_reclaims = 0;
  int64_t num_fragment_reclaims = 0;
  int64_t num_full_reclaims = 0;
  int64_t num_reclaim_failures = 0;  // reclaim steps that did not make room
  int64_t num_page_ins = 0;
  int64_t bytes_paged_in = 0;

  // --- host pool (gpu_host_bfc in TensorFlow) ---
  int64_t host_bytes_in_use = 0;
  int64_t host_peak_bytes_in_use = 0;
  // Host copies scattered over several chunks of the host pool because no
  // one chunk held them (host_pool.cc): its free bytes were split by
  // copies of other sizes. Each piece is one more copy each way.
  int64_t num_scattered_host_copies = 0;
  int64_t host_bytes_limit = 0;

  // --- defragmentation ---
  int64_t num_defragmentations = 0;
  int64_t bytes_defragged = 0;       // bytes moved device->device

  // --- groups one kernel pins together (gather.cc) ---
  // Groups whose members, pinned where they were, would have split every
  // gap large enough for all of them: paged out and back into one run.
  int64_t num_group_gathers = 0;
  int64_t bytes_group_gathered = 0;  // bytes paged back into such runs
  // Buffers paged out and back in before their pin because, pinned where
  // they lay, they would have left no gap as large as themselves.
  int64_t num_stranded_round_trips = 0;
  // Kernels whose inputs, pinned where they lay, would have left the
  // learned step's coming output no gap: inputs in the way moved (or came
  // back from the host) before the first pin (due_group.cc), and their bytes.
  int64_t num_due_group_placements = 0;
  int64_t bytes_due_group_placed = 0;
  // Allocations that found room only by moving inactive buffers within the
  // device once the host pool was full, with defragmentation off (its
  // moves count in num_defragmentations and bytes_defragged too).
  int64_t num_host_full_defrags = 0;
  // Allocations that found room only once reclaimed buffers came back into
  // free device chunks the request could not use, so that the full host
  // pool could take a victim (exchange.cc), and the bytes brought back.
  int64_t num_host_exchanges = 0;
  int64_t bytes_host_exchanged = 0;
  // Page-ins for which neither memory had room, done by trading places with
  // a victim of the same size through a staging piece of free device
  // memory (swap.cc), and the bytes that came in.
  int64_t num_swaps_in_place = 0;
  int64_t bytes_swapped_in_place = 0;

  // --- prefetch ---
  int64_t num_prefetches = 0;        // page-ins issued ahead of use
  int64_t prefetch_hits = 0;         // pins of a buffer a prefetch brought in
  int64_t prefetch_misses = 0;       // pins that had to page in on demand
  // Bytes those pins paged in: on a GPU the kernel waits for each such copy
  // (stream-ordered, so the host does not), which page_in_stall_ns cannot
  // show; prefetch is meant to shrink it.
  int64_t bytes_paged_in_on_demand = 0;
  // Of prefetch_hits, those whose copy was still in flight when the pin
  // ordered the kernel after it, and their bytes. Where kernels run as they
  // are launched (the CPU harness) each such kernel waited for the rest of
  // its copy; on a GPU the host usually runs ahead of the kernels, and the
  // copy may land before the kernel starts, so there it is an upper bound.
  int64_t prefetch_hits_in_flight = 0;
  int64_t bytes_prefetched_in_flight = 0;
  // Of num_prefetches, those started where the step's plan found room for
  // the tensor (planned page-ins) rather than within the look-ahead.
  int64_t num_planned_prefetches = 0;
  // Of num_planned_prefetches, those started with more than a quarter of
  // the prefetch budget still landing, because nothing the step pins before
  // the tensor's use was on the host: behind copies needed sooner only.
  int64_t num_planned_prefetches_queued = 0;
  // Prefetched buffers evicted again before their first pin, and their
  // bytes: their host copy was still valid (kept until that pin), so they
  // left without a copy and without the host waiting.
  int64_t num_clean_evictions = 0;
  int64_t bytes_evicted_clean = 0;
  // Padding given back from in-use chunks (padding.cc) when an allocation
  // found no room while the engine followed a step's plan.
  int64_t bytes_padding_trimmed = 0;
  // Step learning: steps told apart (StepBegin, or found from the step ids
  // at the pin sites), pins recorded, and those found in the learned order
  // near where the step had got to. A low share in order means the steps
  // do not repeat closely enough for prefetch to follow them.
  int64_t num_prefetch_steps = 0;
  int64_t prefetch_pins = 0;
  int64_t prefetch_pins_in_order = 0;
  // Steps the prefetch guard ran without prefetch: its trials of paging on
  // demand, and the steps after a trial found that faster.
  int64_t num_prefetch_paused_steps = 0;
  // Page-outs started ahead of pressure (at a buffer's last use before the
  // learned step needs its room), and those taken back because the buffer
  // was pinned or freed before the copy was settled.
  int64_t num_early_page_outs = 0;
  int64_t num_early_page_outs_cancelled = 0;
  // The layout look-ahead (EngineOptions::layout_lookahead): looks made for
  // planned copies in; of those, the ones that found no place; refusals
  // given again without a look, the free chunks unchanged since the last;
  // and what the looks' host time grows with: the step events they
  // modelled (resolved once, then replayed once per place tried) and the
  // free ranges their best fits scanned.
  int64_t num_layout_looks = 0;
  int64_t num_layout_looks_refused = 0;
  int64_t num_layout_looks_repeated = 0;
  int64_t layout_look_events = 0;
  int64_t layout_look_ranges_scanned = 0;
  int64_t page_in_stall_ns = 0;      // host time pins blocked on copies
  int64_t page_out_wait_ns = 0;      // host time reclaims waited for D2H
  // The host throttle (EngineOptions::run_ahead_epochs): epoch closes at
  // which it looked at how far the GPU's compute stream had got; of those,
  // the ones where the GPU was behind the limit and the host blocked until
  // it caught up; and the host time that blocking took.
  int64_t num_run_ahead_checks = 0;
  int64_t num_run_ahead_waits = 0;
  int64_t run_ahead_wait_ns = 0;

  // --- where allocations were served from (PyTorch LMS style) ---
  int64_t num_allocs_from_free = 0;        // an existing free chunk
  int64_t num_allocs_from_new_region = 0;  // after growing the pool
  int64_t num_allocs_from_single_reclaim = 0;
  int64_t num_allocs_from_fragment_reclaim = 0;
  int64_t num_allocs_from_full_reclaim = 0;
  int64_t num_allocs_from_defrag = 0;

  int64_t num_ooms = 0;

  // --- fixed-address mode (all 0 without it) ---
  // In that mode bytes_in_use counts the chunks of resident allocations,
  // bytes_reserved the mapped physical pages, bytes_limit the page budget.
  // Every page of the budget is exactly one of in use (mapped, a resident
  // allocation on it), cached (mapped, none on it: freed, kept mapped until
  // pages are needed), or free (not mapped):
  //   physical_bytes_in_use + physical_bytes_cached + physical_bytes_free
  //     == bytes_limit rounded down to pages
  // physical_bytes_evicted: unmapped virtual pages that evicted buffers
  // occupy (what their page-ins will map again); not part of the budget.
  int64_t page_size = 0;
  int64_t physical_bytes_in_use = 0;
  int64_t physical_bytes_cached = 0;
  int64_t physical_bytes_free = 0;
  int64_t physical_bytes_evicted = 0;
  int64_t virtual_bytes_reserved = 0;  // the reserved address range
  int64_t virtual_bytes_in_use = 0;    // chunks of resident + evicted
  int64_t num_pages_mapped = 0;        // cumulative page maps
  int64_t num_pages_unmapped = 0;      // cumulative page unmaps
  int64_t num_map_failures = 0;        // MapPages/UnmapPages calls that failed

  // Name/value pairs in a stable order (bindings and logs use this).
  std::vector<std::pair<std::string, int64_t>> Items() const;
};

}  // namespace tflms

#endif  // TFLMS_CORE_STATS_H_
