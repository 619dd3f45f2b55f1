// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Engine tests over the sim backend, run plain, under ASan+UBSan and under
// TSan (make cpp-test, make sanitize). Every test checks bytes, not only
// counters: a buffer's content is a function of (id, generation) and is
// verified after every kind of move.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bfc_arena.h"
#include "forwarding_device.h"
#include "host_pool.h"
#include "sim_device.h"
#include "tflms/engine.h"
#include "sim_kernels.h"
#include "training_workload.h"

namespace tflms {
namespace {

struct TestCase {
  const char* name;
  std::function<void()> fn;
};
std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}
struct Register {
  Register(const char* name, std::function<void()> fn) {
    Registry().push_back({name, std::move(fn)});
  }
};
int g_failures = 0;

#define TEST(name)                                  \
  void name();                                      \
  Register register_##name(#name, name);            \
  void name()
#define EXPECT(cond)                                                      \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "  %s:%d: expected %s\n", __FILE__, __LINE__, \
                   #cond);                                                \
      ++g_failures;                                                       \
    }                                                                     \
  } while (0)
#define EXPECT_OK(expr)                                                   \
  do {                                                                    \
    Status _s = (expr);                                                   \
    if (!_s.ok()) {                                                       \
      std::fprintf(stderr, "  %s:%d: %s\n", __FILE__, __LINE__,          \
                   _s.ToString().c_str());                                \
      ++g_failures;                                                       \
    }                                                                     \
  } while (0)

constexpr size_t kMiB = size_t{1} << 20;

struct Fixture {
  explicit Fixture(size_t device, size_t host, bool lms = true,
                   bool defrag = false, bool prefetch = false,
                   size_t prefetch_budget = 0, bool allow_growth = true,
                   double fragmentation_fraction = 0.0,
                   bool unfragmented = false) {
    SimOptions so;
    so.device_memory =
        device * (unfragmented ? kUnfragmentedAddressFactor : size_t{1});
    device_ = std::make_unique<SimDevice>(so);
    EngineOptions eo;
    eo.memory_limit = device;
    eo.host_memory_limit = host;
    eo.lms_enabled = lms;
    eo.defrag_enabled = defrag;
    eo.verify_moves = true;
    eo.verify_pins = true;
    eo.prefetch_enabled = prefetch;
    eo.prefetch_budget_bytes = prefetch_budget;
    eo.allow_growth = allow_growth;
    eo.fragmentation_fraction = fragmentation_fraction;
    eo.unfragmented = unfragmented;
    engine_ = std::make_unique<Engine>(device_.get(), eo);
    Status s = engine_->Init();
    if (!s.ok()) std::fprintf(stderr, "init: %s\n", s.ToString().c_str());
  }
  std::unique_ptr<SimDevice> device_;
  std::unique_ptr<Engine> engine_;
};

std::string Pattern(size_t size, uint32_t seed) {
  std::string s(size, '\0');
  std::minstd_rand rng(seed + 1);
  for (size_t i = 0; i < size; i += 4) {
    uint32_t v = rng();
    std::memcpy(&s[i], &v, std::min<size_t>(4, size - i));
  }
  return s;
}

bool Holds(Engine* e, Buffer* b, const std::string& expected) {
  std::string got(expected.size(), '\0');
  Status s = e->ReadBuffer(b, 0, &got[0], got.size());
  if (!s.ok()) {
    std::fprintf(stderr, "  read failed: %s\n", s.ToString().c_str());
    return false;
  }
  if (got != expected) {
    size_t i = 0;
    while (got[i] == expected[i]) ++i;
    std::fprintf(stderr, "  bytes differ from offset %zu of %zu\n", i,
                 got.size());
  }
  return got == expected;
}

TEST(BfcCoalescesAndReusesFreedSpace) {
  Fixture f(4 * kMiB, 0, /*lms=*/false);
  Status s;
  void* a = f.engine_->AllocateRaw(1000, &s);
  void* b = f.engine_->AllocateRaw(1000, &s);
  EXPECT(a != nullptr && b != nullptr);
  EXPECT(f.engine_->AllocatedSize(a) == 1024);
  EXPECT(f.engine_->RequestedSize(a) == 1000);
  f.engine_->DeallocateRaw(a);
  f.engine_->DeallocateRaw(b);
  EXPECT_OK(f.engine_->CheckInvariants());
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.bytes_in_use == 0);
  EXPECT(st.num_allocs == 2);
  size_t largest, total;
  f.engine_->GetFreeSpace(&largest, &total);
  EXPECT(largest == total);  // everything coalesced back into one chunk
}

// Host memory as the arena's device: its addresses are real and ordered.
class HostBlocks : public SubAllocator {
 public:
  void* Alloc(size_t bytes, size_t alignment) override {
    return std::aligned_alloc(alignment, bytes);
  }
  void Free(void* ptr, size_t) override { std::free(ptr); }
};

// A 64 KiB arena over host memory, one region, every chunk split to size.
struct SmallArena {
  static BfcArena::Options Options() {
    BfcArena::Options options;
    options.memory_limit = 64 * 1024;
    options.split_always = true;
    return options;
  }
  SmallArena() : arena(&blocks, Options()) {
    EXPECT(arena.Extend(Options().memory_limit));
  }
  HostBlocks blocks;
  BfcArena arena;
};

TEST(ArenaVisitsTheChunksInUseThatOverlapARange) {
  SmallArena small;
  BfcArena& arena = small.arena;
  std::vector<BfcArena::ChunkHandle> h;
  for (int i = 0; i < 6; ++i) {
    h.push_back(arena.FindChunk(4096, 4096, nullptr));
    EXPECT(h.back() != BfcArena::kInvalidChunk);
  }
  arena.FreeChunk(h[2], 0);
  const char* at[6];
  for (int i = 0; i < 6; ++i) at[i] = arena.chunk(h[i])->ptr;
  EXPECT(at[0] < at[1] && at[1] < at[3] && at[3] < at[4]);
  auto visited = [&](const char* lo, const char* hi) {
    std::vector<const char*> seen;
    arena.ForEachInUseIn(lo, hi, [&](const BfcArena::Chunk& c) {
      seen.push_back(c.ptr);
    });
    return seen;
  };
  // A chunk counts if any of its bytes is in the range (chunk 0 by its last
  // byte, chunk 4 by its first); the free chunk 2 does not.
  EXPECT((visited(at[1] - 1, at[4] + 1) ==
          std::vector<const char*>{at[0], at[1], at[3], at[4]}));
  // Ends are half-open: a chunk ending at lo or starting at hi is outside.
  EXPECT((visited(at[1], at[4]) == std::vector<const char*>{at[1], at[3]}));
  EXPECT(visited(at[2], at[3]).empty());
  EXPECT(visited(at[3], at[3]).empty());
  for (int i : {0, 1, 3, 4, 5}) arena.FreeChunk(h[i], 0);
}

TEST(ArenaTakesARangeInsideAFreeChunkOnlyWhenAskedTo) {
  // A 24 KiB free chunk between two in-use ones. TakeFreeRange takes a
  // range only at one of its ends; TakeFreeRangeInside also takes one in
  // its middle, leaving free chunks below and above, which merge back when
  // the range is freed.
  SmallArena small;
  BfcArena& arena = small.arena;
  std::vector<BfcArena::ChunkHandle> h;
  for (size_t bytes : {8192, 24576, 8192}) {
    h.push_back(arena.FindChunk(bytes, bytes, nullptr));
  }
  const char* base = arena.chunk(h[1])->ptr;
  arena.FreeChunk(h[1], 0);
  const char* mid = base + 8192;
  EXPECT(arena.TakeFreeRange(mid, 8192, 8192, nullptr) ==
         BfcArena::kInvalidChunk);
  const BfcArena::ChunkHandle got =
      arena.TakeFreeRangeInside(mid, 8192, 8192, nullptr);
  EXPECT(got != BfcArena::kInvalidChunk);
  EXPECT(arena.chunk(got)->ptr == mid && arena.chunk(got)->size == 8192);
  const BfcArena::Chunk* below = arena.chunk(arena.chunk(got)->prev);
  const BfcArena::Chunk* above = arena.chunk(arena.chunk(got)->next);
  EXPECT(!below->in_use() && below->ptr == base && below->size == 8192);
  EXPECT(!above->in_use() && above->ptr == mid + 8192 && above->size == 8192);
  // Across an in-use chunk: refused, nothing split.
  EXPECT(arena.TakeFreeRangeInside(base + 4096, 8192, 8192, nullptr) ==
         BfcArena::kInvalidChunk);
  // Both free neighbours serve FindChunk again.
  const BfcArena::ChunkHandle a = arena.FindChunk(8192, 8192, nullptr);
  const BfcArena::ChunkHandle b = arena.FindChunk(8192, 8192, nullptr);
  EXPECT(a != BfcArena::kInvalidChunk && b != BfcArena::kInvalidChunk);
  for (BfcArena::ChunkHandle x : {a, b, got}) arena.FreeChunk(x, 0);
  arena.FreeChunk(h[0], 0);
  arena.FreeChunk(h[2], 0);
  EXPECT(arena.bytes_in_use() == 0);
}

// Addresses without memory behind them: the arena never touches a chunk's
// bytes, so a device of any size can be indexed.
class AddressOnlyBlocks : public SubAllocator {
 public:
  void* Alloc(size_t, size_t) override {
    return reinterpret_cast<void*>(uintptr_t{1} << 46);
  }
  void Free(void*, size_t) override {}
};

long MaxResidentKiB() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

TEST(AnArenaOfAnySizeCostsHostMemoryOnlyWhereChunksStart) {
  // One 4 TiB region (TensorFlow's default: no growth). A table filled for
  // every 256 bytes, as TensorFlow keeps, would be 128 GiB of host memory.
  AddressOnlyBlocks blocks;
  BfcArena::Options options;
  options.memory_limit = size_t{4} << 40;
  options.allow_growth = false;
  const long before = MaxResidentKiB();
  BfcArena arena(&blocks, options);
  EXPECT(arena.Extend(256));
  // Chunks at the bottom, in the middle and at the top of the region.
  std::vector<BfcArena::ChunkHandle> h;
  for (size_t bytes : {size_t{1} << 20, size_t{2} << 40, size_t{1} << 20}) {
    h.push_back(arena.FindChunk(bytes, bytes, nullptr));
    EXPECT(h.back() != BfcArena::kInvalidChunk);
  }
  const char* top = arena.chunk(h[2])->ptr;
  EXPECT(arena.HandleFor(top) == h[2]);
  EXPECT(arena.HandleFor(top + 256) == BfcArena::kInvalidChunk);
  for (BfcArena::ChunkHandle x : h) arena.FreeChunk(x, 0);
  EXPECT(arena.bytes_in_use() == 0 &&
         arena.LargestFreeChunk() == options.memory_limit);
  EXPECT(MaxResidentKiB() - before < 64 * 1024);
}

TEST(OversubscribedWorkingSetKeepsEveryByte) {
  // 8x the device in live buffers; every buffer read back exactly.
  Fixture f(2 * kMiB, 64 * kMiB);
  std::vector<Buffer*> bufs;
  std::vector<std::string> data;
  for (int i = 0; i < 64; ++i) {
    Status s;
    Buffer* b = f.engine_->AllocateBuffer(256 * 1024, false, &s);
    EXPECT_OK(s);
    if (b == nullptr) return;
    data.push_back(Pattern(256 * 1024, i));
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, data.back().data(), 256 * 1024));
    bufs.push_back(b);
  }
  EXPECT_OK(f.engine_->CheckInvariants());
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.bytes_reclaimed > 0 && st.num_page_ins > 0);
  EXPECT(st.bytes_active + st.bytes_inactive == st.bytes_in_use);
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
  st = f.engine_->GetStats();
  EXPECT(st.bytes_in_use == 0 && st.current_bytes_reclaimed == 0);
  EXPECT(st.host_bytes_in_use == 0);
}

TEST(LmsOffFailsAtOnceWithHint) {
  Fixture f(1 * kMiB, 0, /*lms=*/false);
  Status s;
  std::vector<Buffer*> bufs;
  for (int i = 0; i < 8; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(200 * 1024, false, &s);
    if (b == nullptr) break;
    bufs.push_back(b);
  }
  EXPECT(bufs.size() < 8);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("set_lms_enabled") != std::string::npos);
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
}

// Every statistic but num_ooms, to prove a rejected request touched nothing.
bool SameStatsButOoms(const EngineStats& a, const EngineStats& b) {
  const auto ia = a.Items();
  const auto ib = b.Items();
  bool same = ia.size() == ib.size();
  for (size_t i = 0; same && i < ia.size(); ++i) {
    if (ia[i].first == "num_ooms") continue;
    if (ia[i] != ib[i]) {
      std::fprintf(stderr, "  %s changed: %lld -> %lld\n", ia[i].first.c_str(),
                   static_cast<long long>(ia[i].second),
                   static_cast<long long>(ib[i].second));
      same = false;
    }
  }
  return same;
}

bool Contains(const Status& s, const std::string& text) {
  if (s.message().find(text) != std::string::npos) return true;
  std::fprintf(stderr, "  \"%s\" not in: %s\n", text.c_str(),
               s.ToString().c_str());
  return false;
}

TEST(OverflowingRequestIsRejectedTouchingNothing) {
  // Sizes whose 256-byte rounding wraps around size_t must not become a
  // zero-size chunk.
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  Buffer* keep = f.engine_->AllocateBuffer(4096, false, &s);
  EXPECT_OK(s);
  const std::string data = Pattern(4096, 11);
  EXPECT_OK(f.engine_->WriteBuffer(keep, 0, data.data(), data.size()));
  const EngineStats before = f.engine_->GetStats();
  const size_t sizes[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 255,
                          SIZE_MAX / 2 + 1};
  for (size_t bytes : sizes) {
    s = Status::Ok();
    void* raw = f.engine_->AllocateRaw(bytes, &s);
    EXPECT(raw == nullptr);
    EXPECT(s.code() == Code::kResourceExhausted);
    EXPECT(Contains(s, "exceeds the device memory limit"));
    if (raw != nullptr) f.engine_->DeallocateRaw(raw);
    s = Status::Ok();
    Buffer* b = f.engine_->AllocateBuffer(bytes, false, &s);
    EXPECT(b == nullptr);
    EXPECT(s.code() == Code::kResourceExhausted);
    EXPECT(Contains(s, "exceeds the device memory limit"));
    if (b != nullptr) (void)f.engine_->FreeBuffer(b);
  }
  const EngineStats after = f.engine_->GetStats();
  EXPECT(SameStatsButOoms(before, after));
  EXPECT(after.num_ooms == before.num_ooms + 8);
  EXPECT_OK(f.engine_->CheckInvariants());
  EXPECT(f.engine_->GetBufferState(keep) == BufferState::kResident);
  EXPECT(Holds(f.engine_.get(), keep, data));
  EXPECT_OK(f.engine_->FreeBuffer(keep));
}

TEST(RequestLargerThanDeviceFailsAtOncePagingNothingOut) {
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  std::vector<Buffer*> bufs;
  std::vector<std::string> data;
  for (int i = 0; i < 3; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(256 * 1024, false, &s);
    EXPECT_OK(s);
    if (b == nullptr) return;
    data.push_back(Pattern(256 * 1024, 40 + i));
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, data.back().data(), 256 * 1024));
    bufs.push_back(b);
  }
  const EngineStats before = f.engine_->GetStats();
  EXPECT(before.bytes_inactive > 0 && before.bytes_reclaimed == 0);

  Buffer* big = f.engine_->AllocateBuffer(kMiB + 1, false, &s);
  EXPECT(big == nullptr && s.code() == Code::kResourceExhausted);
  EXPECT(Contains(s, "exceeds the device memory limit"));
  EXPECT(Contains(s, std::to_string(kMiB + 1) + " bytes"));
  EXPECT(Contains(s, std::to_string(kMiB) + " bytes"));
  if (big != nullptr) (void)f.engine_->FreeBuffer(big);
  void* raw = f.engine_->AllocateRaw(2 * kMiB, &s);
  EXPECT(raw == nullptr && s.code() == Code::kResourceExhausted);
  EXPECT(Contains(s, "exceeds the device memory limit"));
  if (raw != nullptr) f.engine_->DeallocateRaw(raw);

  const EngineStats after = f.engine_->GetStats();
  EXPECT(after.bytes_reclaimed == before.bytes_reclaimed);
  EXPECT(after.num_single_reclaims == 0 && after.num_fragment_reclaims == 0 &&
         after.num_full_reclaims == 0 && after.num_reclaim_failures == 0);
  EXPECT(SameStatsButOoms(before, after));
  EXPECT(after.num_ooms == before.num_ooms + 2);
  for (Buffer* b : bufs) {
    EXPECT(f.engine_->GetBufferState(b) == BufferState::kResident);
  }

  // The whole device is still a valid request: it reclaims and succeeds.
  Buffer* whole = f.engine_->AllocateBuffer(kMiB, true, &s);
  EXPECT_OK(s);
  EXPECT(whole != nullptr);
  if (whole != nullptr) {
    EXPECT_OK(f.engine_->Unpin(whole));
    EXPECT_OK(f.engine_->FreeBuffer(whole));
  }
  for (size_t i = 0; i < bufs.size(); ++i) {
    EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
    EXPECT_OK(f.engine_->FreeBuffer(bufs[i]));
  }
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(RequestThatOnlyRoundingMakesTooLargeIsRejected) {
  // A limit that is not a multiple of 256: regions are whole 256-byte units,
  // so limit - 50 bytes can never be served, with or without LMS.
  for (bool lms : {true, false}) {
    Fixture f(kMiB + 100, 16 * kMiB, lms);
    Status s;
    Buffer* b = f.engine_->AllocateBuffer(kMiB + 50, false, &s);
    EXPECT(b == nullptr && s.code() == Code::kResourceExhausted);
    EXPECT(Contains(s, "exceeds the device memory limit of " +
                           std::to_string(kMiB + 100) + " bytes"));
    EXPECT(Contains(s, std::to_string(kMiB + 256) + " bytes"));
    if (b != nullptr) (void)f.engine_->FreeBuffer(b);
    void* raw = f.engine_->AllocateRaw(kMiB, &s);  // the usable maximum
    EXPECT_OK(s);
    EXPECT(raw != nullptr);
    f.engine_->DeallocateRaw(raw);
  }
}

TEST(ClearStatsRestartsPeaksAndCountersButKeepsState) {
  Fixture f(1 * kMiB, 16 * kMiB, /*lms=*/true, /*defrag=*/true);
  Status s;
  std::vector<Buffer*> bufs;
  std::vector<std::string> data;
  for (int i = 0; i < 8; ++i) {  // twice the device: reclaims and page-ins
    Buffer* b = f.engine_->AllocateBuffer(256 * 1024, false, &s);
    EXPECT_OK(s);
    if (b == nullptr) return;
    data.push_back(Pattern(256 * 1024, 60 + i));
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, data.back().data(), 256 * 1024));
    bufs.push_back(b);
  }
  for (int i = 0; i < 8; ++i) EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  EXPECT(f.engine_->AllocateRaw(2 * kMiB, &s) == nullptr);  // one OOM
  // Takes the last free bytes (a reclaim) and gives them back: in use drops
  // below its peak.
  void* scratch = f.engine_->AllocateRaw(256 * 1024, &s);
  EXPECT_OK(s);
  f.engine_->DeallocateRaw(scratch);
  for (int i = 0; i < 4; ++i) EXPECT_OK(f.engine_->FreeBuffer(bufs[i]));
  const EngineStats before = f.engine_->GetStats();
  EXPECT(before.num_allocs > 0 && before.bytes_reclaimed > 0 &&
         before.num_page_ins > 0 && before.num_ooms > 0 &&
         before.largest_alloc_size > 0);
  EXPECT(before.peak_bytes_in_use > before.bytes_in_use);
  EXPECT(before.peak_bytes_active > before.bytes_active);
  EXPECT(before.host_peak_bytes_in_use > before.host_bytes_in_use);

  f.engine_->ClearStats();
  const EngineStats after = f.engine_->GetStats();
  // State stays.
  EXPECT(after.bytes_in_use == before.bytes_in_use);
  EXPECT(after.bytes_reserved == before.bytes_reserved);
  EXPECT(after.bytes_active == before.bytes_active);
  EXPECT(after.bytes_inactive == before.bytes_inactive);
  EXPECT(after.current_bytes_reclaimed == before.current_bytes_reclaimed);
  EXPECT(after.host_bytes_in_use == before.host_bytes_in_use);
  EXPECT(after.bytes_limit == before.bytes_limit);
  EXPECT(after.host_bytes_limit == before.host_bytes_limit);
  // Peaks restart from the current values.
  EXPECT(after.peak_bytes_in_use == after.bytes_in_use);
  EXPECT(after.peak_bytes_reserved == after.bytes_reserved);
  EXPECT(after.peak_bytes_active == after.bytes_active);
  EXPECT(after.peak_bytes_reclaimed == after.current_bytes_reclaimed);
  EXPECT(after.host_peak_bytes_in_use == after.host_bytes_in_use);
  // Everything else (as tsl: num_allocs, largest_alloc_size) restarts at 0.
  const std::vector<std::string> kept = {
      "bytes_in_use",           "peak_bytes_in_use",
      "bytes_limit",            "bytes_reserved",
      "peak_bytes_reserved",    "bytes_reservable_limit",
      "bytes_inactive",         "bytes_active",
      "peak_bytes_active",      "current_bytes_reclaimed",
      "peak_bytes_reclaimed",   "host_bytes_in_use",
      "host_peak_bytes_in_use", "host_bytes_limit"};
  for (const auto& item : after.Items()) {
    bool is_kept = false;
    for (const std::string& k : kept) is_kept = is_kept || k == item.first;
    if (!is_kept && item.second != 0) {
      std::fprintf(stderr, "  %s is %lld after ClearStats\n",
                   item.first.c_str(), static_cast<long long>(item.second));
      EXPECT(item.second == 0);
    }
  }
  EXPECT_OK(f.engine_->CheckInvariants());

  // Counting starts over; data and buffers were not touched.
  void* raw = f.engine_->AllocateRaw(1000, &s);
  EXPECT_OK(s);
  EngineStats again = f.engine_->GetStats();
  EXPECT(again.num_allocs == 1 && again.largest_alloc_size == 1024);
  EXPECT(again.num_allocs_from_free + again.num_allocs_from_new_region == 1);
  EXPECT(again.peak_bytes_in_use == again.bytes_in_use);
  EXPECT(again.peak_bytes_active == again.bytes_active);
  f.engine_->DeallocateRaw(raw);
  for (int i = 4; i < 8; ++i) {
    EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
    EXPECT_OK(f.engine_->FreeBuffer(bufs[i]));
  }
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(ClearStatsDuringTrafficKeepsTheSnapshotInvariants) {
  // Page-outs settle with the lock released; a clear in between must not
  // leave a peak below its current value or lose a counted byte.
  Fixture f(2 * kMiB, 64 * kMiB);
  std::atomic<bool> stop{false};
  std::atomic<int> corruptions{0};
  auto worker = [&](int t) {
    std::minstd_rand rng(t);
    std::vector<std::pair<Buffer*, std::string>> mine;
    for (int op = 0; op < 300; ++op) {
      if (rng() % 3 != 0 || mine.empty()) {
        const size_t size = 1024 + rng() % (128 * 1024);
        Status s;
        Buffer* b = f.engine_->AllocateBuffer(size, false, &s);
        if (b == nullptr) continue;
        std::string d = Pattern(size, t * 100000 + op);
        (void)f.engine_->WriteBuffer(b, 0, d.data(), size);
        mine.emplace_back(b, std::move(d));
      } else {
        const size_t i = rng() % mine.size();
        if (!Holds(f.engine_.get(), mine[i].first, mine[i].second)) {
          ++corruptions;
        }
        (void)f.engine_->FreeBuffer(mine[i].first);
        mine.erase(mine.begin() + i);
      }
    }
    for (auto& m : mine) (void)f.engine_->FreeBuffer(m.first);
  };
  int bad_snapshots = 0;
  std::thread clearer([&] {
    while (!stop) {
      f.engine_->ClearStats();
      const EngineStats st = f.engine_->GetStats();
      if (st.peak_bytes_in_use < st.bytes_in_use ||
          st.peak_bytes_reserved < st.bytes_reserved ||
          st.peak_bytes_active < st.bytes_active ||
          st.peak_bytes_reclaimed < st.current_bytes_reclaimed ||
          st.host_peak_bytes_in_use < st.host_bytes_in_use ||
          st.bytes_active + st.bytes_inactive != st.bytes_in_use ||
          st.current_bytes_reclaimed > st.host_bytes_in_use) {
        ++bad_snapshots;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  stop = true;
  clearer.join();
  EXPECT(bad_snapshots == 0);
  EXPECT(corruptions == 0);
  EXPECT_OK(f.engine_->CheckInvariants());
  const EngineStats st = f.engine_->GetStats();
  EXPECT(st.bytes_in_use == 0 && st.current_bytes_reclaimed == 0);
}

TEST(PinnedBuffersAreNeverReclaimed) {
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  Buffer* pinned = f.engine_->AllocateBuffer(512 * 1024, true, &s);
  std::string p = Pattern(512 * 1024, 7);
  EXPECT_OK(f.engine_->WriteBuffer(pinned, 0, p.data(), p.size()));
  std::vector<Buffer*> others;
  for (int i = 0; i < 8; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(300 * 1024, false, &s);
    EXPECT(b != nullptr);
    if (b) others.push_back(b);
  }
  EXPECT(f.engine_->GetBufferState(pinned) == BufferState::kResident);
  EXPECT(Holds(f.engine_.get(), pinned, p));
  // A request larger than what is not pinned fails, naming the cause.
  Buffer* big = f.engine_->AllocateBuffer(700 * 1024, false, &s);
  EXPECT(big == nullptr && s.code() == Code::kResourceExhausted);
  EXPECT_OK(f.engine_->Unpin(pinned));
  EXPECT(f.engine_->Unpin(pinned).code() == Code::kFailedPrecondition);
  for (Buffer* b : others) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->FreeBuffer(pinned));
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(HostPoolFullFailsCleanly) {
  Fixture f(1 * kMiB, 300 * 1024);  // room for one page-out only
  Status s;
  std::vector<Buffer*> bufs;
  std::vector<std::string> data;
  for (int i = 0; i < 8; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(256 * 1024, false, &s);
    if (b == nullptr) break;
    data.push_back(Pattern(256 * 1024, 100 + i));
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, data.back().data(), 256 * 1024));
    bufs.push_back(b);
  }
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("TF_GPU_HOST_MEM_LIMIT_IN_MB") != std::string::npos);
  EXPECT_OK(f.engine_->CheckInvariants());
  // Resident buffers are intact; the reclaimed one is intact on the host and
  // comes back once a resident one is freed (its page-in needs no page-out).
  Buffer* reclaimed = nullptr;
  for (size_t i = 0; i < bufs.size(); ++i) {
    if (f.engine_->GetBufferState(bufs[i]) == BufferState::kReclaimed) {
      reclaimed = bufs[i];
      continue;
    }
    EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  }
  EXPECT(reclaimed != nullptr);
  EXPECT_OK(f.engine_->FreeBuffer(bufs.back()));
  bufs.pop_back();
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
}

TEST(HostPoolScattersACopyNoChunkHolds) {
  // 824 KiB of a 1 MiB pool are free, in a 400 KiB and a 424 KiB hole: a
  // 700 KiB copy goes into both, round-trips its bytes, and frees both.
  SimOptions so;
  so.device_memory = 1 * kMiB;
  SimDevice device(so);
  HostPool pool(&device, 1 * kMiB);
  Status s;
  void* a = pool.Allocate(400 * 1024, &s);
  void* b = pool.Allocate(200 * 1024, &s);
  void* c = pool.Allocate(400 * 1024, &s);
  EXPECT(a != nullptr && b != nullptr && c != nullptr);
  pool.Free(a);
  pool.Free(c);
  const size_t kBig = 700 * 1024 + 100;  // not a multiple of the rounding
  // More than is free fails and leaves the pool as it was.
  EXPECT(pool.Allocate(825 * 1024, &s) == nullptr);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(pool.bytes_in_use() == 200 * 1024);
  s = Status::Ok();
  void* d = pool.Allocate(kBig, &s);
  EXPECT_OK(s);
  EXPECT(d != nullptr);
  EXPECT(pool.PiecesOf(d) == 2);
  EXPECT(pool.PiecesOf(b) == 1);
  EXPECT(pool.num_scattered() == 1);
  const std::string bytes = Pattern(kBig, 7);
  char* dev = static_cast<char*>(device.AllocateDeviceMemory(kMiB, 256));
  EXPECT_OK(device.WriteDeviceSync(dev, bytes.data(), kBig));
  Stream* d2h = device.GetStream(StreamKind::kDeviceToHost);
  Stream* h2d = device.GetStream(StreamKind::kHostToDevice);
  EXPECT_OK(pool.CopyToHost(d2h, d, dev, kBig));
  EventRef out = device.RecordEvent(d2h, &s);
  EXPECT_OK(device.SynchronizeEvent(out));
  EXPECT_OK(device.WriteDeviceSync(dev, std::string(kBig, 'x').data(), kBig));
  EXPECT_OK(pool.CopyToDevice(h2d, dev + 256, d, kBig));
  EventRef in = device.RecordEvent(h2d, &s);
  EXPECT_OK(device.SynchronizeEvent(in));
  std::string back(kBig, '\0');
  EXPECT_OK(device.ReadDeviceSync(back.data(), dev + 256, kBig));
  EXPECT(back == bytes);
  device.FreeDeviceMemory(dev, kMiB);
  pool.Free(d);
  EXPECT(pool.bytes_in_use() == 200 * 1024);
  // Both holes are whole again: the largest request that fits one still
  // takes a single chunk.
  void* e = pool.Allocate(424 * 1024, &s);
  EXPECT(e != nullptr && pool.PiecesOf(e) == 1);
  pool.Free(e);
  pool.Free(b);
  EXPECT(pool.bytes_in_use() == 0);
}

TEST(PageOutScattersOverAFragmentedHostPool) {
  // The engine's page-out and page-in go through a scattered host copy
  // unchanged: A, B and C go to the host in that order, A and C are freed,
  // and D (700 KiB) fits only in both holes together.
  Fixture f(1 * kMiB, 1 * kMiB);
  Status s;
  std::vector<Buffer*> abc;
  for (size_t size : {400 * 1024, 200 * 1024, 400 * 1024}) {
    abc.push_back(f.engine_->AllocateBuffer(size, false, &s));
    EXPECT_OK(s);
    const std::string p = Pattern(size, static_cast<uint32_t>(size / 1024));
    EXPECT_OK(f.engine_->WriteBuffer(abc.back(), 0, p.data(), size));
  }
  size_t reclaimed = 0;
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  // Chunk bytes: the device's split rule leaves C the region's 24 KiB tail.
  EXPECT(reclaimed >= 1000 * 1024);
  EXPECT_OK(f.engine_->FreeBuffer(abc[0]));
  EXPECT_OK(f.engine_->FreeBuffer(abc[2]));
  Buffer* d = f.engine_->AllocateBuffer(700 * 1024, false, &s);
  EXPECT_OK(s);
  const std::string dbytes = Pattern(700 * 1024, 99);
  EXPECT_OK(f.engine_->WriteBuffer(d, 0, dbytes.data(), dbytes.size()));
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  EXPECT(f.engine_->GetBufferState(d) == BufferState::kReclaimed);
  EXPECT(f.engine_->GetStats().host_bytes_in_use == 900 * 1024);
  EXPECT(f.engine_->GetStats().num_scattered_host_copies == 1);
  EXPECT_OK(f.engine_->CheckInvariants());
  EXPECT(Holds(f.engine_.get(), d, dbytes));  // pins it: a page-in
  EXPECT(Holds(f.engine_.get(), abc[1],
               Pattern(200 * 1024, 200)));
  EXPECT_OK(f.engine_->FreeBuffer(d));
  EXPECT_OK(f.engine_->FreeBuffer(abc[1]));
  EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
  EXPECT_OK(f.engine_->CheckInvariants());
}

// An allocation that failed although enough memory was free: tensors in use
// split it (the out-of-memory message says so).
void ExpectPinnedApart(const Buffer* out, const Status& s) {
  EXPECT(out == nullptr && s.code() == Code::kResourceExhausted);
  EXPECT(s.message().find("fragmented by tensors in use") != std::string::npos);
}

TEST(AConcatsInputsAreGatheredBeforeItsOutput) {
  // UNet3D at 272^3 on a V100, in sixteenths of the device: a concat's input
  // A (3/16) is resident in the middle, its input B (3/16) on the host. The
  // buffers land as [F0 4 | F1 1 | F2 3 | A 3 | F3 5] and F2 is freed: the
  // only free hole B fits is right below A. Paged in there by its pin, B
  // leaves the pair in the middle with 5/16 on either side, no gap for the
  // 6/16 output with 10/16 free. Told of the concat first, the engine pages
  // B in above A instead (paging out F3), and the output fits below them.
  constexpr size_t kU = 64 * 1024;
  for (bool gather : {false, true}) {
    Fixture f(16 * kU, 4 * kMiB, /*lms=*/true, false, false, 0,
              /*allow_growth=*/false);
    Status s;
    Buffer* b = f.engine_->AllocateBuffer(3 * kU, false, &s);
    EXPECT_OK(s);
    const std::string bbytes = Pattern(3 * kU, 2);
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, bbytes.data(), bbytes.size()));
    size_t reclaimed = 0;
    EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
    EXPECT(f.engine_->GetBufferState(b) == BufferState::kReclaimed);
    std::vector<Buffer*> fill;
    Buffer* a = nullptr;
    for (size_t units : {4, 3, 1, 3, 5}) {
      Buffer* x = f.engine_->AllocateBuffer(units * kU, false, &s);
      EXPECT_OK(s);
      if (fill.size() == 1 && a == nullptr) {
        a = x;
      } else {
        fill.push_back(x);
      }
    }
    const std::string abytes = Pattern(3 * kU, 1);
    EXPECT_OK(f.engine_->WriteBuffer(a, 0, abytes.data(), abytes.size()));
    void* at_a = nullptr;
    void* at_f2 = nullptr;
    EXPECT_OK(f.engine_->Pin(a, &at_a));
    EXPECT_OK(f.engine_->Pin(fill[2], &at_f2));
    EXPECT(static_cast<char*>(at_f2) + 3 * kU == static_cast<char*>(at_a));
    EXPECT_OK(f.engine_->Unpin(a));
    EXPECT_OK(f.engine_->Unpin(fill[2]));
    EXPECT_OK(f.engine_->FreeBuffer(fill[2]));  // F2: the 3/16 hole
    Buffer* group[] = {a, b};
    if (gather) {
      f.engine_->GatherForConcat(group, 2);
      EXPECT(f.engine_->GetStats().num_group_gathers == 1);
      EXPECT(f.engine_->GetStats().bytes_group_gathered ==
             static_cast<int64_t>(3 * kU));
    }
    void* pa = nullptr;
    void* pb = nullptr;
    EXPECT_OK(f.engine_->Pin(a, &pa));
    EXPECT_OK(f.engine_->Pin(b, &pb));
    Buffer* out = f.engine_->AllocateBuffer(6 * kU, true, &s);
    if (gather) {
      EXPECT_OK(s);
      EXPECT(out != nullptr);
      EXPECT(static_cast<char*>(pb) == static_cast<char*>(pa) + 3 * kU);
      EXPECT_OK(f.engine_->Unpin(out));
      EXPECT_OK(f.engine_->FreeBuffer(out));
    } else {
      ExpectPinnedApart(out, s);
      EXPECT(static_cast<char*>(pb) + 3 * kU == static_cast<char*>(pa));
    }
    EXPECT_OK(f.engine_->Unpin(a));
    EXPECT_OK(f.engine_->Unpin(b));
    EXPECT(Holds(f.engine_.get(), a, abytes));
    EXPECT(Holds(f.engine_.get(), b, bbytes));
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(AGroupPinnedTogetherIsGatheredFirst) {
  // 31 small buffers lie between 28 KiB ones, as a loop's list elements lie
  // between its temporaries. Pinned where they are, they leave no gap for an
  // output of their total size (124 KiB), whatever is paged out: without the
  // gather the allocation fails. Told of the group first, the engine pages
  // it out and back into one run, and the output fits.
  constexpr size_t kSmall = 4 * 1024, kBig = 28 * 1024, kCount = 31;
  for (bool gather : {false, true}) {
    Fixture f(1 * kMiB, 4 * kMiB, /*lms=*/true, false, false, 0,
              /*allow_growth=*/false);
    Status s;
    std::vector<Buffer*> bigs, smalls;
    for (size_t i = 0; i < kCount; ++i) {
      bigs.push_back(f.engine_->AllocateBuffer(kBig, false, &s));
      EXPECT_OK(s);
      smalls.push_back(f.engine_->AllocateBuffer(kSmall, false, &s));
      EXPECT_OK(s);
      const std::string p = Pattern(kSmall, static_cast<uint32_t>(i));
      EXPECT_OK(f.engine_->WriteBuffer(smalls.back(), 0, p.data(), kSmall));
    }
    if (gather) {
      f.engine_->GatherForPins(smalls.data(), smalls.size());
      EXPECT(f.engine_->GetStats().num_group_gathers == 1);
      EXPECT(f.engine_->GetStats().bytes_group_gathered ==
             static_cast<int64_t>(kCount * kSmall));
      // Together now: asked again, nothing moves.
      f.engine_->GatherForPins(smalls.data(), smalls.size());
      EXPECT(f.engine_->GetStats().num_group_gathers == 1);
    }
    std::vector<char*> at;
    for (Buffer* b : smalls) {
      void* p = nullptr;
      EXPECT_OK(f.engine_->Pin(b, &p));
      at.push_back(static_cast<char*>(p));
    }
    Buffer* out = f.engine_->AllocateBuffer(kCount * kSmall, true, &s);
    if (gather) {
      EXPECT_OK(s);
      EXPECT(out != nullptr);
      const auto [lo, hi] = std::minmax_element(at.begin(), at.end());
      EXPECT(static_cast<size_t>(*hi - *lo) == (kCount - 1) * kSmall);
      EXPECT_OK(f.engine_->Unpin(out));
      EXPECT_OK(f.engine_->FreeBuffer(out));
    } else {
      ExpectPinnedApart(out, s);
    }
    for (Buffer* b : smalls) EXPECT_OK(f.engine_->Unpin(b));
    for (size_t i = 0; i < kCount; ++i) {
      EXPECT(Holds(f.engine_.get(), smalls[i],
                   Pattern(kSmall, static_cast<uint32_t>(i))));
    }
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(ABufferThatWouldLeaveNoGapItsOwnSizeComesBackBesideAWall) {
  // Paging on demand, B (240 KiB, under a quarter of the 1 MiB device) lies
  // between gaps of 224 and 128 KiB, with pinned A below and pinned W above:
  // pinned where it is, it would leave no gap for an output of its own size,
  // and neither end of its gap is free of it, so it cannot move device to
  // device. It goes to the host and comes back beside a wall, and the
  // output fits. With the round trip disabled in the engine the output is
  // out of memory (checked by hand: "fragmented by tensors in use", largest
  // free 224 KiB). Without W the gap above B is 256 KiB, enough for its own
  // size, and nothing moves. Sizes respect TensorFlow's split rule (a
  // request takes a whole free chunk under twice its size).
  constexpr size_t kK = 1024;
  for (bool walled : {true, false}) {
    Fixture f(1 * kMiB, 4 * kMiB, /*lms=*/true, false, false, 0,
              /*allow_growth=*/false);
    Status s;
    void* pa = nullptr;
    void* pw = nullptr;
    Buffer* p1 = f.engine_->AllocateBuffer(64 * kK, false, &s);
    Buffer* a = f.engine_->AllocateBuffer(240 * kK, true, &s, &pa);
    Buffer* p2 = f.engine_->AllocateBuffer(224 * kK, false, &s);
    Buffer* b = f.engine_->AllocateBuffer(240 * kK, false, &s);
    Buffer* p3 = f.engine_->AllocateBuffer((walled ? 128 : 256) * kK, false, &s);
    Buffer* w = walled ? f.engine_->AllocateBuffer(128 * kK, true, &s, &pw)
                       : nullptr;
    EXPECT_OK(s);
    const std::string pattern = Pattern(240 * kK, 7);
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, pattern.data(), pattern.size()));
    void* pb = nullptr;
    EXPECT_OK(f.engine_->Pin(b, &pb));
    size_t reclaimed = 0;
    EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));  // P1, P2, P3 leave
    EXPECT(reclaimed == (64 + 224 + (walled ? 128 : 256)) * kK);
    EXPECT_OK(f.engine_->Unpin(b));
    void* pb2 = nullptr;
    EXPECT_OK(f.engine_->Pin(b, &pb2));
    Buffer* out = f.engine_->AllocateBuffer(240 * kK, true, &s);
    EXPECT_OK(s);
    EXPECT(out != nullptr);
    const EngineStats st = f.engine_->GetStats();
    if (walled) {
      EXPECT(st.num_stranded_round_trips == 1);
      // Its kernel waits for the copy back, as for a page-in on its pin.
      EXPECT(st.bytes_paged_in_on_demand == st.bytes_paged_in &&
             st.bytes_paged_in == static_cast<int64_t>(240 * kK));
      EXPECT(static_cast<char*>(pb2) == static_cast<char*>(pa) + 240 * kK ||
             static_cast<char*>(pb2) + 240 * kK == static_cast<char*>(pw));
    } else {
      EXPECT(st.num_stranded_round_trips == 0);
      EXPECT(pb2 == pb);
    }
    EXPECT_OK(f.engine_->Unpin(out));
    EXPECT_OK(f.engine_->FreeBuffer(out));
    EXPECT_OK(f.engine_->Unpin(b));
    EXPECT(Holds(f.engine_.get(), b, pattern));
    EXPECT_OK(f.engine_->Unpin(a));
    if (w != nullptr) EXPECT_OK(f.engine_->Unpin(w));
    for (Buffer* x : {p1, a, p2, b, p3, w}) {
      if (x != nullptr) EXPECT_OK(f.engine_->FreeBuffer(x));
    }
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(WithTheHostFullBuffersComeBackSoThatAVictimCanLeave) {
  // On a 1 MiB device: V 512 KiB inactive, P 128 KiB pinned, then a 384 KiB
  // hole; S1-S3 (128 KiB each) on the host, which has 128 KiB left. An
  // output R of 512 KiB fits only where V is, and the pool cannot take V;
  // the hole is beyond P, so no slide joins it to V's chunk. The live bytes
  // fill both memories exactly (1 MiB + 512 KiB). S1-S3 come back into the
  // hole, the pool then takes V, and R gets V's chunk. With a pool of 448
  // KiB the three bring back 384 of the 448 KiB V lacks: nothing moves and
  // R is out of memory, with every byte where it was.
  constexpr size_t kK = 1024;
  for (size_t host : {512 * kK, 448 * kK}) {
    Fixture f(1 * kMiB, host, /*lms=*/true, false, false, 0,
              /*allow_growth=*/false);
    Status s;
    Buffer* v = f.engine_->AllocateBuffer(512 * kK, false, &s);
    Buffer* p = f.engine_->AllocateBuffer(128 * kK, false, &s);
    std::vector<Buffer*> small;
    for (int i = 0; i < 3; ++i) {
      small.push_back(f.engine_->AllocateBuffer(128 * kK, false, &s));
    }
    EXPECT_OK(s);
    std::vector<std::pair<Buffer*, std::string>> kept;
    for (Buffer* x : {v, p, small[0], small[1], small[2]}) {
      const size_t size = x == v ? 512 * kK : 128 * kK;
      kept.emplace_back(x, Pattern(size, static_cast<uint32_t>(kept.size())));
      EXPECT_OK(f.engine_->WriteBuffer(x, 0, kept.back().second.data(), size));
    }
    void* pv = nullptr;
    void* pp = nullptr;
    EXPECT_OK(f.engine_->Pin(v, &pv));
    EXPECT_OK(f.engine_->Pin(p, &pp));
    // W's room is S1-S3's: they leave for the host, and W's free leaves the
    // hole.
    Buffer* w = f.engine_->AllocateBuffer(384 * kK, true, &s);
    EXPECT_OK(s);
    EXPECT_OK(f.engine_->Unpin(w));
    EXPECT_OK(f.engine_->FreeBuffer(w));
    EXPECT(f.engine_->GetStats().bytes_reclaimed ==
           static_cast<int64_t>(384 * kK));
    EXPECT_OK(f.engine_->Unpin(v));
    Buffer* r = f.engine_->AllocateBuffer(512 * kK, true, &s);
    const EngineStats st = f.engine_->GetStats();
    if (host == 512 * kK) {
      EXPECT_OK(s);
      EXPECT(r != nullptr);
      EXPECT(st.num_host_exchanges == 1);
      EXPECT(st.bytes_host_exchanged == static_cast<int64_t>(384 * kK));
      EXPECT(st.num_ooms == 0);
      void* pr = nullptr;
      EXPECT_OK(f.engine_->Pin(r, &pr));
      EXPECT(pr == pv);  // V's chunk
      EXPECT_OK(f.engine_->Unpin(r));
      EXPECT_OK(f.engine_->Unpin(r));
      EXPECT_OK(f.engine_->FreeBuffer(r));
    } else {
      EXPECT(r == nullptr);
      EXPECT(s.code() == Code::kResourceExhausted);
      EXPECT(st.num_host_exchanges == 0);
      EXPECT(st.bytes_host_exchanged == 0);
      EXPECT(st.current_bytes_reclaimed == static_cast<int64_t>(384 * kK));
    }
    EXPECT_OK(f.engine_->Unpin(p));
    for (auto& [x, pattern] : kept) EXPECT(Holds(f.engine_.get(), x, pattern));
    for (auto& [x, pattern] : kept) EXPECT_OK(f.engine_->FreeBuffer(x));
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(AnExchangeMayFillTheVictimsFreeNeighbourBeyondTheRequest) {
  // On a 1 MiB device: S1 and S2 (128 KiB each) pinned at the bottom, a 256
  // KiB hole, V 512 KiB inactive at the top; T1 and T2 (128 KiB each) on
  // the host, 256 KiB of its 512 KiB free. R (512 KiB) fits only in V's
  // span (the hole and V, 768 KiB), and the pool lacks 256 KiB for V. No
  // free chunk lies outside the span, but the request leaves 256 KiB of it:
  // T1 and T2 come back into the hole's low end, V leaves, and R gets V's
  // chunk. Without the span's free chunks counted (checked by hand) R is
  // out of memory.
  constexpr size_t kK = 1024;
  Fixture f(1 * kMiB, 512 * kK, /*lms=*/true, false, false, 0,
            /*allow_growth=*/false);
  Status s;
  std::vector<Buffer*> small;
  for (int i = 0; i < 4; ++i) {
    small.push_back(f.engine_->AllocateBuffer(128 * kK, false, &s));
  }
  Buffer* v = f.engine_->AllocateBuffer(512 * kK, false, &s);
  EXPECT_OK(s);
  std::vector<std::pair<Buffer*, std::string>> kept;
  for (Buffer* x : {small[0], small[1], small[2], small[3], v}) {
    const size_t size = x == v ? 512 * kK : 128 * kK;
    kept.emplace_back(x, Pattern(size, static_cast<uint32_t>(kept.size())));
    EXPECT_OK(f.engine_->WriteBuffer(x, 0, kept.back().second.data(), size));
  }
  void* at[4] = {};
  for (int i : {0, 1}) EXPECT_OK(f.engine_->Pin(small[i], &at[i]));
  void* pv = nullptr;
  EXPECT_OK(f.engine_->Pin(v, &pv));
  EXPECT(static_cast<char*>(pv) == static_cast<char*>(at[0]) + 512 * kK);
  Buffer* w = f.engine_->AllocateBuffer(256 * kK, true, &s);  // T1, T2 leave
  EXPECT_OK(s);
  void* pw = nullptr;
  EXPECT_OK(f.engine_->Pin(w, &pw));
  EXPECT(static_cast<char*>(pw) == static_cast<char*>(at[0]) + 256 * kK);
  EXPECT_OK(f.engine_->Unpin(w));
  EXPECT_OK(f.engine_->Unpin(w));
  EXPECT_OK(f.engine_->FreeBuffer(w));
  EXPECT(f.engine_->GetStats().current_bytes_reclaimed ==
         static_cast<int64_t>(256 * kK));
  EXPECT_OK(f.engine_->Unpin(v));
  Buffer* r = f.engine_->AllocateBuffer(512 * kK, true, &s);
  EXPECT_OK(s);
  const EngineStats st = f.engine_->GetStats();
  EXPECT(st.num_host_exchanges == 1);
  EXPECT(st.bytes_host_exchanged == static_cast<int64_t>(256 * kK));
  EXPECT(st.current_bytes_reclaimed == static_cast<int64_t>(512 * kK));
  void* pr = nullptr;
  EXPECT_OK(f.engine_->Pin(r, &pr));
  EXPECT(pr == pv);
  for (int i : {2, 3}) {
    EXPECT_OK(f.engine_->Pin(small[i], &at[i]));
    EXPECT_OK(f.engine_->Unpin(small[i]));
  }
  // Both in the hole, below V's chunk.
  for (int i : {2, 3}) {
    EXPECT(static_cast<char*>(at[i]) >= static_cast<char*>(at[0]) + 256 * kK);
    EXPECT(static_cast<char*>(at[i]) < static_cast<char*>(pv));
  }
  EXPECT_OK(f.engine_->Unpin(r));
  EXPECT_OK(f.engine_->Unpin(r));
  EXPECT_OK(f.engine_->FreeBuffer(r));
  for (int i : {0, 1}) EXPECT_OK(f.engine_->Unpin(small[i]));
  for (auto& [x, pattern] : kept) EXPECT(Holds(f.engine_.get(), x, pattern));
  for (auto& [x, pattern] : kept) EXPECT_OK(f.engine_->FreeBuffer(x));
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(APageInWithNoRoomInEitherMemorySwapsPlacesWithAVictim) {
  // On a 1 MiB device: V 512 KiB inactive, P 256 KiB pinned, 256 KiB free;
  // X (512 KiB) on the host, which it fills (512 KiB). The two memories
  // together have 256 KiB free, less than X: no whole copy brings X in,
  // since V cannot leave until X's host copy is freed, which needs X in.
  // Pinning X trades the two through the free 256 KiB, in two pieces: X
  // ends in V's chunk and V in X's host allocation (checked byte for byte;
  // verify_moves also compares both inside the engine). Pinning V back
  // swaps them again. With a 1 MiB pool V simply leaves, and no swap runs.
  // Unfragmented (the arena given 4 MiB of addresses), the largest free chunk
  // spans 3.25 MiB, and a staging piece that large would put 4 MiB in use on
  // the 1 MiB device (checked by taking the bound out: the peak expectations
  // fail); the device's 256 KiB of free bytes stage it, as within the device.
  constexpr size_t kK = 1024;
  struct Case {
    size_t host;
    bool unfragmented;
  };
  for (Case c : {Case{512 * kK, false}, Case{1 * kMiB, false},
                 Case{512 * kK, true}}) {
    const size_t host = c.host;
    Fixture f(1 * kMiB, host, /*lms=*/true, false, false, 0,
              /*allow_growth=*/false, 0.0, c.unfragmented);
    Status s;
    Buffer* x = f.engine_->AllocateBuffer(512 * kK, false, &s);
    Buffer* p = f.engine_->AllocateBuffer(256 * kK, true, &s);
    EXPECT_OK(s);
    const std::string px = Pattern(512 * kK, 1);
    const std::string pp = Pattern(256 * kK, 2);
    const std::string pv = Pattern(512 * kK, 3);
    EXPECT_OK(f.engine_->WriteBuffer(x, 0, px.data(), px.size()));
    EXPECT_OK(f.engine_->WriteBuffer(p, 0, pp.data(), pp.size()));
    // V's room is X's: X leaves for the host.
    Buffer* v = f.engine_->AllocateBuffer(512 * kK, true, &s);
    EXPECT_OK(s);
    EXPECT_OK(f.engine_->WriteBuffer(v, 0, pv.data(), pv.size()));
    void* v_at = nullptr;
    EXPECT_OK(f.engine_->Pin(v, &v_at));
    EXPECT_OK(f.engine_->Unpin(v));
    EXPECT_OK(f.engine_->Unpin(v));
    EXPECT(f.engine_->GetStats().current_bytes_reclaimed ==
           static_cast<int64_t>(512 * kK));

    void* x_at = nullptr;
    EXPECT_OK(f.engine_->Pin(x, &x_at));
    EngineStats st = f.engine_->GetStats();
    EXPECT(st.num_ooms == 0);
    EXPECT(st.peak_bytes_in_use <= static_cast<int64_t>(1 * kMiB));
    EXPECT(x_at == v_at);  // V's chunk, in every case
    if (host == 512 * kK) {
      EXPECT(st.num_swaps_in_place == 1);
      EXPECT(st.bytes_swapped_in_place == static_cast<int64_t>(512 * kK));
      // X and V shared one host allocation: counted once at the peak.
      EXPECT(st.peak_bytes_reclaimed == static_cast<int64_t>(512 * kK));
    } else {
      EXPECT(st.num_swaps_in_place == 0);
    }
    EXPECT(Holds(f.engine_.get(), x, px));
    EXPECT_OK(f.engine_->Unpin(x));
    // And back: V comes in where X is.
    void* v_again = nullptr;
    EXPECT_OK(f.engine_->Pin(v, &v_again));
    EXPECT(v_again == v_at);
    st = f.engine_->GetStats();
    EXPECT(st.num_swaps_in_place == (host == 512 * kK ? 2 : 0));
    EXPECT(st.peak_bytes_in_use <= static_cast<int64_t>(1 * kMiB));
    EXPECT(Holds(f.engine_.get(), v, pv));
    EXPECT_OK(f.engine_->Unpin(v));
    EXPECT(Holds(f.engine_.get(), p, pp));
    EXPECT(Holds(f.engine_.get(), x, px));
    EXPECT_OK(f.engine_->Unpin(p));
    for (Buffer* b : {x, p, v}) EXPECT_OK(f.engine_->FreeBuffer(b));
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(APageInThatNoSwapCanServeIsOneOutOfMemory) {
  // The swap test's layout, with V still pinned when X is: no victim can
  // trade places with X, so its page-in fails. That is one out-of-memory
  // error, counted once the swap has failed too (not by the ladder before
  // it, and not undone after it), and X stays on the host, whole.
  constexpr size_t kK = 1024;
  Fixture f(1 * kMiB, 512 * kK, /*lms=*/true, false, false, 0,
            /*allow_growth=*/false);
  Status s;
  Buffer* x = f.engine_->AllocateBuffer(512 * kK, false, &s);
  Buffer* p = f.engine_->AllocateBuffer(256 * kK, true, &s);
  EXPECT_OK(s);
  const std::string px = Pattern(512 * kK, 1);
  EXPECT_OK(f.engine_->WriteBuffer(x, 0, px.data(), px.size()));
  Buffer* v = f.engine_->AllocateBuffer(512 * kK, true, &s);  // X leaves
  EXPECT_OK(s);
  EXPECT(f.engine_->GetStats().current_bytes_reclaimed ==
         static_cast<int64_t>(512 * kK));
  void* x_at = nullptr;
  s = f.engine_->Pin(x, &x_at);
  EXPECT(s.code() == Code::kResourceExhausted);
  const EngineStats st = f.engine_->GetStats();
  EXPECT(st.num_ooms == 1);
  EXPECT(st.num_swaps_in_place == 0);
  EXPECT(st.current_bytes_reclaimed == static_cast<int64_t>(512 * kK));
  // Once V is no longer pinned, the same page-in swaps.
  EXPECT_OK(f.engine_->Unpin(v));
  EXPECT_OK(f.engine_->Pin(x, &x_at));
  EXPECT(f.engine_->GetStats().num_swaps_in_place == 1);
  EXPECT(f.engine_->GetStats().num_ooms == 1);
  EXPECT(Holds(f.engine_.get(), x, px));
  EXPECT_OK(f.engine_->Unpin(x));
  EXPECT_OK(f.engine_->Unpin(p));
  for (Buffer* b : {x, p, v}) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(WithTheHostFullBuffersSlideDownToJoinTheHoles) {
  // A 256, B 256 and C 192 KiB are inactive on a 1 MiB device, with holes of
  // 160 KiB between them: 320 KiB free, none of it in one piece large
  // enough for 288 KiB. The host pool (128 KiB) takes none of them, and no
  // buffer finds a hole of its own size elsewhere, so neither paging out
  // nor moving (DefragFor) makes room. B slides down into the hole below
  // it, in two pieces since the hole is smaller than B, and the holes join.
  // With SlideFor disabled in the engine the request is out of memory
  // (checked by hand: "LMS host memory pool is full"). With a host pool
  // that takes B, nothing slides. Defragmentation on or off alike.
  constexpr size_t kK = 1024;
  for (size_t host : {128 * kK, 4 * kMiB}) {
    for (bool defrag : {false, true}) {
      Fixture f(1 * kMiB, host, /*lms=*/true, defrag, false, 0,
                /*allow_growth=*/false);
      Status s;
      void* pa = nullptr;
      Buffer* a = f.engine_->AllocateBuffer(256 * kK, false, &s);
      Buffer* g1 = f.engine_->AllocateBuffer(160 * kK, false, &s);
      Buffer* b = f.engine_->AllocateBuffer(256 * kK, false, &s);
      Buffer* g2 = f.engine_->AllocateBuffer(160 * kK, false, &s);
      Buffer* c = f.engine_->AllocateBuffer(192 * kK, false, &s);
      EXPECT_OK(s);
      std::vector<std::pair<Buffer*, std::string>> kept;
      for (Buffer* x : {a, b, c}) {
        kept.emplace_back(x, Pattern(x == c ? 192 * kK : 256 * kK,
                                     static_cast<uint32_t>(kept.size())));
        EXPECT_OK(f.engine_->WriteBuffer(x, 0, kept.back().second.data(),
                                         kept.back().second.size()));
      }
      EXPECT_OK(f.engine_->Pin(a, &pa));
      EXPECT_OK(f.engine_->Unpin(a));
      EXPECT_OK(f.engine_->FreeBuffer(g1));
      EXPECT_OK(f.engine_->FreeBuffer(g2));
      Buffer* out = f.engine_->AllocateBuffer(288 * kK, true, &s);
      EXPECT_OK(s);
      EXPECT(out != nullptr);
      const EngineStats st = f.engine_->GetStats();
      if (host == 128 * kK) {
        EXPECT(st.num_host_full_defrags == 1);
        EXPECT(st.bytes_reclaimed == 0);
        EXPECT(st.bytes_defragged == static_cast<int64_t>(256 * kK));
        void* pb = nullptr;
        EXPECT_OK(f.engine_->Pin(b, &pb));
        EXPECT(static_cast<char*>(pb) == static_cast<char*>(pa) + 256 * kK);
        EXPECT_OK(f.engine_->Unpin(b));
      } else {
        EXPECT(st.num_host_full_defrags == 0);
        EXPECT(st.bytes_reclaimed > 0);
      }
      for (auto& [x, pattern] : kept) EXPECT(Holds(f.engine_.get(), x, pattern));
      EXPECT_OK(f.engine_->Unpin(out));
      for (Buffer* x : {out, a, b, c}) EXPECT_OK(f.engine_->FreeBuffer(x));
      EXPECT_OK(f.engine_->CheckInvariants());
    }
  }
}

TEST(HostPoolSplitsAFreedChunkForASmallerRequest) {
  // TensorFlow's split rule gives a request a whole free chunk when the
  // chunk is under twice the request and the rest under 128 MB: here the
  // 600 KiB request would take the whole 1 MiB region, and a 400 KiB one
  // the freed 600 KiB chunk. In the host pool such a rest is only lost
  // capacity: the 424 KiB and 200 KiB page-outs would find the pool full.
  SimOptions so;
  so.device_memory = 1 * kMiB;
  SimDevice device(so);
  HostPool pool(&device, 1 * kMiB);
  Status s;
  void* a = pool.Allocate(600 * 1024, &s);
  void* b = pool.Allocate(424 * 1024, &s);
  EXPECT(a != nullptr && b != nullptr);
  EXPECT(pool.bytes_in_use() == 1 * kMiB);
  pool.Free(a);
  void* y = pool.Allocate(400 * 1024, &s);
  EXPECT(y == a);
  EXPECT(pool.bytes_in_use() == 824 * 1024);
  void* z = pool.Allocate(200 * 1024, &s);
  EXPECT(z != nullptr);
  EXPECT_OK(s);
  EXPECT(pool.bytes_in_use() == 1 * kMiB);
  // Full now: a further request fails cleanly and changes nothing.
  EXPECT(pool.Allocate(256, &s) == nullptr);
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(pool.bytes_in_use() == 1 * kMiB);
  pool.Free(y);
  pool.Free(z);
  pool.Free(b);
  EXPECT(pool.bytes_in_use() == 0);
}

TEST(FailedPageOutLeavesBufferResidentAndIntact) {
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  std::vector<Buffer*> bufs;
  std::vector<std::string> data;
  for (int i = 0; i < 3; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(300 * 1024, false, &s);
    data.push_back(Pattern(300 * 1024, 200 + i));
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, data.back().data(), 300 * 1024));
    bufs.push_back(b);
  }
  f.device_->FailNextCopies(StreamKind::kDeviceToHost, 100);
  Buffer* extra = f.engine_->AllocateBuffer(440 * 1024, false, &s);
  EXPECT(extra == nullptr);
  EXPECT(s.message().find("simulated copy failure") != std::string::npos);
  for (Buffer* b : bufs) EXPECT(f.engine_->GetBufferState(b) == BufferState::kResident);
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  EXPECT_OK(f.engine_->CheckInvariants());
  EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
  f.device_->FailNextCopies(StreamKind::kDeviceToHost, 0);
  extra = f.engine_->AllocateBuffer(440 * 1024, false, &s);
  EXPECT(extra != nullptr);
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  bufs.push_back(extra);
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(FailedPageInKeepsHostCopy) {
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  Buffer* a = f.engine_->AllocateBuffer(600 * 1024, false, &s);
  std::string pa = Pattern(600 * 1024, 5);
  EXPECT_OK(f.engine_->WriteBuffer(a, 0, pa.data(), pa.size()));
  Buffer* b = f.engine_->AllocateBuffer(600 * 1024, false, &s);  // evicts a
  EXPECT(f.engine_->GetBufferState(a) == BufferState::kReclaimed);
  f.device_->FailNextCopies(StreamKind::kHostToDevice, 1);
  void* ptr;
  Status pin = f.engine_->Pin(a, &ptr);
  // The page-in is asynchronous: its failure surfaces at the next sync.
  std::string got(pa.size(), '\0');
  Status rd = pin.ok() ? f.engine_->ReadBuffer(a, 0, &got[0], got.size()) : pin;
  if (pin.ok()) EXPECT_OK(f.engine_->Unpin(a));
  EXPECT(!rd.ok() || got == pa);
  EXPECT_OK(f.engine_->FreeBuffer(a));
  EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(SubAllocatorRefusalIsAnOutOfMemory) {
  Fixture f(4 * kMiB, 16 * kMiB);
  f.device_->RefuseDeviceAllocations(true);
  Status s;
  Buffer* b = f.engine_->AllocateBuffer(1000, false, &s);
  EXPECT(b == nullptr && s.code() == Code::kResourceExhausted);
  f.device_->RefuseDeviceAllocations(false);
  b = f.engine_->AllocateBuffer(1000, false, &s);
  EXPECT(b != nullptr);
  EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// Fills the device with alternating 256 KiB buffers, frees every other one:
// half the device is free, but in holes too small for 512 KiB.
std::vector<Buffer*> Checkerboard(Fixture& f, std::vector<std::string>* kept) {
  Status s;
  std::vector<Buffer*> all, keep;
  for (int i = 0; i < 8; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(256 * 1024, false, &s);
    if (b) all.push_back(b);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    if (i % 2 == 0) {
      kept->push_back(Pattern(256 * 1024, 300 + i));
      f.engine_->WriteBuffer(all[i], 0, kept->back().data(), 256 * 1024);
      keep.push_back(all[i]);
    } else {
      f.engine_->FreeBuffer(all[i]);
    }
  }
  return keep;
}

TEST(FragmentationWithoutDefragNamesTheKnob) {
  Fixture f(2 * kMiB, 0, /*lms=*/false, /*defrag=*/false);
  std::vector<std::string> data;
  std::vector<Buffer*> keep = Checkerboard(f, &data);
  Status s;
  Buffer* big = f.engine_->AllocateBuffer(512 * 1024, false, &s);
  EXPECT(big == nullptr);
  EXPECT(s.message().find("fragmented") != std::string::npos);
  EXPECT(s.message().find("lms_defrag_enabled") != std::string::npos);
  for (Buffer* b : keep) EXPECT_OK(f.engine_->FreeBuffer(b));
}

// Free memory split by pinned tensors cannot be joined by anything: the
// message shows the layout, so a user sees what splits it.
TEST(FragmentationByPinnedTensorsShowsTheLayout) {
  Fixture f(1 * kMiB, 16 * kMiB, /*lms=*/true, /*defrag=*/false,
            /*prefetch=*/false, /*prefetch_budget=*/0, /*allow_growth=*/false);
  Status s;
  const size_t big = 300 * 1024;
  std::vector<Buffer*> small, large;
  for (int i = 0; i < 2; ++i) {
    small.push_back(f.engine_->AllocateBuffer(256, /*pinned=*/true, &s));
    large.push_back(f.engine_->AllocateBuffer(big, /*pinned=*/true, &s));
  }
  small.push_back(f.engine_->AllocateBuffer(256, /*pinned=*/true, &s));
  for (Buffer* b : small) EXPECT(b != nullptr);
  for (Buffer* b : large) {
    EXPECT(b != nullptr);
    if (b == nullptr) continue;
    EXPECT_OK(f.engine_->Unpin(b));
    EXPECT_OK(f.engine_->FreeBuffer(b));
  }
  // 1 MiB - 768 bytes free in three holes, none of 440 KiB.
  Buffer* request = f.engine_->AllocateBuffer(440 * 1024, false, &s);
  EXPECT(request == nullptr);
  const std::string m = s.message();
  EXPECT(m.find("fragmented by tensors in use") != std::string::npos);
  EXPECT(m.find("[pinned 256 B | free 300.0 KiB | pinned 256 B | free 300.0 "
                "KiB | pinned 256 B | free ") != std::string::npos);
  if (m.find("[pinned 256 B") == std::string::npos) {
    std::fprintf(stderr, "  message: %s\n", m.c_str());
  }
  for (Buffer* b : small) {
    if (b == nullptr) continue;
    EXPECT_OK(f.engine_->Unpin(b));
    EXPECT_OK(f.engine_->FreeBuffer(b));
  }
  EXPECT_OK(f.engine_->CheckInvariants());
}

TEST(DefragmentationMakesRoomAndMovesBytesIntact) {
  Fixture f(2 * kMiB, 0, /*lms=*/false, /*defrag=*/true);
  std::vector<std::string> data;
  std::vector<Buffer*> keep = Checkerboard(f, &data);
  Status s;
  Buffer* big = f.engine_->AllocateBuffer(512 * 1024, false, &s);
  EXPECT_OK(s);
  EXPECT(big != nullptr);
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.num_defragmentations >= 1 && st.bytes_defragged > 0);
  EXPECT(st.num_allocs_from_defrag == 1);
  for (size_t i = 0; i < keep.size(); ++i) EXPECT(Holds(f.engine_.get(), keep[i], data[i]));
  EXPECT_OK(f.engine_->CheckInvariants());
  if (big) EXPECT_OK(f.engine_->FreeBuffer(big));
  // Explicit compaction moves the rest down and leaves one free block.
  size_t moved = 0;
  EXPECT_OK(f.engine_->Defragment(&moved));
  for (size_t i = 0; i < keep.size(); ++i) EXPECT(Holds(f.engine_.get(), keep[i], data[i]));
  for (Buffer* b : keep) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// Cluster placement (placement.cc). Both tests build, on a 14 MiB device
// taken as one region (TensorFlow's default) whose chunks always split (a
// tiny fragmentation_fraction; otherwise BFC hands out up to 128 MiB of
// padding), an op that pins two 4 MiB inputs and then allocates a
// 4 MiB output: 12 MiB of 14 fit only if the inputs pack. `PushBufferToHost` leaves `b` reclaimed (and
// the engine under pressure) by pinning everything else and allocating over
// it; the space it held is then free again.
void PushBufferToHost(Fixture& f, Buffer* b, const std::vector<Buffer*>& others) {
  void* p = nullptr;
  for (Buffer* o : others) EXPECT_OK(f.engine_->Pin(o, &p));
  Status s;
  Buffer* z = f.engine_->AllocateBuffer(f.engine_->BufferSize(b), true, &s);
  EXPECT_OK(s);
  EXPECT(f.engine_->GetBufferState(b) == BufferState::kReclaimed);
  if (z != nullptr) {
    EXPECT_OK(f.engine_->Unpin(z));
    EXPECT_OK(f.engine_->FreeBuffer(z));
  }
  for (Buffer* o : others) EXPECT_OK(f.engine_->Unpin(o));
}

Buffer* Filled(Fixture& f, size_t size, uint32_t seed, std::string* data) {
  Status s;
  Buffer* b = f.engine_->AllocateBuffer(size, false, &s);
  EXPECT_OK(s);
  *data = Pattern(size, seed);
  if (b != nullptr) EXPECT_OK(f.engine_->WriteBuffer(b, 0, data->data(), size));
  return b;
}

// Best fit pages B into the exact 4 MiB hole between two inactive 3 MiB
// buffers, away from pinned A: the output then finds 3 + 3 MiB, never 4.
// Placed next to A instead (paging the 3 MiB neighbour out), it fits.
TEST(PageInUnderPressurePacksNextToPinnedBuffers) {
  Fixture f(14 * kMiB, 64 * kMiB, /*lms=*/true, /*defrag=*/false,
            /*prefetch=*/false, /*prefetch_budget=*/0, /*allow_growth=*/false,
            /*fragmentation_fraction=*/1e-4);
  std::string da, d1, db, d2;
  Buffer* a = Filled(f, 4 * kMiB, 1, &da);   // [0, 4)
  Buffer* i1 = Filled(f, 3 * kMiB, 2, &d1);  // [4, 7)
  Buffer* b = Filled(f, 4 * kMiB, 3, &db);   // [7, 11)
  Buffer* i2 = Filled(f, 3 * kMiB, 4, &d2);  // [11, 14)
  PushBufferToHost(f, b, {a, i1, i2});
  void* pa = nullptr;
  void* pb = nullptr;
  EXPECT_OK(f.engine_->Pin(a, &pa));
  EXPECT_OK(f.engine_->Pin(b, &pb));
  EXPECT(static_cast<char*>(pb) == static_cast<char*>(pa) + 4 * kMiB);
  Status s;
  Buffer* out = f.engine_->AllocateBuffer(4 * kMiB, true, &s);
  EXPECT_OK(s);
  EXPECT(out != nullptr);
  EXPECT_OK(f.engine_->Unpin(a));
  EXPECT_OK(f.engine_->Unpin(b));
  if (out != nullptr) EXPECT_OK(f.engine_->Unpin(out));
  EXPECT(Holds(f.engine_.get(), a, da) && Holds(f.engine_.get(), b, db));
  EXPECT(Holds(f.engine_.get(), i1, d1) && Holds(f.engine_.get(), i2, d2));
  EXPECT_OK(f.engine_->CheckInvariants());
  for (Buffer* x : {a, i1, b, i2, out}) {
    if (x != nullptr) EXPECT_OK(f.engine_->FreeBuffer(x));
  }
}

// A sits 3 MiB above the region start: too little below it for B, and B
// above it leaves 3 MiB, too little for the output. Pinning A under pressure
// moves it (device to device, bytes verified) to the top end of its gap.
TEST(StrandedBufferMovesToAGapEndBeforeItIsPinned) {
  Fixture f(14 * kMiB, 64 * kMiB, /*lms=*/true, /*defrag=*/false,
            /*prefetch=*/false, /*prefetch_budget=*/0, /*allow_growth=*/false,
            /*fragmentation_fraction=*/1e-4);
  std::string d1, da, db, d2;
  Buffer* j1 = Filled(f, 3 * kMiB, 5, &d1);  // [0, 3)
  Buffer* a = Filled(f, 4 * kMiB, 6, &da);   // [3, 7)
  Buffer* b = Filled(f, 4 * kMiB, 7, &db);   // [7, 11)
  Buffer* j2 = Filled(f, 3 * kMiB, 8, &d2);  // [11, 14)
  PushBufferToHost(f, b, {j1, a, j2});
  const int64_t moves_before = f.engine_->GetStats().num_defragmentations;
  void* pa = nullptr;
  void* pb = nullptr;
  EXPECT_OK(f.engine_->Pin(a, &pa));
  EXPECT(f.engine_->GetStats().num_defragmentations == moves_before + 1);
  EXPECT_OK(f.engine_->Pin(b, &pb));
  Status s;
  Buffer* out = f.engine_->AllocateBuffer(4 * kMiB, true, &s);
  EXPECT_OK(s);
  EXPECT(out != nullptr);
  EXPECT_OK(f.engine_->Unpin(a));
  EXPECT_OK(f.engine_->Unpin(b));
  if (out != nullptr) EXPECT_OK(f.engine_->Unpin(out));
  EXPECT(Holds(f.engine_.get(), a, da) && Holds(f.engine_.get(), b, db));
  EXPECT(Holds(f.engine_.get(), j1, d1) && Holds(f.engine_.get(), j2, d2));
  EXPECT_OK(f.engine_->CheckInvariants());
  for (Buffer* x : {j1, a, b, j2, out}) {
    if (x != nullptr) EXPECT_OK(f.engine_->FreeBuffer(x));
  }
}

// Unpin stamps a last-use epoch instead of recording an event: a page-out or
// a move must still wait for the kernel that last wrote the buffer. The
// "kernel" is a slow copy on the compute stream into the buffer, enqueued
// before the unpin; the buffer is then paged out (its epoch still open, or
// closed by later unpins so that a kept event covers it) or moved, and must
// hold the kernel's bytes, not the zeros it held before.
TEST(PageOutAndMoveWaitForTheLastKernel) {
  const size_t size = 128 * 1024;
  const std::string pattern = Pattern(size, 11);
  for (int mode = 0; mode < 3; ++mode) {  // open epoch, kept event, defrag
    Fixture f(1 * kMiB, 16 * kMiB, true, /*defrag=*/mode == 2);
    Status s;
    void* src = f.engine_->AllocateRaw(size, &s);
    EXPECT(src != nullptr);
    if (src == nullptr) continue;
    std::memcpy(src, pattern.data(), size);
    Buffer* other = f.engine_->AllocateBuffer(256, false, &s);
    // A gap below the buffer, so that compaction moves it.
    Buffer* filler = f.engine_->AllocateBuffer(size, false, &s);
    void* addr = nullptr;
    Buffer* b = f.engine_->AllocateBuffer(size, /*pinned=*/true, &s, &addr);
    EXPECT(filler != nullptr && b != nullptr && other != nullptr);
    if (filler == nullptr || b == nullptr || other == nullptr) continue;
    std::memset(addr, 0, size);
    EXPECT_OK(f.engine_->FreeBuffer(filler));
    Stream* compute = f.device_->GetStream(StreamKind::kCompute);
    f.device_->DelayCopies(StreamKind::kCompute, 100 * 1000);
    EXPECT_OK(f.device_->CopyDeviceToDevice(compute, addr, src, size));
    f.device_->DelayCopies(StreamKind::kCompute, 0);
    EXPECT_OK(f.engine_->Unpin(b));
    if (mode == 1) {
      for (int i = 0; i < 100; ++i) {  // closes the epoch b was stamped with
        void* p = nullptr;
        EXPECT_OK(f.engine_->Pin(other, &p));
        EXPECT_OK(f.engine_->Unpin(other));
      }
    }
    if (mode == 2) {
      size_t moved = 0;
      EXPECT_OK(f.engine_->Defragment(&moved));
      EXPECT(moved >= size);
      void* now = nullptr;
      EXPECT_OK(f.engine_->Pin(b, &now));
      EXPECT(now != addr);
      EXPECT_OK(f.engine_->Unpin(b));
    } else {
      size_t reclaimed = 0;
      EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
      EXPECT(f.engine_->GetBufferState(b) == BufferState::kReclaimed);
    }
    EXPECT(Holds(f.engine_.get(), b, pattern));
    EXPECT_OK(f.engine_->FreeBuffer(b));
    EXPECT_OK(f.engine_->FreeBuffer(other));
    f.engine_->DeallocateRaw(src);
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(UnmovableBufferIsNeverMovedOrReclaimed) {
  Fixture f(1 * kMiB, 16 * kMiB, true, true);
  Status s;
  Buffer* u = f.engine_->AllocateBuffer(256 * 1024, false, &s);
  void* addr = nullptr;
  EXPECT_OK(f.engine_->MarkUnmovable(u, &addr));
  std::vector<Buffer*> others;
  for (int i = 0; i < 10; ++i) {
    Buffer* b = f.engine_->AllocateBuffer(256 * 1024, false, &s);
    if (b) others.push_back(b);
  }
  size_t moved;
  EXPECT_OK(f.engine_->Defragment(&moved));
  void* again = nullptr;
  EXPECT_OK(f.engine_->Pin(u, &again));
  EXPECT(again == addr);
  EXPECT_OK(f.engine_->Unpin(u));
  EXPECT(f.engine_->GetBufferState(u) == BufferState::kResident);
  for (Buffer* b : others) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->FreeBuffer(u));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// An escaped address (DLPack, the C API) is read by code no stream orders:
// MarkUnmovable must return with the bytes already there, even when the
// page-in it starts is slow.
TEST(MarkUnmovableReturnsOnlyOnceTheBytesHaveLanded) {
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  const size_t size = 256 * 1024;
  Buffer* b = f.engine_->AllocateBuffer(size, false, &s);
  const std::string pattern = Pattern(size, 7);
  EXPECT_OK(f.engine_->WriteBuffer(b, 0, pattern.data(), size));
  size_t reclaimed = 0;
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  EXPECT(f.engine_->GetBufferState(b) == BufferState::kReclaimed);
  // Scribble over all free device memory, so stale bytes cannot pass.
  void* scratch = f.engine_->AllocateRaw(1 * kMiB - 256, &s);
  if (scratch == nullptr) scratch = f.engine_->AllocateRaw(size, &s);
  EXPECT(scratch != nullptr);
  if (scratch != nullptr) {
    std::memset(scratch, 0x5A, f.engine_->AllocatedSize(scratch));
    f.engine_->DeallocateRaw(scratch);
  }
  f.device_->DelayCopies(StreamKind::kHostToDevice, 200 * 1000);
  void* addr = nullptr;
  EXPECT_OK(f.engine_->MarkUnmovable(b, &addr));
  EXPECT(addr != nullptr);
  if (addr != nullptr) EXPECT(std::memcmp(addr, pattern.data(), size) == 0);
  f.device_->DelayCopies(StreamKind::kHostToDevice, 0);
  EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// Forwards to a SimDevice; the first WaitEvent on the compute stream made by
// `held_thread` blocks until `release` is set: the thread that paged a buffer
// in is descheduled between leaving the engine and ordering the compute
// stream after the copy, as any thread may be.
class HeldWaitDevice : public ForwardingDevice {
 public:
  explicit HeldWaitDevice(SimDevice* sim) : ForwardingDevice(sim) {}
  std::atomic<bool> holding{false};
  std::atomic<bool> held{false};
  std::atomic<bool> release{false};
  std::thread::id held_thread;

  Status WaitEvent(Stream* s, const EventRef& e) override {
    if (holding && s == GetStream(StreamKind::kCompute) &&
        std::this_thread::get_id() == held_thread && !held.exchange(true)) {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ForwardingDevice::WaitEvent(s, e);
  }
};

// Two kernels on two threads read a buffer whose page-in the first one's pin
// started. The second pin finds the buffer resident: its kernel must still
// come after the copy, whichever thread got to order the compute stream
// first (the first pin took the page-in's event for itself, and the second
// kernel read the chunk's previous bytes).
TEST(SecondPinWaitsForAPageInStillLanding) {
  const size_t size = 256 * 1024;
  SimOptions so;
  so.device_memory = 1 * kMiB;
  SimDevice sim(so);
  HeldWaitDevice device(&sim);
  EngineOptions eo;
  eo.memory_limit = 1 * kMiB;
  eo.host_memory_limit = 16 * kMiB;
  eo.lms_enabled = true;
  Engine engine(&device, eo);
  EXPECT_OK(engine.Init());
  Status s;
  Buffer* b = engine.AllocateBuffer(size, false, &s);
  EXPECT(b != nullptr);
  if (b == nullptr) return;
  const std::string pattern = Pattern(size, 13);
  EXPECT_OK(engine.WriteBuffer(b, 0, pattern.data(), size));
  size_t reclaimed = 0;
  EXPECT_OK(engine.ReclaimInactive(&reclaimed));
  EXPECT(engine.GetBufferState(b) == BufferState::kReclaimed);
  // Stale bytes wherever the page-in may land.
  void* scratch = engine.AllocateRaw(1 * kMiB - 256, &s);
  if (scratch == nullptr) scratch = engine.AllocateRaw(size, &s);
  EXPECT(scratch != nullptr);
  if (scratch != nullptr) {
    std::memset(scratch, 0x5A, engine.AllocatedSize(scratch));
    engine.DeallocateRaw(scratch);
  }
  sim.DelayCopies(StreamKind::kHostToDevice, 200 * 1000);
  void* first_addr = nullptr;
  std::thread first([&] {
    device.held_thread = std::this_thread::get_id();
    device.holding = true;
    EXPECT_OK(engine.Pin(b, &first_addr));
  });
  while (!device.held) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // The second kernel: pinned, then run on the compute stream (a synchronous
  // read runs after all work enqueued there so far).
  void* addr = nullptr;
  EXPECT_OK(engine.Pin(b, &addr));
  std::string got(size, '\0');
  if (addr != nullptr) EXPECT_OK(sim.ReadDeviceSync(&got[0], addr, size));
  EXPECT(got == pattern);
  device.release = true;
  first.join();
  sim.DelayCopies(StreamKind::kHostToDevice, 0);
  EXPECT(first_addr == addr);
  EXPECT_OK(engine.Unpin(b));
  EXPECT_OK(engine.Unpin(b));
  EXPECT_OK(engine.FreeBuffer(b));
  EXPECT_OK(engine.CheckInvariants());
}

// verify_pins: a write no pin covered (here straight to the address an
// earlier pin returned, as a kernel without a pin site would) is caught at
// the next pin, which fails naming the buffer and holds nothing.
TEST(VerifyPinsCatchesBytesChangedWhileUnpinned) {
  Fixture f(1 * kMiB, 16 * kMiB);
  Status s;
  const size_t size = 64 * 1024;
  void* addr = nullptr;
  Buffer* b = f.engine_->AllocateBuffer(size, /*pinned=*/true, &s, &addr);
  EXPECT(b != nullptr && addr != nullptr);
  if (b == nullptr || addr == nullptr) return;
  const std::string pattern = Pattern(size, 17);
  std::memcpy(addr, pattern.data(), size);
  EXPECT_OK(f.engine_->Unpin(b));
  // Paged out and back in: the same bytes, so the pin passes.
  size_t reclaimed = 0;
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  EXPECT(reclaimed >= size);
  void* now = nullptr;
  EXPECT_OK(f.engine_->Pin(b, &now));
  EXPECT_OK(f.engine_->Unpin(b));
  static_cast<char*>(now)[size / 2] ^= 1;  // one bit, no pin
  Status pin = f.engine_->Pin(b, &now);
  EXPECT(pin.code() == Code::kInternal);
  EXPECT(pin.ToString().find("verify_pins") != std::string::npos);
  EXPECT(pin.ToString().find("while it was unpinned") != std::string::npos);
  // The failed pin holds nothing: the buffer can be paged out and freed.
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  EXPECT(f.engine_->GetBufferState(b) == BufferState::kReclaimed);
  EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// Steps that pin every buffer once, in the same order, 1 ms per kernel.
void RunCyclicSteps(Fixture* f, const std::vector<Buffer*>& bufs, int steps) {
  for (int step = 0; step < steps; ++step) {
    f->engine_->StepBegin();
    for (Buffer* b : bufs) {
      void* p;
      EXPECT_OK(f->engine_->Pin(b, &p));
      f->device_->Compute(1e-3);
      EXPECT_OK(f->engine_->Unpin(b));
    }
  }
}

TEST(PrefetchLearnsTheStepAndHits) {
  Fixture f(1 * kMiB, 32 * kMiB, true, false, /*prefetch=*/true,
            /*prefetch_budget=*/512 * 1024);
  Status s;
  std::vector<Buffer*> bufs;
  for (int i = 0; i < 12; ++i) {
    bufs.push_back(f.engine_->AllocateBuffer(200 * 1024, false, &s));
  }
  RunCyclicSteps(&f, bufs, 4);
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.num_prefetches > 0);
  EXPECT(st.prefetch_hits > 0);
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// A prefetch hit whose copy is still in flight when its kernel is launched is
// counted (the kernel waits for it unless the host ran far enough ahead).
// The same steps, the host keeping pace with 1 ms kernels: over a 24 GB/s
// link every 200 KiB prefetch lands in microseconds, over a 50 MB/s link
// each takes 4 ms, longer than the kernels between it and its use.
TEST(PrefetchHitsInFlightAtTheirPinAreCounted) {
  constexpr size_t kSize = 200 * 1024;
  auto run = [](double link_bytes_per_second) {
    SimOptions so;
    so.device_memory = 1 * kMiB;
    so.link_bytes_per_second = link_bytes_per_second;
    SimDevice device(so);
    EngineOptions eo;
    eo.memory_limit = 1 * kMiB;
    eo.host_memory_limit = 32 * kMiB;
    eo.lms_enabled = true;
    eo.verify_pins = true;
    eo.prefetch_enabled = true;
    eo.prefetch_budget_bytes = 512 * 1024;
    Engine engine(&device, eo);
    EXPECT_OK(engine.Init());
    Status s;
    std::vector<Buffer*> bufs;
    for (int i = 0; i < 12; ++i) {
      bufs.push_back(engine.AllocateBuffer(kSize, false, &s));
    }
    for (int step = 0; step < 4; ++step) {
      engine.StepBegin();
      for (Buffer* b : bufs) {
        void* p;
        EXPECT_OK(engine.Pin(b, &p));
        device.Compute(1e-3);
        device.HostAdvance(1e-3);
        EXPECT_OK(engine.Unpin(b));
      }
    }
    EngineStats st = engine.GetStats();
    for (Buffer* b : bufs) EXPECT_OK(engine.FreeBuffer(b));
    EXPECT_OK(engine.CheckInvariants());
    return st;
  };
  const EngineStats fast = run(24e9);
  EXPECT(fast.prefetch_hits > 0);
  EXPECT(fast.prefetch_hits_in_flight == 0);
  EXPECT(fast.bytes_prefetched_in_flight == 0);
  const EngineStats slow = run(50e6);
  EXPECT(slow.prefetch_hits > 0);
  EXPECT(slow.prefetch_hits_in_flight > 0);
  EXPECT(slow.bytes_prefetched_in_flight ==
         slow.prefetch_hits_in_flight * static_cast<int64_t>(kSize));
}

TEST(PrefetchPlanPagesOutAWeightForTheNextStep) {
  // A weight W is read early in each step; later the step's two big tensors
  // do not fit beside it. The step learned, the plan (Belady over the
  // recorded step) pages W out right after its use, for the next step, so no
  // allocation has to reclaim on demand (host waiting for the copy), and
  // the next step's prefetch brings W back before its pin.
  Fixture f(8 * kMiB, 64 * kMiB, true, false, /*prefetch=*/true);
  {
    // One region, as TensorFlow takes by default: no region boundary
    // splits the free space.
    EngineOptions eo = f.engine_->options();
    eo.allow_growth = false;
    f.engine_ = std::make_unique<Engine>(f.device_.get(), eo);
    EXPECT_OK(f.engine_->Init());
  }
  Status s;
  Buffer* x = f.engine_->AllocateBuffer(64 * 1024, false, &s);
  Buffer* w = f.engine_->AllocateBuffer(3 * kMiB, false, &s);
  const std::string wbytes = Pattern(3 * kMiB, 7);
  EXPECT_OK(f.engine_->WriteBuffer(w, 0, wbytes.data(), wbytes.size()));
  EngineStats before;
  // W and x, made before the first step, keep the keys they had there as
  // an earlier step's buffers; steps 4-6 follow a plan learnt and trusted.
  for (int step = 0; step < 7; ++step) {
    if (step == 4) before = f.engine_->GetStats();
    f.engine_->StepBegin();
    void* p;
    EXPECT_OK(f.engine_->Pin(x, &p));
    f.device_->Compute(1e-4);
    EXPECT_OK(f.engine_->Unpin(x));
    EXPECT_OK(f.engine_->Pin(w, &p));
    f.device_->Compute(1e-4);
    EXPECT_OK(f.engine_->Unpin(w));
    for (int i = 0; i < 4; ++i) {  // ops that need only x
      EXPECT_OK(f.engine_->Pin(x, &p));
      f.device_->Compute(1e-4);
      EXPECT_OK(f.engine_->Unpin(x));
    }
    Buffer* a = f.engine_->AllocateBuffer(3 * kMiB, true, &s, &p);
    EXPECT_OK(s);
    f.device_->Compute(1e-4);
    EXPECT_OK(f.engine_->Unpin(a));
    Buffer* b = f.engine_->AllocateBuffer(3 * kMiB, true, &s, &p);
    EXPECT_OK(s);
    f.device_->Compute(1e-4);
    EXPECT_OK(f.engine_->Unpin(b));
    EXPECT_OK(f.engine_->Pin(a, &p));
    EXPECT_OK(f.engine_->Pin(b, &p));
    f.device_->Compute(1e-4);
    EXPECT_OK(f.engine_->Unpin(a));
    EXPECT_OK(f.engine_->Unpin(b));
    EXPECT_OK(f.engine_->FreeBuffer(a));
    EXPECT_OK(f.engine_->FreeBuffer(b));
    for (int i = 0; i < 20; ++i) {  // enough pins to trust the order
      EXPECT_OK(f.engine_->Pin(x, &p));
      f.device_->Compute(1e-4);
      EXPECT_OK(f.engine_->Unpin(x));
    }
  }
  EngineStats after = f.engine_->GetStats();
  // Steps 4-6: W goes out ahead of pressure every step and comes back by
  // prefetch; nothing is reclaimed on demand.
  EXPECT(after.num_early_page_outs - before.num_early_page_outs >= 3);
  EXPECT(after.num_single_reclaims == before.num_single_reclaims);
  EXPECT(after.num_fragment_reclaims == before.num_fragment_reclaims);
  EXPECT(after.num_full_reclaims == before.num_full_reclaims);
  EXPECT(after.prefetch_misses == before.prefetch_misses);
  EXPECT(after.prefetch_hits - before.prefetch_hits >= 3);
  EXPECT(Holds(f.engine_.get(), w, wbytes));
  EXPECT_OK(f.engine_->FreeBuffer(w));
  EXPECT_OK(f.engine_->FreeBuffer(x));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// A training step in miniature: the forward pass makes activation A and
// then seven more 1 MiB tensors, which do not all fit beside it in 8 MiB, so
// A (needed last) is evicted; the backward pass frees them one by one, with
// kernels on a small tensor x in between, and finally reads A. Each kernel
// runs 2 ms; the link moves 50 MB/s, so A's copy back takes 21 ms.
struct PlannedStepRun {
  explicit PlannedStepRun(size_t host_limit = 64 * kMiB, int lookahead = 2,
                          size_t prefetch_budget = 0,
                          bool layout_lookahead = false,
                          double look_seconds_per_event = 0,
                          double look_seconds_per_range = 0) {
    SimOptions so;
    so.device_memory = 8 * kMiB;
    so.link_bytes_per_second = 50e6;
    so.layout_look_seconds_per_event = look_seconds_per_event;
    so.layout_look_seconds_per_range = look_seconds_per_range;
    device = std::make_unique<SimDevice>(so);
    EngineOptions eo;
    eo.memory_limit = 8 * kMiB;
    eo.host_memory_limit = host_limit;
    eo.lms_enabled = true;
    eo.verify_pins = true;
    eo.prefetch_enabled = true;
    // By default two pins ahead (4 ms): the look-ahead alone cannot land A
    // in time.
    eo.prefetch_lookahead = lookahead;
    eo.prefetch_budget_bytes = prefetch_budget;
    eo.layout_lookahead = layout_lookahead;
    eo.allow_growth = false;  // one region, as TensorFlow takes by default
    engine = std::make_unique<Engine>(device.get(), eo);
    EXPECT_OK(engine->Init());
    Status s;
    x = engine->AllocateBuffer(64 * 1024, false, &s);
    EXPECT_OK(s);
  }
  void Op(std::initializer_list<Buffer*> in) {
    void* p;
    for (Buffer* b : in) EXPECT_OK(engine->Pin(b, &p));
    device->Compute(2e-3);
    device->HostAdvance(2e-3);
    for (Buffer* b : in) EXPECT_OK(engine->Unpin(b));
  }
  // A kernel that makes a tensor of `bytes` (returned, unpinned).
  Buffer* Make(size_t bytes) {
    Status s;
    void* p;
    Buffer* t = engine->AllocateBuffer(bytes, true, &s, &p);
    EXPECT_OK(s);
    device->Compute(2e-3);
    device->HostAdvance(2e-3);
    EXPECT_OK(engine->Unpin(t));
    return t;
  }
  // A step's start: a kernel on x, then A (1 MiB) made and written.
  Buffer* BeginStepWithA(const std::string& a_bytes) {
    engine->StepBegin();
    Op({x});
    Buffer* a = Make(kMiB);
    EXPECT_OK(engine->WriteBuffer(a, 0, a_bytes.data(), a_bytes.size()));
    return a;
  }
  // One step up to the kernel that reads A (returned, unpinned).
  Buffer* StepUntilA(const std::string& a_bytes) {
    Buffer* a = BeginStepWithA(a_bytes);
    std::vector<Buffer*> f;
    for (int i = 0; i < 7; ++i) f.push_back(Make(kMiB));
    for (int i = 6; i >= 0; --i) {
      Op({f[static_cast<size_t>(i)], x});
      EXPECT_OK(engine->FreeBuffer(f[static_cast<size_t>(i)]));
      for (int k = 0; k < 4; ++k) Op({x});
    }
    return a;
  }
  void EndStep(Buffer* a) {
    EXPECT_OK(engine->FreeBuffer(a));
    for (int i = 0; i < 20; ++i) Op({x});  // enough pins to trust the order
  }
  // After the last step: nothing left on the device or the host.
  void Finish() {
    EXPECT_OK(engine->FreeBuffer(x));
    EXPECT_OK(engine->CheckInvariants());
    EXPECT(engine->GetStats().host_bytes_in_use == 0);
  }
  std::unique_ptr<SimDevice> device;
  std::unique_ptr<Engine> engine;
  Buffer* x = nullptr;
};

TEST(PrefetchPlanBringsAnEvictedTensorBackWhereItFits) {
  // The plan (Belady over the recorded step) has A's copy back start once
  // the backward pass has freed room for it (leaving twice the largest
  // buffer free), some 24 kernels before its use, not at the look-ahead's
  // two: from the fourth step on A is a prefetch hit that landed before
  // its kernel, and its bytes are intact.
  PlannedStepRun r;
  const std::string bytes = Pattern(kMiB, 11);
  EngineStats before;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) before = r.engine->GetStats();
    Buffer* a = r.StepUntilA(bytes);
    r.Op({a, r.x});
    EXPECT(Holds(r.engine.get(), a, bytes));
    r.EndStep(a);
  }
  EngineStats after = r.engine->GetStats();
  EXPECT(after.prefetch_hits - before.prefetch_hits >= 3);
  EXPECT(after.num_planned_prefetches - before.num_planned_prefetches >= 3);
  EXPECT(after.prefetch_hits_in_flight == before.prefetch_hits_in_flight);
  EXPECT(after.prefetch_misses == before.prefetch_misses);
  EXPECT(after.num_single_reclaims == before.num_single_reclaims);
  r.Finish();
}

TEST(AnOverBudgetTensorThePlanEvictsLeavesEarlyWithinTheLookAhead) {
  // A (1 MiB, over the 512 KiB prefetch budget) is written, then seven
  // 1 MiB tensors fill the 8 MiB device; the last needs A's room, and A is
  // read after all seven, some 50 pins after its last use: within the
  // 128-pin look-ahead, so a tensor within the budget would stay for on-
  // demand reclaim. Over the budget, the look-ahead would not page A
  // straight back in, so once the plan evicts it A's copy out starts at its
  // unpin: the seventh allocation collects that copy rather than paging A
  // out itself while the host waits. A's bytes are intact at its use.
  // Fails without the rule (no early page-out; two single reclaims a step).
  PlannedStepRun r(64 * kMiB, /*lookahead=*/128, /*prefetch_budget=*/kMiB / 2);
  const std::string bytes = Pattern(kMiB, 31);
  EngineStats before;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) before = r.engine->GetStats();
    Buffer* a = r.BeginStepWithA(bytes);
    std::vector<Buffer*> f;
    for (int i = 0; i < 7; ++i) {
      f.push_back(r.Make(kMiB));
      for (int k = 0; k < 5; ++k) r.Op({r.x});
    }
    for (Buffer* t : f) r.Op({t, r.x});
    r.Op({a, r.x});
    EXPECT(Holds(r.engine.get(), a, bytes));
    for (Buffer* t : f) EXPECT_OK(r.engine->FreeBuffer(t));
    r.EndStep(a);
  }
  EngineStats after = r.engine->GetStats();
  EXPECT(after.num_early_page_outs - before.num_early_page_outs == 3);
  // One a step: the room A's own page-in needs at its pin (the device is
  // full of the seven then). Without the early copy, two: A's as well.
  EXPECT(after.num_single_reclaims - before.num_single_reclaims == 3);
  r.Finish();
}

TEST(PlannedPageInQueuesBehindOnlyCopiesNeededSooner) {
  // As above with two activations, A and then B, both evicted in the
  // forward pass; the backward pass reads B and then A. The plan issues B's
  // copy back once two of the seven tensors are freed and A's one free
  // later, 10 ms on, while B's 21 ms copy is still landing: more than a
  // quarter of the prefetch budget in flight. Nothing the step pins before
  // A is on the host then, so A's copy is enqueued at once behind B's,
  // and the link runs the two back to back instead of idling until the
  // first pin after B landed. Both are prefetch hits with their bytes.
  PlannedStepRun r;
  const std::string a_bytes = Pattern(kMiB, 21);
  const std::string b_bytes = Pattern(kMiB, 22);
  EngineStats before;
  std::vector<SimCopy> copies;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) before = r.engine->GetStats();
    if (step == 4) r.device->RecordCopies(true);
    r.engine->StepBegin();
    r.Op({r.x});
    Buffer* ab[2];
    for (int k = 0; k < 2; ++k) {
      ab[k] = r.Make(kMiB);
      const std::string& bytes = k == 0 ? a_bytes : b_bytes;
      EXPECT_OK(r.engine->WriteBuffer(ab[k], 0, bytes.data(), bytes.size()));
    }
    std::vector<Buffer*> f;
    for (int i = 0; i < 7; ++i) f.push_back(r.Make(kMiB));
    for (int i = 6; i >= 0; --i) {
      r.Op({f[static_cast<size_t>(i)], r.x});
      EXPECT_OK(r.engine->FreeBuffer(f[static_cast<size_t>(i)]));
      for (int k = 0; k < 4; ++k) r.Op({r.x});
    }
    r.Op({ab[1], r.x});
    r.Op({ab[0], r.x});
    EXPECT(Holds(r.engine.get(), ab[0], a_bytes));
    EXPECT(Holds(r.engine.get(), ab[1], b_bytes));
    EXPECT_OK(r.engine->FreeBuffer(ab[1]));
    r.EndStep(ab[0]);
    if (step == 4) {
      r.device->SynchronizeAll();
      copies = r.device->TakeCopies();
      r.device->RecordCopies(false);
    }
  }
  EngineStats after = r.engine->GetStats();
  EXPECT(after.num_planned_prefetches_queued -
             before.num_planned_prefetches_queued >= 3);
  EXPECT(after.prefetch_hits - before.prefetch_hits >= 6);
  EXPECT(after.prefetch_misses == before.prefetch_misses);
  std::vector<SimCopy> in;
  for (const SimCopy& c : copies) {
    if (c.stream == StreamKind::kHostToDevice && c.bytes == kMiB) {
      in.push_back(c);
    }
  }
  EXPECT(in.size() == 2);
  if (in.size() == 2) {
    EXPECT(in[1].start - in[0].end < 1e-9);  // back to back
    EXPECT(in[0].end - in[0].start > 0.02);  // B's copy took its 21 ms
  }
  r.Finish();
}

// Runs six steps of StepUntilA and returns when A's copy back started in the
// fifth (SimTimeline's clock, from that step's first copy), checking that A
// was a prefetch hit with its bytes every step from the fourth on and that
// nothing was reclaimed on demand.
double PlannedCopyStart(bool layout_lookahead) {
  PlannedStepRun r(64 * kMiB, 2, 0, layout_lookahead);
  const std::string bytes = Pattern(kMiB, 41);
  EngineStats before;
  double start = -1;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) before = r.engine->GetStats();
    if (step == 4) r.device->RecordCopies(true);
    Buffer* a = r.StepUntilA(bytes);
    r.Op({a, r.x});
    EXPECT(Holds(r.engine.get(), a, bytes));
    r.EndStep(a);
    if (step == 4) {
      r.device->SynchronizeAll();
      std::vector<SimCopy> copies = r.device->TakeCopies();
      r.device->RecordCopies(false);
      double first = copies.empty() ? 0 : copies[0].start;
      for (const SimCopy& c : copies) {
        first = std::min(first, c.start);
        if (c.stream == StreamKind::kHostToDevice && c.bytes == kMiB) {
          start = c.start;
        }
      }
      start -= first;
    }
  }
  EngineStats after = r.engine->GetStats();
  EXPECT(after.num_planned_prefetches - before.num_planned_prefetches >= 3);
  EXPECT(after.prefetch_misses == before.prefetch_misses);
  EXPECT(after.prefetch_hits_in_flight == before.prefetch_hits_in_flight);
  EXPECT(after.num_single_reclaims == before.num_single_reclaims);
  r.Finish();
  return start;
}

TEST(LayoutLookAheadStartsAPlannedCopyInOnceItsStretchHasRoom) {
  // The plan keeps twice the step's largest buffer (2 MiB) free of planned
  // copies in, so A's copy back waits until the backward pass has freed
  // three of the seven tensors. With the layout look-ahead nothing the
  // stretch allocates needs that room (the backward pass only frees), so
  // the copy starts once one tensor is freed, two frees (20 ms) sooner;
  // either way A lands before its use with its bytes, and nothing is
  // reclaimed on demand.
  const double with_slack = PlannedCopyStart(false);
  const double looked_ahead = PlannedCopyStart(true);
  EXPECT(with_slack > 0 && looked_ahead > 0);
  EXPECT(with_slack - looked_ahead > 0.015);
}

// As StepUntilA, where the seventh tensor took A's chunk: the device holds
// [x | f6 | f0 .. f5 | 960 KiB free]. The backward pass frees f6, f3 and f0,
// then makes a 2 MiB gradient G, then frees the rest before A's use. Six
// steps with the layout look-ahead; the stats before the fourth and after
// the sixth, and the modelled host time those three took.
struct HoleSteps {
  EngineStats before;
  EngineStats after;
  double host_seconds = 0;
};
HoleSteps RunHoleSteps(double look_seconds_per_event,
                       double look_seconds_per_range) {
  PlannedStepRun r(64 * kMiB, 2, 0, /*layout_lookahead=*/true,
                   look_seconds_per_event, look_seconds_per_range);
  const std::string bytes = Pattern(kMiB, 43);
  HoleSteps out;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      out.before = r.engine->GetStats();
      out.host_seconds = -r.device->NowSeconds();
    }
    Buffer* a = r.BeginStepWithA(bytes);
    std::vector<Buffer*> f;
    for (int i = 0; i < 7; ++i) f.push_back(r.Make(kMiB));
    auto release = [&](size_t i) {
      r.Op({f[i], r.x});
      EXPECT_OK(r.engine->FreeBuffer(f[i]));
      for (int k = 0; k < 4; ++k) r.Op({r.x});
    };
    for (size_t i : {6, 3, 0}) release(i);
    Buffer* g = r.Make(2 * kMiB);
    r.Op({g, r.x});
    EXPECT_OK(r.engine->FreeBuffer(g));
    for (size_t i : {1, 2, 4, 5}) release(i);
    r.Op({a, r.x});
    EXPECT(Holds(r.engine.get(), a, bytes));
    r.EndStep(a);
  }
  out.host_seconds += r.device->NowSeconds();
  out.after = r.engine->GetStats();
  r.Finish();
  return out;
}

TEST(LayoutLookAheadKeepsTheHoleItsStretchAllocates) {
  // By bytes A may come back once f6 is freed, and the plan issues it there;
  // but its only place then is f6's hole, which f0's free would make the
  // 2 MiB G needs. The look-ahead finds G without room beside A there and
  // waits; once f3 is freed it puts A in f3's hole instead. G then finds its
  // room, nothing is reclaimed on demand, and A is a prefetch hit with its
  // bytes. Taking the first place that holds A (as best fit would) makes G
  // page out a tensor the step still reads, every step.
  const HoleSteps run = RunHoleSteps(0, 0);
  const EngineStats& before = run.before;
  const EngineStats& after = run.after;
  EXPECT(after.num_planned_prefetches - before.num_planned_prefetches >= 3);
  EXPECT(after.prefetch_misses == before.prefetch_misses);
  EXPECT(after.num_single_reclaims == before.num_single_reclaims);
  EXPECT(after.num_full_reclaims == before.num_full_reclaims);
  EXPECT(after.num_fragment_reclaims == before.num_fragment_reclaims);
  // Each step it refuses f6's hole at least once, and the pins of x alone
  // that follow change no free chunk: their refusals are given again
  // without a look. (A refusal kept past a change would leave A waiting
  // for its use, a miss, which the checks above catch.)
  const int64_t refused =
      after.num_layout_looks_refused - before.num_layout_looks_refused;
  const int64_t repeated =
      after.num_layout_looks_repeated - before.num_layout_looks_repeated;
  EXPECT(refused >= 3);
  EXPECT(repeated >= 3 * 3);
  EXPECT(after.layout_look_events > before.layout_look_events);
}

TEST(LayoutLookAheadChargesItsWorkToAModelledHost) {
  // The same steps on a modelled host that charges 0.1 us per event a look
  // models and 0.03 us per free range it scans: the host takes that much
  // longer, to within rounding, and the looks decide as before (the charge,
  // under 0.1 ms over the three steps, moves no copy across a kernel's 2 ms).
  const HoleSteps free_looks = RunHoleSteps(0, 0);
  const HoleSteps charged = RunHoleSteps(1e-7, 3e-8);
  auto work = [](const HoleSteps& h) {
    return std::make_pair(
        h.after.layout_look_events - h.before.layout_look_events,
        h.after.layout_look_ranges_scanned -
            h.before.layout_look_ranges_scanned);
  };
  const auto [events, scanned] = work(charged);
  EXPECT(events > 0 && scanned > 0);
  EXPECT(work(free_looks) == work(charged));
  const double extra = charged.host_seconds - free_looks.host_seconds;
  const double expected = 1e-7 * static_cast<double>(events) +
                          3e-8 * static_cast<double>(scanned);
  EXPECT(std::fabs(extra - expected) < 1e-9);
}

// One step of 32 MiB in one region: x, then A (6 MiB) and B (25 MiB); A is
// freed and T (4 MiB) takes A's chunk whole, as TensorFlow's split rule has
// it (the 2 MiB left are less than T), so C (2 MiB) finds no room although
// the step's tensors hold 31 MiB. Returns the bytes paged out in the step.
int64_t PaddedStep(Fixture& f, Buffer* x, int seed) {
  Engine* e = f.engine_.get();
  f.engine_->StepBegin();
  void* p;
  for (int i = 0; i < 20; ++i) {  // enough pins to trust the order
    EXPECT_OK(e->Pin(x, &p));
    f.device_->Compute(1e-3);
    EXPECT_OK(e->Unpin(x));
  }
  const int64_t out_before = e->GetStats().bytes_reclaimed;
  Status s;
  Buffer* a = e->AllocateBuffer(6 * kMiB, true, &s, &p);
  EXPECT_OK(s);
  EXPECT_OK(e->Unpin(a));
  Buffer* b = e->AllocateBuffer(25 * kMiB, true, &s, &p);
  EXPECT_OK(s);
  EXPECT_OK(e->Unpin(b));
  EXPECT_OK(e->FreeBuffer(a));
  Buffer* t = e->AllocateBuffer(4 * kMiB, true, &s, &p);
  EXPECT_OK(s);
  EXPECT_OK(e->Unpin(t));
  const std::string b_bytes = Pattern(25 * kMiB, 40 + seed);
  const std::string t_bytes = Pattern(4 * kMiB, 41 + seed);
  const std::string c_bytes = Pattern(2 * kMiB, 42 + seed);
  EXPECT_OK(e->WriteBuffer(b, 0, b_bytes.data(), b_bytes.size()));
  EXPECT_OK(e->WriteBuffer(t, 0, t_bytes.data(), t_bytes.size()));
  EXPECT_OK(e->Pin(t, &p));
  Buffer* c = e->AllocateBuffer(2 * kMiB, true, &s, &p);
  EXPECT_OK(s);
  f.device_->Compute(1e-3);
  EXPECT_OK(e->Unpin(t));
  EXPECT_OK(e->Unpin(c));
  EXPECT_OK(e->WriteBuffer(c, 0, c_bytes.data(), c_bytes.size()));
  EXPECT(Holds(e, b, b_bytes));
  EXPECT(Holds(e, t, t_bytes));
  EXPECT(Holds(e, c, c_bytes));
  const int64_t out = e->GetStats().bytes_reclaimed - out_before;
  for (Buffer* d : {b, t, c}) EXPECT_OK(e->FreeBuffer(d));
  return out;
}

TEST(PaddingMakesRoomBeforeAnyPageOutWhileAPlanIsFollowed) {
  // Once the engine follows the step's plan, which counts T as 4 MiB and so
  // evicts nothing, C gets T's padding instead of a page-out; without a plan
  // (prefetch off) the padding stays and C pages something out.
  for (bool prefetch : {true, false}) {
    Fixture f(32 * kMiB, 64 * kMiB, true, false, prefetch, 0,
              /*allow_growth=*/false);
    Status s;
    Buffer* x = f.engine_->AllocateBuffer(64 * 1024, false, &s);
    EXPECT_OK(s);
    for (int step = 0; step < 6; ++step) {
      const int64_t trimmed = f.engine_->GetStats().bytes_padding_trimmed;
      const int64_t out = PaddedStep(f, x, step);
      const int64_t now = f.engine_->GetStats().bytes_padding_trimmed;
      if (prefetch && step >= 2) {
        EXPECT(out == 0);
        EXPECT(now - trimmed == static_cast<int64_t>(2 * kMiB));
      } else if (!prefetch) {
        EXPECT(out > 0);
        EXPECT(now == 0);
      }
    }
    EXPECT_OK(f.engine_->FreeBuffer(x));
    EXPECT_OK(f.engine_->CheckInvariants());
    EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
  }
}

// One kernel of 1 ms reading `b`.
void RunKernelOn(Fixture& f, Buffer* b) {
  void* p;
  EXPECT_OK(f.engine_->Pin(b, &p));
  f.device_->Compute(1e-3);
  EXPECT_OK(f.engine_->Unpin(b));
}

// Allocates a pinned buffer of `size` into *made, runs its kernel and
// unpins it: the bytes the engine paged out to make its room.
int64_t PagedOutFor(Fixture& f, size_t size, Buffer** made) {
  Engine* e = f.engine_.get();
  const int64_t before = e->GetStats().bytes_reclaimed;
  Status s;
  void* p;
  *made = e->AllocateBuffer(size, true, &s, &p);
  EXPECT_OK(s);
  f.device_->Compute(1e-3);
  EXPECT_OK(e->Unpin(*made));
  return e->GetStats().bytes_reclaimed - before;
}

// One step in a 16 MiB region: x, A (4 MiB), H1 (2), B (4), H2 (2) and C (the
// rest) are made, H1 and H2 freed, and D (4 MiB less x) finds its bytes free
// in two 2 MiB holes with no hole of its size. Then A, B and C are pinned
// again, at once (`soon`) or after 20 other pins. Returns the bytes paged
// out for D.
int64_t SplitHolesStep(Fixture& f, Buffer* x, bool soon, int seed) {
  Engine* e = f.engine_.get();
  e->StepBegin();
  void* p;
  auto op = [&](Buffer* b) { RunKernelOn(f, b); };
  for (int i = 0; i < 20; ++i) op(x);  // enough pins to trust the order
  const size_t rest = 16 * kMiB - 16 * kMiB / 64 - 12 * kMiB;
  std::vector<Buffer*> made;
  for (size_t size : {4 * kMiB, 2 * kMiB, 4 * kMiB, 2 * kMiB, rest}) {
    Status s;
    made.push_back(e->AllocateBuffer(size, true, &s, &p));
    EXPECT_OK(s);
    EXPECT_OK(e->Unpin(made.back()));
  }
  Buffer* a = made[0];
  Buffer* b = made[2];
  Buffer* c = made[4];
  const std::string a_bytes = Pattern(4 * kMiB, 50 + seed);
  const std::string b_bytes = Pattern(4 * kMiB, 51 + seed);
  EXPECT_OK(e->WriteBuffer(a, 0, a_bytes.data(), a_bytes.size()));
  EXPECT_OK(e->WriteBuffer(b, 0, b_bytes.data(), b_bytes.size()));
  EXPECT_OK(e->FreeBuffer(made[1]));
  EXPECT_OK(e->FreeBuffer(made[3]));
  Buffer* d = nullptr;
  const int64_t out = PagedOutFor(f, 4 * kMiB - 16 * kMiB / 64, &d);
  if (!soon) {
    for (int i = 0; i < 20; ++i) op(x);
  }
  for (Buffer* m : {a, b, c}) op(m);
  EXPECT(Holds(e, a, a_bytes));
  EXPECT(Holds(e, b, b_bytes));
  for (Buffer* m : {a, b, c, d}) EXPECT_OK(e->FreeBuffer(m));
  return out;
}

TEST(ASlideKeepsAReclaimVictimThatIsPinnedAgainSoon) {
  // Once the step is learned, D's room comes from sliding B down into H1
  // where the single reclaim's victim is pinned again within 16 pins: no
  // page-out, a slide, both paid back at once otherwise. Where the victims
  // come back 20 pins later, the reclaim pages one out, as before.
  for (bool soon : {true, false}) {
    Fixture f(16 * kMiB, 64 * kMiB, true, false, /*prefetch=*/true, 0,
              /*allow_growth=*/false);
    Status s;
    Buffer* x = f.engine_->AllocateBuffer(16 * kMiB / 64, false, &s);
    EXPECT_OK(s);
    for (int step = 0; step < 6; ++step) {
      const int64_t slides = f.engine_->GetStats().num_defragmentations;
      const int64_t out = SplitHolesStep(f, x, soon, step);
      const int64_t slid = f.engine_->GetStats().num_defragmentations - slides;
      if (step < 3) continue;  // learning the step
      if (soon) {
        EXPECT(out == 0);
        EXPECT(slid == 1);
      } else {
        EXPECT(out > 0);
        EXPECT(slid == 0);
      }
    }
    EXPECT_OK(f.engine_->FreeBuffer(x));
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

// The unfragmented yardstick (EngineOptions::unfragmented) on a 16 MiB
// device: A (4 MiB), H1 (2), B (4), H2 (2), C (4) made and unpinned, H1 and
// H2 freed, then D (4 MiB) asked for. Within the device's addresses D's
// bytes are free in two 2 MiB holes and something pages out (defrag off);
// unfragmented D takes free addresses and nothing leaves. A further 2 MiB
// then finds no free byte unfragmented and pages out; 8 MiB more fail with
// the host full: the bytes in use never pass the device, whatever its
// arena's addresses allow.
TEST(UnfragmentedFindsFreeBytesInOnePieceAndKeepsToTheDevice) {
  for (bool unfragmented : {false, true}) {
    SimOptions so;
    so.device_memory =
        16 * kMiB * (unfragmented ? kUnfragmentedAddressFactor : 1);
    SimDevice device(so);
    EngineOptions eo;
    eo.memory_limit = 16 * kMiB;
    eo.host_memory_limit = 6 * kMiB;  // one 4 MiB buffer and change
    eo.allow_growth = false;
    eo.verify_pins = true;
    eo.unfragmented = unfragmented;
    Engine e(&device, eo);
    EXPECT_OK(e.Init());
    EXPECT(e.GetStats().bytes_limit == static_cast<int64_t>(16 * kMiB));
    std::vector<Buffer*> made;
    std::vector<std::string> bytes;
    for (size_t mib : {4, 2, 4, 2, 4}) {
      Status s;
      void* p;
      made.push_back(e.AllocateBuffer(mib * kMiB, true, &s, &p));
      EXPECT_OK(s);
      bytes.push_back(Pattern(mib * kMiB, 90 + static_cast<int>(made.size())));
      EXPECT_OK(e.WriteBuffer(made.back(), 0, bytes.back().data(), mib * kMiB));
      EXPECT_OK(e.Unpin(made.back()));
    }
    EXPECT_OK(e.FreeBuffer(made[1]));
    EXPECT_OK(e.FreeBuffer(made[3]));
    device.SynchronizeAll();
    Status s;
    Buffer* d = e.AllocateBuffer(4 * kMiB, false, &s);
    EXPECT_OK(s);
    const EngineStats after_d = e.GetStats();
    EXPECT((after_d.bytes_reclaimed == 0) == unfragmented);
    EXPECT(after_d.num_defragmentations == 0);
    Buffer* more = e.AllocateBuffer(2 * kMiB, false, &s);
    EXPECT_OK(s);
    const EngineStats after = e.GetStats();
    // Within the device's addresses D took a victim's room, and 2 MiB holes
    // are left for this one.
    EXPECT((after.bytes_reclaimed > after_d.bytes_reclaimed) == unfragmented);
    // 14 MiB in use and room on the host for 2: 8 MiB more cannot be made,
    // though the unfragmented arena has the addresses for it.
    EXPECT(e.AllocateBuffer(8 * kMiB, false, &s) == nullptr);
    EXPECT(s.code() == Code::kResourceExhausted);
    EXPECT(e.GetStats().peak_bytes_in_use <= static_cast<int64_t>(16 * kMiB));
    for (size_t i : {0, 2, 4}) EXPECT(Holds(&e, made[i], bytes[i]));
    for (Buffer* b : {made[0], made[2], made[4], d, more}) {
      EXPECT_OK(e.FreeBuffer(b));
    }
    EXPECT_OK(e.CheckInvariants());
  }
}

TEST(UnfragmentedIsRefusedWhereItMeansNothing) {
  SimOptions so;
  so.device_memory = 64 * kMiB;
  SimDevice device(so);
  EngineOptions fixed;
  fixed.memory_limit = 16 * kMiB;
  fixed.unfragmented = true;
  fixed.fixed_addresses = true;
  fixed.page_size = 64 << 10;
  Engine a(&device, fixed);
  Status s = a.Init();
  EXPECT(s.code() == Code::kInvalidArgument);
  EXPECT(s.message().find("fixed_addresses") != std::string::npos);
  EngineOptions no_lms;
  no_lms.memory_limit = 16 * kMiB;
  no_lms.unfragmented = true;
  no_lms.lms_enabled = false;
  Engine b(&device, no_lms);
  s = b.Init();
  EXPECT(s.code() == Code::kInvalidArgument);
  EXPECT(s.message().find("lms_enabled") != std::string::npos);
}

// One step in an empty 16 MiB device: x (256 KiB), A (4 MiB), a 2 MiB
// hole, B (4 MiB), S (2 MiB), C (3.75 MiB), all inactive, and then D
// (3.75 MiB): 2 MiB free, 1.75 MiB short. Every single victim (A, B or C)
// is pinned again by the next ops and S only after 20 more ops on x
// (`soon`), or all of them after those 20 ops. Returns the bytes paged out
// for D and, in *slid, the slides.
int64_t TopUpStep(Fixture& f, bool soon, int seed, int64_t* slid) {
  Engine* e = f.engine_.get();
  e->StepBegin();
  void* p;
  auto op = [&](Buffer* b) { RunKernelOn(f, b); };
  std::vector<Buffer*> made;
  std::vector<std::string> bytes;
  for (size_t size : {16 * kMiB / 64, 4 * kMiB, 2 * kMiB, 4 * kMiB, 2 * kMiB,
                      4 * kMiB - 16 * kMiB / 64}) {
    Status s;
    made.push_back(e->AllocateBuffer(size, true, &s, &p));
    EXPECT_OK(s);
    EXPECT_OK(e->Unpin(made.back()));
    bytes.push_back(Pattern(size, 60 + seed + static_cast<int>(made.size())));
    EXPECT_OK(e->WriteBuffer(made.back(), 0, bytes.back().data(), size));
  }
  Buffer* x = made[0];
  for (int i = 0; i < 20; ++i) op(x);  // enough pins to trust the order
  EXPECT_OK(e->FreeBuffer(made[2]));
  f.device_->SynchronizeAll();  // every write landed: all may move
  const int64_t slides_before = e->GetStats().num_defragmentations;
  Buffer* d = nullptr;
  const int64_t out = PagedOutFor(f, 4 * kMiB - 16 * kMiB / 64, &d);
  *slid = e->GetStats().num_defragmentations - slides_before;
  if (!soon) {
    for (int i = 0; i < 20; ++i) op(x);
  }
  for (size_t i : {1, 3, 5}) op(made[i]);  // A, B, C
  if (soon) {
    for (int i = 0; i < 20; ++i) op(x);
  }
  op(made[4]);  // S
  for (size_t i : {0, 1, 3, 4, 5}) EXPECT(Holds(e, made[i], bytes[i]));
  for (size_t i : {0, 1, 3, 4, 5}) EXPECT_OK(e->FreeBuffer(made[i]));
  EXPECT_OK(e->FreeBuffer(d));
  return out;
}

TEST(APageOutOfLessDueLaterAndASlideKeepAReclaimVictimThatIsPinnedAgainSoon) {
  // Once the step is learned, with A, B and C pinned again at once, D's
  // room comes from paging out S (2 MiB, due later) and sliding B down
  // into the hole: no slide alone could, the bytes being short. Where they
  // all come back 20 pins later, the single reclaim pages out C, as before.
  for (bool soon : {true, false}) {
    Fixture f(16 * kMiB, 64 * kMiB, true, false, /*prefetch=*/true, 0,
              /*allow_growth=*/false);
    for (int step = 0; step < 6; ++step) {
      int64_t slid = 0;
      const int64_t out = TopUpStep(f, soon, step, &slid);
      if (step < 3) continue;  // learning the step
      if (soon) {
        EXPECT(out == static_cast<int64_t>(2 * kMiB));
        EXPECT(slid == 1);
      } else {
        EXPECT(out == static_cast<int64_t>(4 * kMiB - 16 * kMiB / 64));
        EXPECT(slid == 0);
      }
    }
    EXPECT_OK(f.engine_->CheckInvariants());
  }
}

TEST(PrefetchedTensorEvictedBeforeItsPinLeavesWithoutACopy) {
  // A prefetched buffer keeps the host copy it came from until its first
  // pin: evicted before that pin it needs no copy out. Once pinned (a
  // kernel may have written it) the copy is gone, and an eviction copies
  // the new bytes out.
  PlannedStepRun r;
  const std::string bytes = Pattern(kMiB, 12);
  const std::string written = Pattern(kMiB, 13);
  for (int step = 0; step < 5; ++step) {
    Buffer* a = r.StepUntilA(bytes);
    if (step == 4) {
      EXPECT(r.engine->GetBufferState(a) == BufferState::kResident);
      const EngineStats before = r.engine->GetStats();
      size_t reclaimed = 0;
      EXPECT_OK(r.engine->ReclaimInactive(&reclaimed));
      const EngineStats after = r.engine->GetStats();
      EXPECT(r.engine->GetBufferState(a) == BufferState::kReclaimed);
      EXPECT(after.num_clean_evictions - before.num_clean_evictions == 1);
      EXPECT(after.bytes_evicted_clean - before.bytes_evicted_clean ==
             static_cast<int64_t>(kMiB));
      // Only x was copied out.
      EXPECT(after.bytes_reclaimed - before.bytes_reclaimed == 64 * 1024);
      EXPECT_OK(r.engine->CheckInvariants());
    }
    r.Op({a, r.x});
    EXPECT(Holds(r.engine.get(), a, bytes));
    if (step == 3) {
      // A came in by prefetch and was pinned: a write now must survive an
      // eviction (a kept host copy would bring the old bytes back).
      EXPECT_OK(r.engine->WriteBuffer(a, 0, written.data(), written.size()));
      const EngineStats before = r.engine->GetStats();
      size_t reclaimed = 0;
      EXPECT_OK(r.engine->ReclaimInactive(&reclaimed));
      const EngineStats after = r.engine->GetStats();
      EXPECT(r.engine->GetBufferState(a) == BufferState::kReclaimed);
      EXPECT(after.num_clean_evictions == before.num_clean_evictions);
      EXPECT(Holds(r.engine.get(), a, written));
    }
    r.EndStep(a);
  }
  r.Finish();
}

TEST(CleanHostCopiesGiveWayToPageOutsWhenTheHostPoolIsFull) {
  // Twelve 200 KiB buffers cycle through a 1 MiB device: about seven live
  // on the host at any time, and up to two prefetched ones keep clean host
  // copies as well. With a host pool just large enough for the former, a
  // page-out that finds it full frees the clean copies and goes on.
  constexpr size_t kSize = 200 * 1024;
  Fixture f(1 * kMiB, 1600 * 1024, true, false, /*prefetch=*/true,
            /*prefetch_budget=*/512 * 1024);
  Status s;
  std::vector<Buffer*> bufs;
  std::vector<std::string> data;
  for (int i = 0; i < 12; ++i) {
    bufs.push_back(f.engine_->AllocateBuffer(kSize, false, &s));
    EXPECT_OK(s);
    data.push_back(Pattern(kSize, 40 + static_cast<uint32_t>(i)));
    EXPECT_OK(f.engine_->WriteBuffer(bufs.back(), 0, data.back().data(),
                                     kSize));
  }
  RunCyclicSteps(&f, bufs, 5);
  const EngineStats st = f.engine_->GetStats();
  EXPECT(st.prefetch_hits > 0);
  EXPECT(st.num_reclaim_failures == 0);
  EXPECT(st.host_peak_bytes_in_use <= 1600 * 1024);
  for (size_t i = 0; i < bufs.size(); ++i) {
    EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  }
  EXPECT_OK(f.engine_->CheckInvariants());
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
}

// A page-in writes a chunk that kernels enqueued before its free may still be
// using, on another stream than theirs. With the host far ahead of the GPU
// (no launch-queue limit here) it must wait for those kernels, and for no
// later ones.
struct RunAheadPageIn {
  RunAheadPageIn() {
    SimOptions so;
    so.device_memory = 4 * kMiB;
    so.link_bytes_per_second = 1e9;  // a 1 MiB copy takes about 1 ms
    device = std::make_unique<SimDevice>(so);
    EngineOptions eo;
    eo.memory_limit = 4 * kMiB;
    eo.host_memory_limit = 16 * kMiB;
    eo.lms_enabled = true;
    // Off: its hash at each unpin reads the bytes, which waits for the
    // kernels and so keeps the host from running ahead. Holds checks A.
    eo.verify_pins = false;
    eo.allow_growth = false;  // one region: A comes back where B was
    engine = std::make_unique<Engine>(device.get(), eo);
    EXPECT_OK(engine->Init());
    Status s;
    x = engine->AllocateBuffer(64 * 1024, false, &s);
    EXPECT_OK(s);
    a = engine->AllocateBuffer(kMiB, false, &s);
    EXPECT_OK(s);
    EXPECT_OK(engine->WriteBuffer(a, 0, bytes.data(), bytes.size()));
    size_t reclaimed = 0;
    EXPECT_OK(engine->ReclaimInactive(&reclaimed));
    EXPECT(engine->GetBufferState(a) == BufferState::kReclaimed);
    void* p = nullptr;
    b = engine->AllocateBuffer(3 * kMiB, true, &s, &p);  // leaves < 1 MiB
    EXPECT_OK(s);
  }
  // Kernels that pin x, enqueued while the host stands still.
  void Kernels(int n, double seconds) {
    void* p = nullptr;
    for (int i = 0; i < n; ++i) {
      EXPECT_OK(engine->Pin(x, &p));
      device->Compute(seconds);
      EXPECT_OK(engine->Unpin(x));
    }
  }
  void FreeB() {
    EXPECT_OK(engine->Unpin(b));
    EXPECT_OK(engine->FreeBuffer(b));
  }
  // Pins A (a page-in into B's old chunk); returns when its copy ended.
  double PinA() {
    void* p = nullptr;
    EXPECT_OK(engine->Pin(a, &p));
    const double landed = device->GetTimeline().h2d_time;
    device->Compute(1e-3);
    EXPECT_OK(engine->Unpin(a));
    EXPECT(Holds(engine.get(), a, bytes));
    EXPECT_OK(engine->CheckInvariants());
    return landed;
  }
  const std::string bytes = Pattern(kMiB, 77);
  std::unique_ptr<SimDevice> device;
  std::unique_ptr<Engine> engine;
  Buffer* x = nullptr;
  Buffer* a = nullptr;
  Buffer* b = nullptr;
};

TEST(PageInWaitsOnlyForTheKernelsBeforeItsChunkWasFreed) {
  // B is used by one kernel and freed; 40 short kernels close the epoch of
  // that free, then 200 long ones run 2 s ahead. A's page-in into B's chunk
  // waits for the first ~40 ms of them, not for all 2 s (it used to wait for
  // everything on the compute stream).
  RunAheadPageIn r;
  r.device->Compute(1e-3);
  r.FreeB();
  r.Kernels(40, 1e-3);
  r.Kernels(200, 10e-3);
  const double landed = r.PinA();
  EXPECT(r.device->GetTimeline().compute_time > 2.0);
  EXPECT(landed < 0.1);
}

TEST(PageInWaitsForTheKernelsThatUsedItsChunkUntilItsFree) {
  // The same, but B is in use (pinned) for all 2 s of kernels and freed
  // after them: A's page-in into its chunk starts only once they ended.
  RunAheadPageIn r;
  r.Kernels(40, 1e-3);
  r.Kernels(200, 10e-3);
  const double freed_on_gpu = r.device->GetTimeline().compute_time;
  r.FreeB();
  EXPECT(r.PinA() >= freed_on_gpu);
}

TEST(ManyThreadsNoCorruptionNoDeadlock) {
  const char* mode = std::getenv("TFLMS_MT_MODE");
  const bool defrag = !mode || std::strchr(mode, 'd');
  const bool prefetch = !mode || std::strchr(mode, 'p');
  Fixture f(4 * kMiB, 256 * kMiB, true, defrag, prefetch);
  constexpr int kThreads = 8;
  std::atomic<int> corruptions{0};
  std::atomic<int> errors{0};
  auto worker = [&](int t) {
    std::minstd_rand rng(t);
    std::vector<std::pair<Buffer*, std::string>> mine;
    for (int op = 0; op < 400; ++op) {
      int r = rng() % 10;
      if (r < 4 || mine.empty()) {
        size_t size = 1024 + rng() % (200 * 1024);
        Status s;
        Buffer* b = f.engine_->AllocateBuffer(size, false, &s);
        if (b == nullptr) continue;  // OOM under contention is allowed
        std::string d = Pattern(size, t * 100000 + op);
        if (!f.engine_->WriteBuffer(b, 0, d.data(), size).ok()) ++errors;
        mine.emplace_back(b, std::move(d));
      } else if (r < 8) {
        auto& m = mine[rng() % mine.size()];
        if (!Holds(f.engine_.get(), m.first, m.second)) ++corruptions;
      } else {
        size_t i = rng() % mine.size();
        if (!f.engine_->FreeBuffer(mine[i].first).ok()) ++errors;
        mine.erase(mine.begin() + i);
      }
      if (op % 97 == 0) f.engine_->StepBegin();
    }
    for (auto& m : mine) {
      if (!Holds(f.engine_.get(), m.first, m.second)) ++corruptions;
      f.engine_->FreeBuffer(m.first);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  std::thread defragger([&] {
    for (int i = 0; defrag && i < 20; ++i) {
      size_t moved;
      f.engine_->Defragment(&moved);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  for (auto& t : threads) t.join();
  defragger.join();
  EXPECT(corruptions == 0);
  EXPECT(errors == 0);
  EXPECT_OK(f.engine_->CheckInvariants());
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.bytes_in_use == 0);
  EXPECT(st.host_bytes_in_use == 0);
}

// ---------------------------------------------------------------------------
// Fixed-address mode (fixed_address.cc): addresses never change; physical
// pages are mapped behind them on the sim device's host virtual memory.

constexpr size_t kPage = 64 * 1024;

struct FixedFixture {
  FixedFixture(size_t device, size_t host, size_t page = kPage,
               bool prefetch = false, bool lms = true) {
    SimOptions so;
    so.device_memory = device;
    device_ = std::make_unique<SimDevice>(so);
    EngineOptions eo;
    eo.memory_limit = device;
    eo.host_memory_limit = host;
    eo.lms_enabled = lms;
    eo.defrag_enabled = true;  // ignored in this mode
    eo.prefetch_enabled = prefetch;
    eo.fixed_addresses = true;
    eo.page_size = page;
    engine_ = std::make_unique<Engine>(device_.get(), eo);
    init_ = engine_->Init();
    if (!init_.ok()) std::fprintf(stderr, "init: %s\n", init_.ToString().c_str());
  }
  std::unique_ptr<SimDevice> device_;
  std::unique_ptr<Engine> engine_;
  Status init_;
};

struct Tracked {
  Buffer* b;
  char* addr;
  size_t size;
  std::string data;
};

// Checks the engine's page accounting against a model built only from what
// a caller sees: each buffer's address and chunk size, its state, and the
// pages the device says are mapped.
bool PagesMatchModel(FixedFixture& f, const std::vector<Tracked>& bufs,
                     const std::vector<std::pair<char*, size_t>>& raws = {}) {
  const EngineStats st = f.engine_->GetStats();
  const size_t page = static_cast<size_t>(st.page_size);
  std::vector<size_t> resident_pages, evicted_pages;
  auto span = [&](char* p, size_t n, std::vector<size_t>* out) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page;
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n - 1) / page;
    for (uintptr_t i = lo; i <= hi; ++i) out->push_back(i);
  };
  int64_t resident_bytes = 0;
  for (const Tracked& t : bufs) {
    const size_t chunk = f.engine_->AllocatedSize(t.addr);
    if (f.engine_->GetBufferState(t.b) == BufferState::kReclaimed) {
      span(t.addr, chunk, &evicted_pages);
    } else {
      span(t.addr, chunk, &resident_pages);
      resident_bytes += static_cast<int64_t>(chunk);
    }
  }
  for (const auto& r : raws) {
    span(r.first, f.engine_->AllocatedSize(r.first), &resident_pages);
    resident_bytes += static_cast<int64_t>(f.engine_->AllocatedSize(r.first));
  }
  auto uniq = [](std::vector<size_t>* v) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  };
  uniq(&resident_pages);
  uniq(&evicted_pages);
  size_t evicted_unmapped = 0;
  for (size_t p : evicted_pages) {
    if (!f.device_->IsMapped(reinterpret_cast<void*>(p * page), page)) {
      ++evicted_unmapped;
    }
  }
  const int64_t mapped = f.device_->mapped_bytes();
  const int64_t budget =
      static_cast<int64_t>(f.engine_->options().memory_limit / page * page);
  bool ok = true;
  auto same = [&](const char* what, int64_t got, int64_t want) {
    if (got == want) return;
    std::fprintf(stderr, "  %s: engine %lld, model %lld\n", what,
                 static_cast<long long>(got), static_cast<long long>(want));
    ok = false;
  };
  same("physical_bytes_in_use", st.physical_bytes_in_use,
       static_cast<int64_t>(resident_pages.size() * page));
  same("bytes_reserved (mapped)", st.bytes_reserved, mapped);
  same("physical_bytes_cached", st.physical_bytes_cached,
       mapped - static_cast<int64_t>(resident_pages.size() * page));
  same("physical_bytes_free", st.physical_bytes_free, budget - mapped);
  same("physical_bytes_evicted", st.physical_bytes_evicted,
       static_cast<int64_t>(evicted_unmapped * page));
  same("bytes_in_use", st.bytes_in_use, resident_bytes);
  same("page identity",
       st.physical_bytes_in_use + st.physical_bytes_cached +
           st.physical_bytes_free,
       budget);
  for (size_t p : resident_pages) {
    if (!f.device_->IsMapped(reinterpret_cast<void*>(p * page), page)) {
      std::fprintf(stderr, "  a resident page is not mapped\n");
      ok = false;
    }
  }
  Status inv = f.engine_->CheckInvariants();
  if (!inv.ok()) {
    std::fprintf(stderr, "  %s\n", inv.ToString().c_str());
    ok = false;
  }
  return ok;
}

Tracked NewTracked(FixedFixture& f, size_t size, uint32_t seed) {
  Status s;
  void* addr = nullptr;
  Buffer* b = f.engine_->AllocateBuffer(size, false, &s, &addr);
  EXPECT_OK(s);
  Tracked t{b, static_cast<char*>(addr), size, Pattern(size, seed)};
  if (b != nullptr) {
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, t.data.data(), size));
  }
  return t;
}

TEST(FixedEveryByteBackAtTheSameAddress) {
  // 16 pages of device, ~6x that live; sizes below a page, straddling pages
  // and spanning several. Every pin returns the address the allocation did,
  // with every byte intact, and the page accounting matches the model at
  // every step.
  FixedFixture f(16 * kPage, 64 * kMiB);
  EXPECT_OK(f.init_);
  std::vector<Tracked> bufs;
  std::minstd_rand rng(3);
  const size_t sizes[] = {1000, 5000, 40000, kPage, kPage + 300,
                          3 * kPage - 700, 100, 70000};
  for (int i = 0; i < 40; ++i) {
    bufs.push_back(NewTracked(f, sizes[i % 8], 500 + i));
    if (bufs.back().b == nullptr) return;
    EXPECT(PagesMatchModel(f, bufs));
  }
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.bytes_reclaimed > 0 && st.num_pages_unmapped > 0);
  for (int round = 0; round < 3; ++round) {
    for (size_t k = 0; k < bufs.size(); ++k) {
      Tracked& t = bufs[(k * 7 + round) % bufs.size()];
      void* ptr = nullptr;
      EXPECT_OK(f.engine_->Pin(t.b, &ptr));
      EXPECT(ptr == t.addr);
      EXPECT_OK(f.engine_->Unpin(t.b));
      EXPECT(Holds(f.engine_.get(), t.b, t.data));
      EXPECT(PagesMatchModel(f, bufs));
    }
  }
  st = f.engine_->GetStats();
  EXPECT(st.num_page_ins > 0 && st.num_pages_mapped > 0);
  EXPECT(st.bytes_reserved <= st.bytes_limit);
  EXPECT(st.num_defragmentations == 0);
  // Free half, then the rest: freed pages become cached, never leak.
  for (size_t i = 0; i < bufs.size(); i += 2) EXPECT_OK(f.engine_->FreeBuffer(bufs[i].b));
  std::vector<Tracked> rest;
  for (size_t i = 1; i < bufs.size(); i += 2) rest.push_back(bufs[i]);
  EXPECT(PagesMatchModel(f, rest));
  for (Tracked& t : rest) EXPECT(Holds(f.engine_.get(), t.b, t.data));
  for (Tracked& t : rest) EXPECT_OK(f.engine_->FreeBuffer(t.b));
  EXPECT(PagesMatchModel(f, {}));
  st = f.engine_->GetStats();
  EXPECT(st.bytes_in_use == 0 && st.physical_bytes_in_use == 0);
  EXPECT(st.physical_bytes_evicted == 0 && st.host_bytes_in_use == 0);
  EXPECT(st.virtual_bytes_in_use == 0);
}

TEST(FixedPageAccountingExactOnAScriptedSequence) {
  // 8 pages; buffers of exactly 3 pages each, so every count is known.
  FixedFixture f(8 * kPage, 64 * kMiB);
  EXPECT_OK(f.init_);
  Tracked a = NewTracked(f, 3 * kPage, 1);
  Tracked b = NewTracked(f, 3 * kPage, 2);
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.physical_bytes_in_use == static_cast<int64_t>(6 * kPage));
  EXPECT(st.physical_bytes_free == static_cast<int64_t>(2 * kPage));
  Tracked c = NewTracked(f, 3 * kPage, 3);  // evicts a (LRU)
  EXPECT(f.engine_->GetBufferState(a.b) == BufferState::kReclaimed);
  st = f.engine_->GetStats();
  EXPECT(st.physical_bytes_in_use == static_cast<int64_t>(6 * kPage));
  EXPECT(st.physical_bytes_evicted == static_cast<int64_t>(3 * kPage));
  EXPECT(st.physical_bytes_free == static_cast<int64_t>(2 * kPage));
  EXPECT(st.num_single_reclaims == 1);
  EXPECT(!f.device_->IsMapped(a.addr, 3 * kPage));
  EXPECT(PagesMatchModel(f, {a, b, c}));
  EXPECT_OK(f.engine_->FreeBuffer(c.b));  // its pages stay mapped: cached
  st = f.engine_->GetStats();
  EXPECT(st.physical_bytes_cached == static_cast<int64_t>(3 * kPage));
  EXPECT(PagesMatchModel(f, {a, b}));
  // a's page-in needs 3 pages; 2 are free, so one cached page is unmapped:
  // no buffer is evicted for it.
  EXPECT(Holds(f.engine_.get(), a.b, a.data));
  st = f.engine_->GetStats();
  EXPECT(f.engine_->GetBufferState(b.b) == BufferState::kResident);
  EXPECT(st.physical_bytes_in_use == static_cast<int64_t>(6 * kPage));
  EXPECT(st.physical_bytes_cached == static_cast<int64_t>(2 * kPage));
  EXPECT(st.physical_bytes_free == 0 && st.physical_bytes_evicted == 0);
  EXPECT(st.num_single_reclaims == 1);
  EXPECT(PagesMatchModel(f, {a, b}));
  EXPECT_OK(f.engine_->FreeBuffer(a.b));
  EXPECT_OK(f.engine_->FreeBuffer(b.b));
  EXPECT(PagesMatchModel(f, {}));
}

TEST(FixedRawAllocationsStayMappedAndAreNeverEvicted) {
  FixedFixture f(8 * kPage, 64 * kMiB);
  Status s;
  char* raw = static_cast<char*>(f.engine_->AllocateRaw(2 * kPage, &s));
  EXPECT_OK(s);
  if (raw == nullptr) return;
  std::memset(raw, 0x3C, 2 * kPage);
  std::vector<Tracked> bufs;
  for (int i = 0; i < 12; ++i) bufs.push_back(NewTracked(f, kPage, 40 + i));
  EXPECT(PagesMatchModel(f, bufs, {{raw, 2 * kPage}}));
  for (size_t i = 0; i < 2 * kPage; ++i) {
    if (raw[i] != 0x3C) {
      EXPECT(raw[i] == 0x3C);
      break;
    }
  }
  // Only raw bytes and pinned buffers left: a request that needs evicting
  // them fails cleanly.
  size_t reclaimed = 0;
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  void* big = f.engine_->AllocateRaw(7 * kPage, &s);
  EXPECT(big == nullptr && s.code() == Code::kResourceExhausted);
  EXPECT(PagesMatchModel(f, bufs, {{raw, 2 * kPage}}));
  for (Tracked& t : bufs) EXPECT(Holds(f.engine_.get(), t.b, t.data));
  for (Tracked& t : bufs) EXPECT_OK(f.engine_->FreeBuffer(t.b));
  f.engine_->DeallocateRaw(raw);
  EXPECT(PagesMatchModel(f, {}));
}

TEST(FixedHostLimitFailsCleanly) {
  FixedFixture f(16 * kPage, 5 * kPage);  // host room for one page-out
  std::vector<Tracked> bufs;
  Status s;
  for (int i = 0; i < 8; ++i) {
    void* addr = nullptr;
    Buffer* b = f.engine_->AllocateBuffer(4 * kPage, false, &s, &addr);
    if (b == nullptr) break;
    Tracked t{b, static_cast<char*>(addr), 4 * kPage, Pattern(4 * kPage, 70 + i)};
    EXPECT_OK(f.engine_->WriteBuffer(b, 0, t.data.data(), t.size));
    bufs.push_back(t);
  }
  EXPECT(s.code() == Code::kResourceExhausted);
  EXPECT(Contains(s, "TF_GPU_HOST_MEM_LIMIT_IN_MB"));
  EXPECT(PagesMatchModel(f, bufs));
  const EngineStats st = f.engine_->GetStats();
  EXPECT(st.host_bytes_in_use <= st.host_bytes_limit);
  for (Tracked& t : bufs) {
    void* p = nullptr;
    if (f.engine_->GetBufferState(t.b) == BufferState::kResident) {
      EXPECT_OK(f.engine_->Pin(t.b, &p));
      EXPECT(p == t.addr);
      EXPECT_OK(f.engine_->Unpin(t.b));
    }
  }
  EXPECT_OK(f.engine_->FreeBuffer(bufs.back().b));
  bufs.pop_back();
  for (Tracked& t : bufs) EXPECT(Holds(f.engine_.get(), t.b, t.data));
  for (Tracked& t : bufs) EXPECT_OK(f.engine_->FreeBuffer(t.b));
  EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
}

TEST(FixedFailedCopyOrUnmapLeavesTheBufferResidentAndIntact) {
  for (int mode = 0; mode < 2; ++mode) {  // 0: D2H copy fails, 1: unmap
    FixedFixture f(8 * kPage, 64 * kMiB);
    std::vector<Tracked> bufs;
    for (int i = 0; i < 2; ++i) bufs.push_back(NewTracked(f, 3 * kPage, 90 + i));
    if (mode == 0) {
      f.device_->FailNextCopies(StreamKind::kDeviceToHost, 100);
    } else {
      f.device_->FailNextUnmaps(100);
    }
    Status s;
    Buffer* extra = f.engine_->AllocateBuffer(4 * kPage, false, &s);
    EXPECT(extra == nullptr && s.code() == Code::kResourceExhausted);
    EXPECT(Contains(s, mode == 0 ? "simulated copy failure"
                                 : "simulated unmap failure"));
    for (Tracked& t : bufs) {
      EXPECT(f.engine_->GetBufferState(t.b) == BufferState::kResident);
      EXPECT(f.device_->IsMapped(t.addr, t.size));
      // Read straight from the address: the bytes never left it.
      EXPECT(std::memcmp(t.addr, t.data.data(), t.size) == 0);
    }
    EXPECT(PagesMatchModel(f, bufs));
    EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
    EXPECT(f.engine_->GetStats().current_bytes_reclaimed == 0);
    f.device_->FailNextCopies(StreamKind::kDeviceToHost, 0);
    f.device_->FailNextUnmaps(0);
    void* addr = nullptr;
    extra = f.engine_->AllocateBuffer(4 * kPage, false, &s, &addr);
    EXPECT(extra != nullptr);
    if (extra == nullptr) continue;
    std::vector<Tracked> all = bufs;
    all.push_back({extra, static_cast<char*>(addr), 4 * kPage, ""});
    EXPECT(PagesMatchModel(f, all));
    for (Tracked& t : bufs) EXPECT(Holds(f.engine_.get(), t.b, t.data));
    for (Tracked& t : bufs) EXPECT_OK(f.engine_->FreeBuffer(t.b));
    EXPECT_OK(f.engine_->FreeBuffer(extra));
    EXPECT(PagesMatchModel(f, {}));
  }
}

TEST(FixedFailedMapLeavesEverythingIntact) {
  FixedFixture f(8 * kPage, 64 * kMiB);
  Tracked a = NewTracked(f, 3 * kPage, 11);
  size_t reclaimed = 0;
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  EXPECT(f.engine_->GetBufferState(a.b) == BufferState::kReclaimed);
  // Page-in: the map fails, the host copy stays, a stays evicted.
  f.device_->FailNextMaps(1);
  void* p = nullptr;
  Status pin = f.engine_->Pin(a.b, &p);
  EXPECT(!pin.ok() && Contains(pin, "simulated map failure"));
  EXPECT(f.engine_->GetBufferState(a.b) == BufferState::kReclaimed);
  EXPECT(f.engine_->GetStats().current_bytes_reclaimed ==
         static_cast<int64_t>(a.size));
  EXPECT(PagesMatchModel(f, {a}));
  // Allocation: the map fails, nothing is held.
  f.device_->FailNextMaps(1);
  Status s;
  Buffer* b = f.engine_->AllocateBuffer(kPage, false, &s);
  EXPECT(b == nullptr && Contains(s, "simulated map failure"));
  EXPECT(PagesMatchModel(f, {a}));
  EXPECT(f.engine_->GetStats().num_map_failures == 2);
  // Then both work, at the same address.
  EXPECT_OK(f.engine_->Pin(a.b, &p));
  EXPECT(p == a.addr);
  EXPECT_OK(f.engine_->Unpin(a.b));
  EXPECT(Holds(f.engine_.get(), a.b, a.data));
  EXPECT_OK(f.engine_->FreeBuffer(a.b));
  EXPECT(PagesMatchModel(f, {}));
}

// Runs `touch` in a forked child; true if the child died instead of
// finishing (a fault: SIGSEGV, or a sanitizer's report of it).
bool TouchFaults(const std::function<void()>& touch) {
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    // The fault is the expected outcome: keep a sanitizer's report of it
    // out of the log.
    const int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) dup2(devnull, 2);
    touch();
    _exit(42);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 42);
}

TEST(FixedTouchOfAnEvictedBufferFaults) {
  FixedFixture f(8 * kPage, 64 * kMiB);
  Tracked a = NewTracked(f, 2 * kPage, 21);
  Tracked small = NewTracked(f, 1000, 22);
  volatile char sink = 0;
  EXPECT(!TouchFaults([&] { sink = a.addr[kPage]; }));  // resident: fine
  size_t reclaimed = 0;
  EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
  EXPECT(f.engine_->GetBufferState(a.b) == BufferState::kReclaimed);
  EXPECT(TouchFaults([&] { sink = a.addr[0]; }));
  EXPECT(TouchFaults([&] { sink = a.addr[2 * kPage - 1]; }));
  EXPECT(TouchFaults([&] { a.addr[kPage] = 1; }));
  // Pinned again: same address, bytes back, no fault.
  void* p = nullptr;
  EXPECT_OK(f.engine_->Pin(a.b, &p));
  EXPECT(p == a.addr);
  f.device_->SynchronizeAll();
  EXPECT(!TouchFaults([&] { sink = a.addr[0]; }));
  EXPECT(std::memcmp(a.addr, a.data.data(), a.size) == 0);
  EXPECT_OK(f.engine_->Unpin(a.b));
  (void)sink;
  EXPECT_OK(f.engine_->FreeBuffer(a.b));
  EXPECT_OK(f.engine_->FreeBuffer(small.b));
}

TEST(FixedModeOptionsAndDefrag) {
  {
    FixedFixture f(8 * kPage, 0, /*page=*/kPage + 1);
    EXPECT(f.init_.code() == Code::kInvalidArgument);
  }
  {
    FixedFixture f(kPage / 2, 0);
    EXPECT(f.init_.code() == Code::kInvalidArgument);
  }
  FixedFixture f(8 * kPage, 64 * kMiB);
  EXPECT_OK(f.init_);
  EXPECT(!f.engine_->options().defrag_enabled);
  Tracked a = NewTracked(f, kPage, 1);
  size_t moved = 1;
  EXPECT_OK(f.engine_->Defragment(&moved));
  EXPECT(moved == 0);
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.page_size == static_cast<int64_t>(kPage));
  EXPECT(st.virtual_bytes_reserved == static_cast<int64_t>(32 * kPage));
  EXPECT(st.bytes_limit == static_cast<int64_t>(8 * kPage));
  f.engine_->ClearStats();
  st = f.engine_->GetStats();
  EXPECT(st.num_pages_mapped == 0 && st.peak_bytes_reserved == st.bytes_reserved);
  EXPECT(st.physical_bytes_in_use == static_cast<int64_t>(2 * kPage) ||
         st.physical_bytes_in_use == static_cast<int64_t>(kPage));
  EXPECT_OK(f.engine_->FreeBuffer(a.b));
  // Without fixed addresses the new statistics stay 0.
  Fixture plain(kMiB, kMiB);
  st = plain.engine_->GetStats();
  EXPECT(st.page_size == 0 && st.physical_bytes_free == 0 &&
         st.virtual_bytes_reserved == 0);
}

// Measures what page sharing costs: physical bytes mapped for the bytes
// resident, against rounding every chunk to whole pages; and how many
// evicted buffers free no page because a resident neighbour shares it.
TEST(FixedPageSharingWasteMeasured) {
  for (size_t page : {size_t{64} << 10, size_t{2} << 20}) {
    const size_t device = 64 * page;
    FixedFixture f(device, size_t{4} << 30, page);
    std::minstd_rand rng(17);
    std::vector<Tracked> bufs;
    size_t requested = 0, rounded = 0;
    // Log-uniform sizes from 256 B to 4 pages: a training step's mix of
    // biases, small activations and large ones.
    while (true) {
      const double lg = std::log2(256.0) +
                        (std::log2(4.0 * page) - std::log2(256.0)) *
                            (rng() / static_cast<double>(rng.max()));
      const size_t size = static_cast<size_t>(std::exp2(lg));
      if (f.engine_->GetStats().physical_bytes_free <
          static_cast<int64_t>(size + 2 * page)) {
        break;
      }
      Status s;
      void* addr = nullptr;
      Buffer* b = f.engine_->AllocateBuffer(size, true, &s, &addr);
      if (b == nullptr) break;
      bufs.push_back({b, static_cast<char*>(addr), size, ""});
      requested += size;
      rounded += (size + page - 1) / page * page;
    }
    EngineStats st = f.engine_->GetStats();
    const double packed_waste =
        1.0 - static_cast<double>(requested) / st.physical_bytes_in_use;
    const double rounded_waste = 1.0 - static_cast<double>(requested) / rounded;
    // Evict every other buffer (the rest stay pinned).
    size_t evicted_bytes = 0;
    for (size_t i = 0; i < bufs.size(); i += 2) {
      EXPECT_OK(f.engine_->Unpin(bufs[i].b));
      evicted_bytes += bufs[i].size;
    }
    size_t reclaimed = 0;
    EXPECT_OK(f.engine_->ReclaimInactive(&reclaimed));
    const EngineStats after = f.engine_->GetStats();
    size_t stay_mapped = 0, small = 0;
    for (size_t i = 0; i < bufs.size(); i += 2) {
      if (bufs[i].size < page) ++small;
      if (f.device_->IsMapped(bufs[i].addr, bufs[i].size)) ++stay_mapped;
    }
    const int64_t freed = st.physical_bytes_in_use - after.physical_bytes_in_use;
    std::printf(
        "  page %zu KiB: %zu buffers, %zu bytes; packed: %.1f%% of mapped "
        "bytes wasted, rounded to pages: %.1f%%; evicting %zu buffers "
        "(%zu bytes, %zu below a page) freed %lld bytes of pages; %zu "
        "evicted buffers stayed wholly mapped\n",
        page >> 10, bufs.size(), requested, 100 * packed_waste,
        100 * rounded_waste, (bufs.size() + 1) / 2, evicted_bytes, small,
        static_cast<long long>(freed), stay_mapped);
    EXPECT(packed_waste < rounded_waste);
    EXPECT(PagesMatchModel(f, bufs));
    for (size_t i = 1; i < bufs.size(); i += 2) EXPECT_OK(f.engine_->Unpin(bufs[i].b));
    for (Tracked& t : bufs) EXPECT_OK(f.engine_->FreeBuffer(t.b));
  }
}

TEST(FixedManyThreadsNoCorruptionNoDeadlock) {
  FixedFixture f(32 * kPage, 256 * kMiB, kPage, /*prefetch=*/true);
  constexpr int kThreads = 6;
  std::atomic<int> corruptions{0}, moved{0}, errors{0}, ooms{0};
  // Six threads may pin up to 4 pages each at once on 32 pages, and an
  // inactive buffer sharing a page with a pinned one frees nothing: an
  // out-of-memory under that contention is allowed, wrong bytes are not.
  auto check = [&](const Tracked& m) {
    std::string got(m.size, '\0');
    Status s = f.engine_->ReadBuffer(m.b, 0, &got[0], m.size);
    if (s.code() == Code::kResourceExhausted) {
      ++ooms;
    } else if (!s.ok() || got != m.data) {
      ++corruptions;
    }
  };
  auto worker = [&](int t) {
    std::minstd_rand rng(t + 100);
    std::vector<Tracked> mine;
    for (int op = 0; op < 300; ++op) {
      const int r = rng() % 10;
      if (r < 4 || mine.empty()) {
        const size_t size = 100 + rng() % (3 * kPage);
        Status s;
        void* addr = nullptr;
        Buffer* b = f.engine_->AllocateBuffer(size, false, &s, &addr);
        if (b == nullptr) continue;
        Tracked tr{b, static_cast<char*>(addr), size, Pattern(size, t * 100000 + op)};
        Status ws = f.engine_->WriteBuffer(b, 0, tr.data.data(), size);
        if (ws.code() == Code::kResourceExhausted) {
          ++ooms;  // the buffer holds no known bytes: drop it
          f.engine_->FreeBuffer(b);
          continue;
        }
        if (!ws.ok()) ++errors;
        mine.push_back(std::move(tr));
      } else if (r < 8) {
        Tracked& m = mine[rng() % mine.size()];
        void* p = nullptr;
        Status ps = f.engine_->Pin(m.b, &p);
        if (ps.ok()) {
          if (p != m.addr) ++moved;
          f.engine_->Unpin(m.b);
        } else if (ps.code() == Code::kResourceExhausted) {
          ++ooms;
        } else {
          ++errors;
        }
        check(m);
      } else {
        const size_t i = rng() % mine.size();
        if (!f.engine_->FreeBuffer(mine[i].b).ok()) ++errors;
        mine.erase(mine.begin() + i);
      }
      if (op % 61 == 0) f.engine_->StepBegin();
      if (op % 50 == 0) {
        Status inv = f.engine_->CheckInvariants();
        if (!inv.ok()) {
          std::fprintf(stderr, "  %s\n", inv.ToString().c_str());
          ++errors;
        }
      }
    }
    for (Tracked& m : mine) {
      check(m);
      f.engine_->FreeBuffer(m.b);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  if (ooms > 0) std::printf("  %d out-of-memory under contention\n", ooms.load());
  EXPECT(corruptions == 0);
  EXPECT(moved == 0);
  EXPECT(errors == 0);
  EXPECT(PagesMatchModel(f, {}));
  const EngineStats st = f.engine_->GetStats();
  EXPECT(st.bytes_in_use == 0 && st.host_bytes_in_use == 0);
  EXPECT(st.bytes_reclaimed > 0);
}


// The workload of training_workload.h (the one cuda_engine_test runs on a
// GPU) on a device under half its peak: every read must see what the last
// write left, in each of the engine's modes.
TEST(TrainingWorkloadReadsWhatItWroteInEveryMode) {
  workload::Shape shape(12, kMiB, 256 * 1024, 4, 0, 0);
  struct Mode {
    const char* name;
    bool prefetch, defrag, fixed;
  };
  for (const Mode& m : {Mode{"on demand", false, false, false},
                        Mode{"prefetch", true, false, false},
                        Mode{"defragment", false, true, false},
                        Mode{"fixed addresses", false, false, true},
                        Mode{"fixed + prefetch", true, false, true}}) {
    SimOptions so;
    so.device_memory = 8 * kMiB;
    SimDevice device(so);
    EngineOptions eo;
    eo.memory_limit = so.device_memory;
    eo.host_memory_limit = 256 * kMiB;
    eo.prefetch_enabled = m.prefetch;
    eo.defrag_enabled = m.defrag;
    eo.verify_moves = m.defrag;
    eo.fixed_addresses = m.fixed;
    eo.page_size = kPage;
    // The look-ahead skips tensors over its budget (by default 1/8 of the
    // device, under these 1 MiB activations), and fixed-address mode has no
    // step plan (step_plan.cc): a budget of two tensors makes prefetch run.
    eo.prefetch_budget_bytes = 2 * kMiB;
    Engine engine(&device, eo);
    EXPECT_OK(engine.Init());
    workload::SimKernels kernels(&device);
    shape.defragment = m.defrag;
    workload::Result r = workload::Run(&engine, &kernels, shape);
    if (!r.status.ok() || r.errors != 0) {
      std::fprintf(stderr, "  %s: %s, %lld wrong words\n", m.name,
                   r.status.ToString().c_str(),
                   static_cast<long long>(r.errors));
    }
    EXPECT_OK(r.status);
    EXPECT(r.errors == 0);
    EXPECT(r.checked == shape.steps * (5 * shape.layers - 2));
    EXPECT(r.stats.bytes_reclaimed > 0 && r.stats.num_page_ins > 0);
    if (m.prefetch) EXPECT(r.stats.prefetch_hits > 0);
    if (m.defrag) EXPECT(r.stats.num_defragmentations > 0);
    EXPECT_OK(engine.CheckInvariants());
    const EngineStats end = engine.GetStats();
    EXPECT(end.bytes_in_use == 0);
  }
}


// One run of the throttle: 320 kernels of 1 ms, each with a pin and an
// unpin (ten epochs), the host spending `host_s` on each launch; with
// `on_host`, a tensor is on the host throughout.
struct ThrottleRun {
  double waited = 0;  // host seconds blocked on the GPU
  int64_t waits = 0;
  int64_t checks = 0;
};
ThrottleRun RunThrottled(int limit, bool prefetch, bool on_host,
                         double host_s) {
  SimOptions so;
  so.device_memory = 64 * kMiB;
  so.store_data = false;
  so.launch_queue_depth = 1000;
  SimDevice sim(so);
  EngineOptions eo;
  eo.memory_limit = 64 * kMiB;
  eo.run_ahead_epochs = limit;
  eo.prefetch_enabled = prefetch;
  Engine engine(&sim, eo);
  EXPECT_OK(engine.Init());
  Status s;
  Buffer* away = engine.AllocateBuffer(kMiB, /*pinned=*/false, &s);
  EXPECT_OK(s);
  void* ptr = nullptr;
  Buffer* b = engine.AllocateBuffer(kMiB, /*pinned=*/true, &s, &ptr);
  EXPECT_OK(s);
  if (on_host) {
    size_t reclaimed = 0;
    EXPECT_OK(engine.ReclaimInactive(&reclaimed));
    EXPECT(engine.GetBufferState(away) == BufferState::kReclaimed);
  }
  const double waited_before = sim.GetTimeline().host_sync_wait;
  for (int i = 0; i < 320; ++i) {
    if (i > 0) EXPECT_OK(engine.Pin(b, &ptr));
    sim.Compute(1e-3);
    if (host_s > 0) sim.HostAdvance(host_s);
    EXPECT_OK(engine.Unpin(b));
  }
  ThrottleRun r;
  r.waited = sim.GetTimeline().host_sync_wait - waited_before;
  r.waits = engine.GetStats().num_run_ahead_waits;
  r.checks = engine.GetStats().num_run_ahead_checks;
  EXPECT_OK(engine.FreeBuffer(away));
  EXPECT_OK(engine.FreeBuffer(b));
  EXPECT_OK(engine.CheckInvariants());
  sim.SynchronizeAll();
  return r;
}

// The host throttle (EngineOptions::run_ahead_epochs), in modelled time: 320
// kernels of 1 ms, each with a pin and an unpin (ten epochs), behind a launch
// queue of 1000. Off, without prefetch, or with nothing on the host, the host
// enqueues them all at once. At 2 epochs with prefetch and a tensor on the
// host, it waits at every close for the kernels of two epochs before: at the
// tenth close for the eighth epoch's, so it has waited until 8 x 32 kernels
// (256 ms) were done.
TEST(RunAheadLimitHoldsTheHostNearTheGpuOnlyWhileTensorsAreOnTheHost) {
  struct Case {
    int limit;
    bool prefetch;
    bool on_host;
  };
  for (const Case c : {Case{0, true, true}, Case{2, false, true},
                       Case{2, true, false}, Case{2, true, true}}) {
    const ThrottleRun r = RunThrottled(c.limit, c.prefetch, c.on_host, 0);
    std::printf("  limit %d, prefetch %s, %s: host waited %.3f s\n", c.limit,
                c.prefetch ? "on" : "off",
                c.on_host ? "a tensor on the host" : "nothing on the host",
                r.waited);
    if (c.limit > 0 && c.prefetch && c.on_host) {
      EXPECT(r.waited > 0.25 && r.waited < 0.26);
      EXPECT(r.waits == 8);  // the closes of epochs 3 to 10
      EXPECT(r.checks == 8);
    } else {
      EXPECT(r.waited < 0.01);
      EXPECT(r.waits == 0);
      EXPECT(r.checks == 0);
    }
  }
  // Out of range: the engine keeps 64 epochs' events.
  SimOptions so;
  so.device_memory = 64 * kMiB;
  SimDevice sim(so);
  EngineOptions eo;
  eo.memory_limit = 64 * kMiB;
  eo.run_ahead_epochs = 64;
  Engine engine(&sim, eo);
  EXPECT(engine.Init().code() == Code::kInvalidArgument);
}

// The same throttle with a host slower than its kernels (each 1 ms kernel
// launched 2 ms after the one before): at every close the GPU is already
// within the limit, so the host never waits and no wait is counted, while
// every close past the limit is still checked.
TEST(RunAheadLimitCountsNoWaitWhereTheGpuIsAlreadyWithinIt) {
  const ThrottleRun r = RunThrottled(2, true, true, 2e-3);
  EXPECT(r.waited < 1e-9);
  EXPECT(r.waits == 0);
  EXPECT(r.checks == 8);  // closes 3 to 10
}

// The training workload in the planner's mode: no bytes, modelled time, the
// H200's measured link rate and a launch queue of 1000.
workload::Result RunModelledWorkload(const workload::Shape& shape,
                                     size_t device, bool prefetch,
                                     bool prefetch_guard,
                                     int lookahead = EngineOptions{}.prefetch_lookahead,
                                     size_t prefetch_budget = 0) {
  SimOptions so;
  so.device_memory = device;
  so.store_data = false;
  so.link_bytes_per_second = 55e9;
  so.launch_queue_depth = 1000;
  SimDevice sim(so);
  EngineOptions eo;
  eo.memory_limit = device;
  eo.prefetch_enabled = prefetch;
  eo.prefetch_guard = prefetch_guard;
  eo.prefetch_lookahead = lookahead;
  eo.prefetch_budget_bytes = prefetch_budget;
  Engine engine(&sim, eo);
  EXPECT_OK(engine.Init());
  workload::SimKernels kernels(&sim, 1 / 3e12);
  workload::Result r = workload::Run(&engine, &kernels, shape);
  EXPECT_OK(r.status);
  return r;
}

// The training workload in the planner's mode (no bytes, modelled time) for
// 24 steps, on a third and a fifth of its peak, with tensors large against
// the device (256 MiB on 3.2 and 1.9 GiB): prefetch must keep its step time
// and not lose to on-demand paging. Before the fixes in
// prefetch.cc, each step's wasted prefetch shortened one more key's distance
// for good (at 3x: +4 ms a step, slower than on demand after 12 steps), and
// at 5x a prefetched tensor sat in the hole the next op's output needed
// (63% slower than on demand).
TEST(PrefetchKeepsItsStepTimeOverManySteps) {
  const workload::Shape shape(32, 256 * kMiB, 32 * kMiB, 24, 2e-3, 4e-3);
  const size_t peak = shape.PeakBytes();
  for (int x : {3, 5}) {
    const size_t device = peak / x / (64 * kMiB) * (64 * kMiB);
    double steady[2] = {0, 0};
    workload::Result runs[2];
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      runs[prefetch] = RunModelledWorkload(shape, device, prefetch == 1, false);
      if (runs[prefetch].step_seconds.size() != 24) return;
      steady[prefetch] = runs[prefetch].step_seconds.back();
    }
    const std::vector<double>& p = runs[1].step_seconds;
    std::printf("  %dx: on demand %.3f s, prefetch step 3 %.3f s, step 24 "
                "%.3f s\n",
                x, steady[0], p[2], p[23]);
    EXPECT(p[23] <= p[2] * 1.01);
    EXPECT(steady[1] <= steady[0] * 1.01);
    EXPECT(runs[1].stats.prefetch_hits > 0 || x == 5);
  }
}

// The prefetch guard (prefetch_guard.cc) on the same workload, planner mode,
// 24 steps: where prefetch wins (3x) it is kept after its trial; where it
// loses (6x: the weights pile up on the device under the learned victim
// choice, and fragment reclaims follow, as measured on an H200) the guard
// pauses it. Either way the steps after the trials run at the faster mode's
// pace. Lookahead 256 and a prefetch budget of one 256 MiB activation: with
// the default budget (an eighth of the device) prefetch wins at 6x at 256
// (0.459 s against 0.475 s) since a tensor over the budget that the plan
// evicts leaves at its last use even within the look-ahead (prefetch.cc),
// and at the default lookahead (128) it now loses by too little for the
// guard's margin (0.519 s; docs/tuning.md); with the activations within the
// budget it loses clearly (0.787 s).
TEST(PrefetchGuardKeepsTheFasterModeOfEachWorkload) {
  constexpr int kLookahead = 256;
  constexpr size_t kBudget = 256 * kMiB;
  const workload::Shape shape(32, 256 * kMiB, 32 * kMiB, 24, 2e-3, 4e-3);
  const size_t peak = shape.PeakBytes();
  for (int x : {3, 6}) {
    const size_t device = peak / x / (64 * kMiB) * (64 * kMiB);
    workload::Result runs[3];  // on demand, prefetch, guarded prefetch
    for (int mode = 0; mode < 3; ++mode) {
      runs[mode] = RunModelledWorkload(shape, device, mode > 0, mode == 2,
                                       kLookahead, kBudget);
      if (runs[mode].step_seconds.size() != 24) return;
    }
    // Steps 12-24: after the trials (steps 5-7 with prefetch, 8-10
    // without; prefetch runs steps 2-4 before, while its plan settles).
    auto late = [](const workload::Result& r) {
      std::vector<double> v(r.step_seconds.begin() + 11, r.step_seconds.end());
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double on_demand = late(runs[0]), prefetch = late(runs[1]),
                 guarded = late(runs[2]);
    // Faster by more than the guard's 2% margin (at 6x 0.787 s against
    // 0.475 s on demand).
    const bool prefetch_wins = prefetch < on_demand * 0.98;
    std::printf("  %dx: on demand %.3f s, prefetch %.3f s, guarded %.3f s, "
                "%lld steps paused\n",
                x, on_demand, prefetch, guarded,
                static_cast<long long>(runs[2].stats.num_prefetch_paused_steps));
    EXPECT(prefetch_wins == (x == 3));  // the premise of the two cases
    EXPECT(guarded <= std::min(on_demand, prefetch) * 1.01);
    // The trial's three steps, and at 6x every step after it too (steps 8-23:
    // a step is counted when the next begins).
    EXPECT(runs[2].stats.num_prefetch_paused_steps == (x == 3 ? 3 : 16));
    EXPECT(runs[1].stats.num_prefetch_paused_steps == 0);
  }
  // Every 50 steps the guard tries the other mode again for three steps and
  // goes back when it is not faster: at 6x over 70 steps, paused in 8-60,
  // prefetch tried in 61-63, paused again from 64 (70 not ended).
  const workload::Shape longer(32, 256 * kMiB, 32 * kMiB, 70, 2e-3, 4e-3);
  const workload::Result r =
      RunModelledWorkload(longer, peak / 6 / (64 * kMiB) * (64 * kMiB), true,
                          true, kLookahead, kBudget);
  EXPECT(r.stats.num_prefetch_paused_steps == 53 + 6);
  if (r.step_seconds.size() == 70) {
    const double paused = r.step_seconds[50], probed = r.step_seconds[62];
    const double again = r.step_seconds[66];
    std::printf("  6x, 70 steps: step 51 %.3f s, 63 (prefetch tried) %.3f s, "
                "67 %.3f s\n", paused, probed, again);
    EXPECT(probed > paused * 1.02 && again <= paused * 1.01);
  }
}

TEST(UseBeforeOrAfterAFailedInitIsRefusedNotACrash) {
  SimOptions so;
  so.device_memory = 4 * kMiB;
  SimDevice device(so);
  for (size_t limit : {size_t{4} * kMiB, size_t{0}}) {
    EngineOptions eo;
    eo.memory_limit = limit;
    Engine engine(&device, eo);
    const bool failed_init = limit == 0;
    if (failed_init) EXPECT(!engine.Init().ok());
    Status s;
    EXPECT(engine.AllocateBuffer(kMiB, true, &s) == nullptr);
    EXPECT(s.code() == Code::kFailedPrecondition);
    EXPECT(s.ToString().find(failed_init ? "memory_limit" : "was not called") !=
           std::string::npos);
    EXPECT(engine.AllocateRaw(kMiB, &s) == nullptr &&
           s.code() == Code::kFailedPrecondition);
    size_t n = 1;
    EXPECT(engine.ReclaimInactive(&n).code() == Code::kFailedPrecondition &&
           n == 0);
    EXPECT(engine.Defragment(&n).code() == Code::kFailedPrecondition);
    EXPECT(engine.CheckInvariants().code() == Code::kFailedPrecondition);
    EXPECT(engine.GetStats().bytes_limit == 0);
    size_t largest = 1, total = 1;
    engine.GetFreeSpace(&largest, &total);
    EXPECT(largest == 0 && total == 0);
    engine.ClearStats();
    engine.DeallocateRaw(nullptr);
  }
}

}  // namespace
}  // namespace tflms

int main() {
  int failed_tests = 0;
  // TFLMS_TEST_FILTER=substring runs only the tests whose name holds it.
  const char* filter = std::getenv("TFLMS_TEST_FILTER");
  for (auto& t : tflms::Registry()) {
    if (filter != nullptr && std::strstr(t.name, filter) == nullptr) continue;
    int before = tflms::g_failures;
    t.fn();
    bool ok = tflms::g_failures == before;
    std::printf("[%s] %s\n", ok ? " OK " : "FAIL", t.name);
    if (!ok) ++failed_tests;
  }
  int total = 0;
  for (auto& t : tflms::Registry()) {
    total += filter == nullptr || std::strstr(t.name, filter) != nullptr;
  }
  std::printf("%d passed, %d failed\n", total - failed_tests, failed_tests);
  return failed_tests == 0 ? 0 : 1;
}
