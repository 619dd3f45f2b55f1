// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Engine tests over the sim backend, run plain, under ASan+UBSan and under
// TSan (make cpp-test, make sanitize). Every test checks bytes, not only
// counters: a buffer's content is a function of (id, generation) and is
// verified after every kind of move.
#include <atomic>
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

#include "sim_device.h"
#include "tflms/engine.h"

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
                   size_t prefetch_budget = 0) {
    SimOptions so;
    so.device_memory = device;
    device_ = std::make_unique<SimDevice>(so);
    EngineOptions eo;
    eo.memory_limit = device;
    eo.host_memory_limit = host;
    eo.lms_enabled = lms;
    eo.defrag_enabled = defrag;
    eo.verify_moves = true;
    eo.prefetch_enabled = prefetch;
    eo.prefetch_budget_bytes = prefetch_budget;
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
  Buffer* extra = f.engine_->AllocateBuffer(400 * 1024, false, &s);
  EXPECT(extra == nullptr);
  EXPECT(s.message().find("simulated copy failure") != std::string::npos);
  for (Buffer* b : bufs) EXPECT(f.engine_->GetBufferState(b) == BufferState::kResident);
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT(Holds(f.engine_.get(), bufs[i], data[i]));
  EXPECT_OK(f.engine_->CheckInvariants());
  EXPECT(f.engine_->GetStats().host_bytes_in_use == 0);
  f.device_->FailNextCopies(StreamKind::kDeviceToHost, 0);
  extra = f.engine_->AllocateBuffer(400 * 1024, false, &s);
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

TEST(PrefetchLearnsTheStepAndHits) {
  Fixture f(1 * kMiB, 32 * kMiB, true, false, /*prefetch=*/true,
            /*prefetch_budget=*/512 * 1024);
  Status s;
  std::vector<Buffer*> bufs;
  for (int i = 0; i < 12; ++i) {
    bufs.push_back(f.engine_->AllocateBuffer(200 * 1024, false, &s));
  }
  for (int step = 0; step < 4; ++step) {
    f.engine_->StepBegin();
    for (Buffer* b : bufs) {
      void* p;
      EXPECT_OK(f.engine_->Pin(b, &p));
      f.device_->Compute(1e-3);
      EXPECT_OK(f.engine_->Unpin(b));
    }
  }
  EngineStats st = f.engine_->GetStats();
  EXPECT(st.num_prefetches > 0);
  EXPECT(st.prefetch_hits > 0);
  for (Buffer* b : bufs) EXPECT_OK(f.engine_->FreeBuffer(b));
  EXPECT_OK(f.engine_->CheckInvariants());
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

}  // namespace
}  // namespace tflms

int main() {
  int failed_tests = 0;
  for (auto& t : tflms::Registry()) {
    int before = tflms::g_failures;
    t.fn();
    bool ok = tflms::g_failures == before;
    std::printf("[%s] %s\n", ok ? " OK " : "FAIL", t.name);
    if (!ok) ++failed_tests;
  }
  int total = static_cast<int>(tflms::Registry().size());
  std::printf("%d passed, %d failed\n", total - failed_tests, failed_tests);
  return failed_tests == 0 ? 0 : 1;
}
