// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Exchange: host room for one victim, made by bringing other buffers back.
//
// A model run at the edge of both memories reaches ops where everything live
// fills the device and the host pool together. There the allocation ladder
// (engine.cc) can end with the pool full, a victim V on the device whose
// chunk with its free neighbours would hold the request, and free device
// chunks elsewhere, too small or too scattered for the request, yet able to
// take back reclaimed buffers worth what the pool lacks for V. Paging those
// buffers in frees their host copies; V then fits on the host, and its chunk
// holds the request. The live bytes fit the two memories together; what
// failed was which side each buffer was on. UNet3D at 480^3 on an 80 GB A100
// with prefetch ran out of memory in step 3 at a 14.2 GB gradient: five
// 14.2 GB buffers on the device around 12.3 GB of free chunks (10.4 GB the
// largest), 4.6 GB free in the 128 GiB pool. On demand the same op passed
// with the buffers sorted differently.
//
// Victims are tried as the single reclaim orders them (reclaim.cc: the one
// pinned again furthest ahead in a learned step, else the least recently
// used), each with a span (its chunk and free neighbours) that holds the
// request, until one leaves enough room outside what the request needs: the
// free chunks beyond the span, and the far ends of the free chunks within
// it that the request does not need. UNet3D at 480^3 on an H100, drained
// every step, lacked 0.8 GB in step 26 without those ends. The
// buffers brought back are those the learned step needs soonest (their
// page-in is then a prefetch), or without one the largest first (fewest
// copies); each goes into the tightest such chunk that holds it.
//
// Invariants: the plan is made whole before anything moves, and nothing
// moves unless it frees at least what the pool lacks for V. What is placed
// within V's span lies at the far ends of its free chunks and totals at most
// the span's bytes beyond the request, so V's page-out still leaves the
// request a run of its size. A page-in that fails leaves its buffer on the
// host with its copy intact (PageIn); mu_ is released during each copy, so
// every buffer's state and every destination are looked at again before
// each one. Never in fixed-address mode, where no chunk is fragmented
// physically.
#include <algorithm>
#include <utility>
#include <vector>

#include "engine_impl.h"

namespace tflms {
namespace {

// Victims planned for per exchange: each plan walks every chunk.
constexpr size_t kMaxVictimsTried = 16;

struct Hole {
  const char* next = nullptr;  // where the next buffer placed here starts,
                               // or (downward) ends
  size_t left = 0;
  bool downward = false;  // filled from its top: the victim lies below
};

}  // namespace

bool Engine::Impl::ExchangeForVictimLocked(std::unique_lock<std::mutex>& lock,
                                           size_t rounded,
                                           size_t protect_until,
                                           Status* host_status) {
  if (fixed_ || host_pool_->limit() == 0) return false;

  // Host copies that only wait to be released count as free: PageOut
  // releases them when the pool refuses.
  size_t releasable = 0;
  for (const PendingHostFree& p : pending_host_frees_) releasable += p.bytes;
  std::vector<Buffer*> on_host;
  ForEachBuffer([&](Buffer* b) {
    if (b->clean_host != nullptr) releasable += b->clean_host_bytes;
    if (b->state == BufferState::kReclaimed && !b->free_requested &&
        b->host_ptr != nullptr) {
      on_host.push_back(b);
    }
  });
  if (on_host.empty()) return false;
  const size_t pool_in_use = host_pool_->bytes_in_use();
  const size_t host_free =
      (host_pool_->limit() > pool_in_use ? host_pool_->limit() - pool_in_use
                                         : 0) +
      releasable;

  const bool learned = FollowingLearnedOrder();
  std::vector<std::pair<size_t, Buffer*>> order;
  order.reserve(on_host.size());
  for (Buffer* b : on_host) {
    // Ascending keys: the soonest next use, or the largest size.
    order.emplace_back(learned ? NextUse(b) : SIZE_MAX - b->size, b);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.first < b.first;
  });

  // The victims the single reclaim would take, in its order.
  const size_t in_use = arena_->bytes_in_use();
  std::vector<std::pair<size_t, Buffer*>> victims;
  for (Buffer* b = lru_head_; b != nullptr; b = b->lru_next) {
    if (!SingleVictimHolds(b, rounded, in_use)) continue;
    const size_t next = learned ? NextUse(b) : 0;
    if (learned && protect_until != 0 && next <= protect_until) continue;
    victims.emplace_back(next, b);
  }
  if (learned) {
    std::stable_sort(victims.begin(), victims.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
  }
  if (victims.size() > kMaxVictimsTried) victims.resize(kMaxVictimsTried);

  for (const auto& candidate : victims) {
    Buffer* victim = candidate.second;
    const size_t want = BfcArena::RoundedBytes(victim->size);
    if (host_free >= want) continue;  // refused for another reason
    const size_t lacking = want - host_free;

    const BfcArena::Chunk* vc = arena_->chunk(victim->chunk);
    // Not structured bindings: the lambda below captures them (C++17).
    const std::pair<const char*, const char*> span =
        arena_->SpanOf(victim->chunk);
    const char* const span_lo = span.first;
    const char* const span_hi = span.second;
    // The span's free chunks may take what the request leaves of them, at
    // their far ends: the low end of the one below the victim, the high end
    // of the one above.
    std::vector<Hole> holes;
    size_t surplus = static_cast<size_t>(span_hi - span_lo) - rounded;
    if (span_lo < vc->ptr && surplus > 0) {
      const size_t n = std::min<size_t>(vc->ptr - span_lo, surplus);
      holes.push_back({span_lo, n, false});
      surplus -= n;
    }
    if (span_hi > vc->ptr + vc->size && surplus > 0) {
      const size_t n = std::min<size_t>(span_hi - (vc->ptr + vc->size), surplus);
      holes.push_back({span_hi, n, true});
    }
    arena_->ForEachRegion([&](BfcArena::ChunkHandle first) {
      for (BfcArena::ChunkHandle h = first; h != BfcArena::kInvalidChunk;
           h = arena_->chunk(h)->next) {
        const BfcArena::Chunk* c = arena_->chunk(h);
        if (c->in_use() || (c->ptr < span_hi && c->ptr + c->size > span_lo)) {
          continue;
        }
        holes.push_back({c->ptr, c->size, false});
      }
    });
    if (holes.empty()) continue;

    // Each buffer into the tightest hole left that holds it, until the host
    // copies freed cover what the pool lacks.
    size_t device_room = lms_limit_ > in_use ? lms_limit_ - in_use : 0;
    std::vector<std::pair<Buffer*, const char*>> plan;
    size_t freed = 0;
    for (const auto& entry : order) {
      if (freed >= lacking) break;
      Buffer* b = entry.second;
      const size_t need = BfcArena::RoundedBytes(b->size);
      if (need > device_room) continue;
      Hole* best = nullptr;
      for (Hole& hole : holes) {
        if (hole.left >= need && (best == nullptr || hole.left < best->left)) {
          best = &hole;
        }
      }
      if (best == nullptr) continue;
      if (best->downward) {
        best->next -= need;
        plan.emplace_back(b, best->next);
      } else {
        plan.emplace_back(b, best->next);
        best->next += need;
      }
      best->left -= need;
      device_room -= need;
      freed += b->host_bytes;
    }
    if (freed < lacking) continue;

    const int64_t victim_id = victim->id;
    bool any = false;
    for (const auto& [b, lo] : plan) {
      // Another thread may have paged it in, pinned or freed it, or taken
      // the destination, while a copy before it ran without mu_.
      if (b->state != BufferState::kReclaimed || b->free_requested) continue;
      const size_t need = BfcArena::RoundedBytes(b->size);
      if (need > DeviceBytesLeftLocked()) continue;
      BfcArena::ChunkHandle h = arena_->TakeFreeRange(lo, need, b->size, b);
      if (h == BfcArena::kInvalidChunk) continue;
      if (!PageIn(lock, b, /*for_prefetch=*/false, 0, false, h).ok()) continue;
      counters_.bytes_host_exchanged += static_cast<int64_t>(b->size);
      any = true;
    }
    if (!any) return false;
    ++counters_.num_host_exchanges;
    // mu_ was released: the victim may have been freed (and its Buffer
    // reused) or pinned meanwhile.
    bool still_there = false;
    ForEachBuffer([&](const Buffer* b) {
      if (b == victim && b->id == victim_id) still_there = true;
    });
    if (!still_there || !Reclaimable(victim)) return false;
    size_t reclaimed = 0;
    Status s = PageOut(lock, {victim}, &reclaimed);
    if (!s.ok()) *host_status = s;
    if (reclaimed == 0) return false;
    ++counters_.num_single_reclaims;
    return true;
  }
  return false;
}

}  // namespace tflms
