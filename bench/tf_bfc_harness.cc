// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Side-by-side harness: TensorFlow's own tsl::BFCAllocator (from the
// tensorflow-cpu wheel) against the tflms engine over the sim device.
//
//   tf_bfc_harness bench  [reps=N] [scale=small|full]
//       Times allocate/free pairs on the training and random traces for
//       every allocator variant, interleaving repetitions (the order rotates
//       each repetition so drift on a shared machine hits all variants
//       alike), and measures page-out/page-in throughput on the sim backend
//       against plain memcpy. Prints one JSON object; bench/run_bench.py
//       turns it into the table.
//   tf_bfc_harness parity trace=training|random|large|backpedal|exhaust
//       limit=BYTES
//       [capacity=BYTES] [growth=0|1] [fraction=F] [gc=0|1] [seed=S]
//       [steps=N] [allocs=N] [checkpoint=N] [side=both|engine]
//       Replays one trace through TF's BFC and the engine with LMS off in
//       lock step and prints what each did (OOM points, statistics, first
//       step where bytes in use or chunk offsets differ).
//   tf_bfc_harness profile variant=NAME [trace=training|random] [reps=N]
//       Replays one trace through one variant of `bench` (tf_bfc,
//       engine_lms_off_raw, engine_lms_on_raw, engine_lms_on_buffer,
//       engine_lms_on_tensor) once untimed and then `reps` times, and prints
//       its nanoseconds per pair: one allocator alone in the process, for a
//       profiler (bench/README.md, "Where the time goes").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "sim_device.h"
#include "tf_side.h"
#include "tflms/engine.h"
#include "traces.h"

namespace tflms_bench {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "tf_bfc_harness: %s\n", message.c_str());
  std::exit(2);
}

// ---------------------------------------------------------------------------
// Arguments: key=value pairs after the mode.
class Args {
 public:
  Args(int argc, char** argv) {
    for (int i = 2; i < argc; ++i) {
      std::string a = argv[i];
      size_t eq = a.find('=');
      if (eq == std::string::npos) Die("expected key=value, got '" + a + "'");
      values_[a.substr(0, eq)] = a.substr(eq + 1);
    }
  }
  std::string Str(const std::string& k, const std::string& d) const {
    auto it = values_.find(k);
    return it == values_.end() ? d : it->second;
  }
  uint64_t U64(const std::string& k, uint64_t d) const {
    auto it = values_.find(k);
    return it == values_.end() ? d : std::strtoull(it->second.c_str(), nullptr, 10);
  }
  double F64(const std::string& k, double d) const {
    auto it = values_.find(k);
    return it == values_.end() ? d : std::strtod(it->second.c_str(), nullptr);
  }

 private:
  std::map<std::string, std::string> values_;
};

// ---------------------------------------------------------------------------
// TensorFlow's GPU allocator frees wholly free regions before giving up
// (garbage_collection, on unless TF_ENABLE_GPU_GARBAGE_COLLECTION=false).
// The engine gains the same switch as EngineOptions::garbage_collection; until
// it exists these overloads let the harness build and report its absence.
template <typename T>
auto SetGarbageCollection(T* o, bool on, int) -> decltype(o->garbage_collection = on, bool()) {
  o->garbage_collection = on;
  return true;
}
template <typename T>
bool SetGarbageCollection(T*, bool, long) {
  return false;
}
bool EngineHasGarbageCollection() {
  tflms::EngineOptions o;
  return SetGarbageCollection(&o, false, 0);
}

// ---------------------------------------------------------------------------
// The engine over a sim device of its own.
// Forwards to the sim device and stops the process if region growth asks the
// same refused size again and again (the back-off of TF 2.21's Extend can
// stall at 512 B; see tf_side.cc), so a parity run ends instead of hanging.
class GuardedDevice : public tflms::Device {
 public:
  explicit GuardedDevice(std::unique_ptr<tflms::SimDevice> d) : d_(std::move(d)) {}
  const char* Name() const override { return d_->Name(); }
  void* AllocateDeviceMemory(size_t bytes, size_t alignment) override {
    void* p = d_->AllocateDeviceMemory(bytes, alignment);
    if (p != nullptr) {
      refusals_ = 0;
      return p;
    }
    refusals_ = bytes == refused_size_ ? refusals_ + 1 : 1;
    refused_size_ = bytes;
    if (refusals_ >= 100000) {
      std::printf("{\"livelock\": \"engine\", \"bytes\": %zu}\n", bytes);
      std::fflush(stdout);
      std::_Exit(3);
    }
    return nullptr;
  }
  void FreeDeviceMemory(void* p, size_t n) override { d_->FreeDeviceMemory(p, n); }
  void* AllocateHostMemory(size_t n) override { return d_->AllocateHostMemory(n); }
  void FreeHostMemory(void* p, size_t n) override { d_->FreeHostMemory(p, n); }
  tflms::Stream* GetStream(tflms::StreamKind k) override { return d_->GetStream(k); }
  tflms::Status CopyDeviceToHost(tflms::Stream* s, void* dst, const void* src,
                                 size_t n) override {
    return d_->CopyDeviceToHost(s, dst, src, n);
  }
  tflms::Status CopyHostToDevice(tflms::Stream* s, void* dst, const void* src,
                                 size_t n) override {
    return d_->CopyHostToDevice(s, dst, src, n);
  }
  tflms::Status CopyDeviceToDevice(tflms::Stream* s, void* dst, const void* src,
                                   size_t n) override {
    return d_->CopyDeviceToDevice(s, dst, src, n);
  }
  tflms::EventRef RecordEvent(tflms::Stream* s, tflms::Status* st) override {
    return d_->RecordEvent(s, st);
  }
  tflms::Status WaitEvent(tflms::Stream* s, const tflms::EventRef& e) override {
    return d_->WaitEvent(s, e);
  }
  tflms::Status SynchronizeEvent(const tflms::EventRef& e) override {
    return d_->SynchronizeEvent(e);
  }
  bool EventDone(const tflms::EventRef& e) override { return d_->EventDone(e); }
  tflms::Status ReadDeviceSync(void* dst, const void* src, size_t n) override {
    return d_->ReadDeviceSync(dst, src, n);
  }
  tflms::Status WriteDeviceSync(void* dst, const void* src, size_t n) override {
    return d_->WriteDeviceSync(dst, src, n);
  }

 private:
  std::unique_ptr<tflms::SimDevice> d_;
  size_t refused_size_ = 0;
  int refusals_ = 0;
};

// Without store_data the sim device has no bytes (synthetic addresses, copies
// inline): right for allocation timing and parity, where nothing touches the
// memory, exactly as TensorFlow's BFC never touches its arena here. Parity
// runs go through GuardedDevice; timing runs use the sim device directly.
std::unique_ptr<tflms::Device> MakeSimDevice(size_t capacity, bool store_data,
                                             bool guarded) {
  tflms::SimOptions o;
  o.device_memory = capacity;
  o.store_data = store_data;
  auto sim = std::make_unique<tflms::SimDevice>(o);
  if (guarded) return std::make_unique<GuardedDevice>(std::move(sim));
  return sim;
}

struct EngineSetup {
  size_t memory_limit = 0;
  size_t device_capacity = 0;  // 0: memory_limit
  bool allow_growth = true;
  bool lms = false;
  double fragmentation_fraction = 0.0;
  bool garbage_collection = false;
  bool store_data = false;
  bool guarded = false;
};

class EngineUnderTest {
 public:
  explicit EngineUnderTest(const EngineSetup& s) {
    size_t capacity = s.device_capacity ? s.device_capacity : s.memory_limit;
    device_ = MakeSimDevice(capacity, s.store_data, s.guarded);
    tflms::EngineOptions o;
    o.name = s.lms ? "lms_on" : "lms_off";
    o.memory_limit = s.memory_limit;
    o.allow_growth = s.allow_growth;
    o.fragmentation_fraction = s.fragmentation_fraction;
    o.lms_enabled = s.lms;
    SetGarbageCollection(&o, s.garbage_collection, 0);
    engine_ = std::make_unique<tflms::Engine>(device_.get(), o);
    tflms::Status st = engine_->Init();
    if (!st.ok()) Die("engine init: " + st.ToString());
  }
  tflms::Engine* get() { return engine_.get(); }

 private:
  std::unique_ptr<tflms::Device> device_;
  std::unique_ptr<tflms::Engine> engine_;
};

// ---------------------------------------------------------------------------
// Allocator variants for timing. Each replays a whole trace and returns the
// number of failed allocations (the benchmark traces must not fail).
class Variant {
 public:
  virtual ~Variant() = default;
  virtual const char* name() const = 0;
  virtual size_t Replay(const Trace& t) = 0;
};

class TfVariant : public Variant {
 public:
  TfVariant(const TfBfcOptions& o, size_t ids) : bfc_(o), ptrs_(ids, nullptr) {}
  const char* name() const override { return "tf_bfc"; }
  size_t Replay(const Trace& t) override {
    size_t fails = 0;
    for (const TraceOp& op : t.ops) {
      if (op.bytes) {
        void* p = bfc_.Allocate(op.bytes);
        fails += p == nullptr;
        ptrs_[op.id] = p;
      } else if (ptrs_[op.id]) {
        bfc_.Deallocate(ptrs_[op.id]);
        ptrs_[op.id] = nullptr;
      }
    }
    return fails;
  }

 private:
  TfBfc bfc_;
  std::vector<void*> ptrs_;
};

class EngineRawVariant : public Variant {
 public:
  EngineRawVariant(const char* name, const EngineSetup& s, size_t ids)
      : name_(name), e_(s), ptrs_(ids, nullptr) {}
  const char* name() const override { return name_; }
  size_t Replay(const Trace& t) override {
    tflms::Engine* e = e_.get();
    tflms::Status st;
    size_t fails = 0;
    for (const TraceOp& op : t.ops) {
      if (op.bytes) {
        void* p = e->AllocateRaw(op.bytes, &st);
        fails += p == nullptr;
        ptrs_[op.id] = p;
      } else if (ptrs_[op.id]) {
        e->DeallocateRaw(ptrs_[op.id]);
        ptrs_[op.id] = nullptr;
      }
    }
    return fails;
  }

 private:
  const char* name_;
  EngineUnderTest e_;
  std::vector<void*> ptrs_;
};

// `lifecycle`: what a TF tensor does: allocated pinned by its producer,
// unpinned when the producing op ends, pinned and unpinned again by one
// consumer, then freed. Otherwise a bare AllocateBuffer/FreeBuffer pair.
class EngineBufferVariant : public Variant {
 public:
  EngineBufferVariant(const char* name, const EngineSetup& s, size_t ids,
                      bool lifecycle)
      : name_(name), e_(s), bufs_(ids, nullptr), lifecycle_(lifecycle) {}
  const char* name() const override { return name_; }
  size_t Replay(const Trace& t) override {
    tflms::Engine* e = e_.get();
    tflms::Status st;
    size_t fails = 0;
    void* dev = nullptr;
    for (const TraceOp& op : t.ops) {
      if (op.bytes) {
        tflms::Buffer* b = e->AllocateBuffer(op.bytes, lifecycle_, &st);
        fails += b == nullptr;
        if (b && lifecycle_) e->Unpin(b);
        bufs_[op.id] = b;
      } else if (tflms::Buffer* b = bufs_[op.id]) {
        if (lifecycle_) {
          e->Pin(b, &dev);
          e->Unpin(b);
        }
        e->FreeBuffer(b);
        bufs_[op.id] = nullptr;
      }
    }
    return fails;
  }

 private:
  const char* name_;
  EngineUnderTest e_;
  std::vector<tflms::Buffer*> bufs_;
  bool lifecycle_;
};

// ---------------------------------------------------------------------------
// JSON helpers (the output is small; no library needed).
std::string JsonList(const std::vector<double>& v) {
  std::string s = "[";
  char buf[64];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof(buf), "%s%.4f", i ? ", " : "", v[i]);
    s += buf;
  }
  return s + "]";
}

std::string JsonList(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(v[i]);
  }
  return s + "]";
}

// ---------------------------------------------------------------------------
// bench

std::vector<std::unique_ptr<Variant>> MakeVariants(const Trace& t,
                                                   size_t memory_limit) {
  TfBfcOptions tf;
  tf.memory_limit = memory_limit;
  EngineSetup off;
  off.memory_limit = memory_limit;
  EngineSetup on = off;
  on.lms = true;
  std::vector<std::unique_ptr<Variant>> variants;
  variants.emplace_back(new TfVariant(tf, t.num_ids));
  variants.emplace_back(new EngineRawVariant("engine_lms_off_raw", off, t.num_ids));
  variants.emplace_back(new EngineRawVariant("engine_lms_on_raw", on, t.num_ids));
  variants.emplace_back(
      new EngineBufferVariant("engine_lms_on_buffer", on, t.num_ids, false));
  variants.emplace_back(
      new EngineBufferVariant("engine_lms_on_tensor", on, t.num_ids, true));
  return variants;
}

std::string BenchTrace(const Trace& t, size_t memory_limit, int reps) {
  std::vector<std::unique_ptr<Variant>> variants = MakeVariants(t, memory_limit);
  const size_t n = variants.size();
  std::vector<std::vector<double>> ns(n);
  // One untimed replay each: regions grow, bins and chunk tables warm up.
  for (auto& v : variants) {
    if (v->Replay(t) != 0) {
      Die(std::string(v->name()) + " ran out of memory on the " + t.name +
          " trace; the benchmark needs a larger memory limit");
    }
  }
  for (int r = 0; r < reps; ++r) {
    for (size_t k = 0; k < n; ++k) {
      size_t i = (k + static_cast<size_t>(r)) % n;
      auto t0 = Clock::now();
      size_t fails = variants[i]->Replay(t);
      auto t1 = Clock::now();
      if (fails) Die(std::string(variants[i]->name()) + " failed allocations");
      double total = std::chrono::duration<double, std::nano>(t1 - t0).count();
      ns[i].push_back(total / static_cast<double>(t.num_allocs));
    }
  }
  std::string s = "{\"name\": \"" + t.name + "\", \"ops\": " +
                  std::to_string(t.ops.size()) +
                  ", \"allocs\": " + std::to_string(t.num_allocs) +
                  ", \"max_live_bytes\": " + std::to_string(t.max_live_bytes) +
                  ", \"memory_limit\": " + std::to_string(memory_limit) +
                  ", \"rows\": [";
  for (size_t i = 0; i < n; ++i) {
    s += std::string(i ? ", " : "") + "{\"name\": \"" + variants[i]->name() +
         "\", \"ns_per_pair\": " + JsonList(ns[i]) + "}";
  }
  return s + "]}";
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Page-out (ReclaimInactive of one buffer) and page-in (Pin, completed by a
// read that is ordered after it) against memcpy of the same bytes into a
// warm destination.
std::string BenchPaging(const std::vector<size_t>& sizes, int reps) {
  std::string s = "[";
  for (size_t si = 0; si < sizes.size(); ++si) {
    const size_t bytes = sizes[si];
    EngineSetup setup;
    setup.memory_limit = std::max<size_t>(4 * bytes, 64 << 20);
    setup.lms = true;
    setup.store_data = true;
    EngineUnderTest eu(setup);
    tflms::Engine* e = eu.get();
    std::vector<char> src(bytes), dst(bytes);
    for (size_t i = 0; i < bytes; i += 4096) src[i] = static_cast<char>(i >> 12);
    std::memset(dst.data(), 1, bytes);
    std::vector<double> out_gbps, in_gbps, memcpy_gbps;
    for (int r = 0; r < reps + 1; ++r) {  // the first round warms the pools
      tflms::Status st;
      tflms::Buffer* b = e->AllocateBuffer(bytes, false, &st);
      if (!b) Die("paging bench: allocate: " + st.ToString());
      st = e->WriteBuffer(b, 0, src.data(), bytes);
      if (!st.ok()) Die("paging bench: write: " + st.ToString());
      size_t reclaimed = 0;
      auto t0 = Clock::now();
      st = e->ReclaimInactive(&reclaimed);
      auto t1 = Clock::now();
      if (!st.ok() || reclaimed < bytes) Die("paging bench: reclaim: " + st.ToString());
      void* dev = nullptr;
      char probe[256];
      auto t2 = Clock::now();
      st = e->Pin(b, &dev);
      if (st.ok()) st = e->ReadBuffer(b, bytes - sizeof(probe), probe, sizeof(probe));
      auto t3 = Clock::now();
      if (!st.ok()) Die("paging bench: page-in: " + st.ToString());
      e->Unpin(b);
      e->FreeBuffer(b);
      auto t4 = Clock::now();
      std::memcpy(dst.data(), src.data(), bytes);
      auto t5 = Clock::now();
      if (dst[bytes / 2] != src[bytes / 2]) Die("memcpy check");
      if (r == 0) continue;
      out_gbps.push_back(static_cast<double>(bytes) / Seconds(t0, t1) / 1e9);
      in_gbps.push_back(static_cast<double>(bytes) / Seconds(t2, t3) / 1e9);
      memcpy_gbps.push_back(static_cast<double>(bytes) / Seconds(t4, t5) / 1e9);
    }
    s += std::string(si ? ", " : "") + "{\"bytes\": " + std::to_string(bytes) +
         ", \"page_out_gbps\": " + JsonList(out_gbps) +
         ", \"page_in_gbps\": " + JsonList(in_gbps) +
         ", \"memcpy_gbps\": " + JsonList(memcpy_gbps) + "}";
  }
  return s + "]";
}

// Resident bytes of this process now (not its peak), from /proc/self/statm.
int64_t ResidentBytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

// Host memory each allocator's own bookkeeping holds once it has taken the
// whole device as one region (TensorFlow's default, allow_growth off) and
// made one allocation. Neither device's memory is touched: TensorFlow's
// sub-allocator maps its arena without reserving it, the engine's sim device
// hands out addresses only.
std::string BenchBookkeeping(const std::vector<size_t>& limits) {
  std::string out = "[";
  for (size_t i = 0; i < limits.size(); ++i) {
    const size_t limit = limits[i];
    int64_t tf_bytes = 0, engine_bytes = 0;
    {
      TfBfcOptions to;
      to.memory_limit = limit;
      to.allow_growth = false;
      const int64_t before = ResidentBytes();
      TfBfc tf(to);
      void* p = tf.Allocate(256);
      if (p == nullptr) Die("bookkeeping: TensorFlow's BFC refused 256 bytes");
      tf_bytes = ResidentBytes() - before;
      tf.Deallocate(p);
    }
    {
      EngineSetup es;
      es.memory_limit = limit;
      es.allow_growth = false;
      es.lms = true;
      const int64_t before = ResidentBytes();
      EngineUnderTest eu(es);
      tflms::Status st;
      void* p = eu.get()->AllocateRaw(256, &st);
      if (p == nullptr) Die("bookkeeping: the engine refused 256 bytes: " + st.ToString());
      engine_bytes = ResidentBytes() - before;
      eu.get()->DeallocateRaw(p);
    }
    if (i) out += ", ";
    out += "{\"memory_limit\": " + std::to_string(limit) +
           ", \"tf_bytes\": " + std::to_string(tf_bytes) +
           ", \"engine_bytes\": " + std::to_string(engine_bytes) + "}";
  }
  return out + "]";
}

// The bench's two traces and the memory limit each runs under.
constexpr size_t kTrainingLimit = size_t{8} << 30;
constexpr size_t kRandomLimit = size_t{4} << 30;
Trace BenchTrainingTrace(bool full) {
  return TrainingTrace(1, /*batch=*/16, full ? 200 : 4);
}
Trace BenchRandomTrace(bool full) {
  return RandomTrace(2, full ? 1000000 : 50000, 1000, 1 << 20);
}

int RunBench(const Args& args) {
  const int reps = static_cast<int>(args.U64("reps", 7));
  const bool full = args.Str("scale", "full") == "full";
  const int paging_reps = static_cast<int>(args.U64("paging_reps", 9));
  std::string out = "{\"traces\": [";
  out += BenchTrace(BenchTrainingTrace(full), kTrainingLimit, reps);
  out += ", ";
  out += BenchTrace(BenchRandomTrace(full), kRandomLimit, reps);
  out += "], \"paging\": ";
  std::vector<size_t> sizes = {size_t{1} << 20, size_t{16} << 20};
  if (full) sizes.push_back(size_t{128} << 20);
  out += BenchPaging(sizes, paging_reps);
  out += ", \"bookkeeping\": ";
  out += BenchBookkeeping({size_t{16} << 30, size_t{80} << 30});
  out += "}";
  std::printf("%s\n", out.c_str());
  return 0;
}

int RunProfile(const Args& args) {
  const std::string trace = args.Str("trace", "random");
  if (trace != "random" && trace != "training") {
    Die("trace must be random or training, got '" + trace + "'");
  }
  const bool random = trace == "random";
  const Trace t = random ? BenchRandomTrace(true) : BenchTrainingTrace(true);
  const std::string name = args.Str("variant", "");
  for (auto& v : MakeVariants(t, random ? kRandomLimit : kTrainingLimit)) {
    if (v->name() != name) continue;
    const int reps = static_cast<int>(args.U64("reps", 3));
    if (v->Replay(t) != 0) Die(name + " ran out of memory");
    auto t0 = Clock::now();
    for (int r = 0; r < reps; ++r) {
      if (v->Replay(t) != 0) Die(name + " failed allocations");
    }
    double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
    std::printf("{\"variant\": \"%s\", \"trace\": \"%s\", \"ns_per_pair\": %.1f}\n",
                name.c_str(), trace.c_str(),
                ns / static_cast<double>(reps) / static_cast<double>(t.num_allocs));
    return 0;
  }
  Die("no variant '" + name + "'; one of tf_bfc, engine_lms_off_raw, "
      "engine_lms_on_raw, engine_lms_on_buffer, engine_lms_on_tensor");
}

// ---------------------------------------------------------------------------
// parity

struct Side {
  std::vector<int64_t> oom_ops;     // op indices of failed allocations
  std::vector<int64_t> oom_allocs;  // their ordinals among allocations
  int64_t num_ooms = 0;
};

TfBfcStats MirrorStats(const tflms::EngineStats& b) {
  TfBfcStats a;
  a.num_allocs = b.num_allocs;
  a.bytes_in_use = b.bytes_in_use;
  a.peak_bytes_in_use = b.peak_bytes_in_use;
  a.largest_alloc_size = b.largest_alloc_size;
  a.bytes_limit = b.bytes_limit;
  a.pool_bytes = b.bytes_reserved;
  a.peak_pool_bytes = b.peak_bytes_reserved;
  return a;
}

int RunParity(const Args& args) {
  const std::string which = args.Str("trace", "training");
  const uint64_t seed = args.U64("seed", 7);
  Trace t;
  if (which == "training") {
    t = TrainingTrace(seed, args.U64("batch", 16), static_cast<int>(args.U64("steps", 3)));
  } else if (which == "random") {
    t = RandomTrace(seed, args.U64("allocs", 100000), 1000, 1 << 20);
  } else if (which == "large") {
    // Sizes up to 1 GiB: exercises the last bin (>= 256 MiB) and the
    // 128 MiB internal-fragmentation split rule.
    t = RandomTrace(seed, args.U64("allocs", 20000), 24, size_t{1} << 30);
    t.name = "large";
  } else if (which == "backpedal") {
    // Regions of 2, 4, ..., 512 MiB fill exactly 1022 MiB; the 600 MiB
    // request then asks for 1 GiB, which a device holding less refuses, and
    // both allocators back off by 10% steps until a region fits.
    std::vector<uint64_t> sizes;
    for (uint64_t m = 2; m <= 512; m *= 2) sizes.push_back(m << 20);
    sizes.push_back(uint64_t{600} << 20);
    sizes.push_back(uint64_t{70} << 20);
    t = SequenceTrace("backpedal", sizes);
  } else if (which == "exhaust") {
    // Regions of 2 and 4 MiB fill a 6 MiB device; the 256-byte request then
    // needs a region the device cannot give.
    t = SequenceTrace("exhaust", {uint64_t{2} << 20, uint64_t{4} << 20, 256});
  } else {
    Die("unknown trace '" + which + "' (training, random, large, backpedal, exhaust)");
  }
  const size_t limit = args.U64("limit", 0);
  if (limit == 0) Die("parity needs limit=BYTES");
  const size_t capacity = args.U64("capacity", limit);
  const bool growth = args.U64("growth", 1) != 0;
  const double fraction = args.F64("fraction", 0.0);
  const uint64_t checkpoint = std::max<uint64_t>(1, args.U64("checkpoint", 1000));
  // side=engine replays the engine alone (TensorFlow's BFC may never return
  // on some traces, see tf_side.cc).
  const std::string side = args.Str("side", "both");
  if (side != "both" && side != "engine") Die("side must be both or engine");
  const bool with_tf = side == "both";

  TfBfcOptions to;
  to.memory_limit = limit;
  to.device_capacity = capacity;
  to.allow_growth = growth;
  to.fragmentation_fraction = fraction;
  // TensorFlow's GPU allocator turns this on unless
  // TF_ENABLE_GPU_GARBAGE_COLLECTION=false; off by default here.
  const bool gc = args.U64("gc", 0) != 0;
  to.garbage_collection = gc;
  std::unique_ptr<TfBfc> tf_owner;
  if (with_tf) tf_owner = std::make_unique<TfBfc>(to);
  TfBfc* tf = tf_owner.get();
  EngineSetup es;
  es.memory_limit = limit;
  es.device_capacity = capacity;
  es.allow_growth = growth;
  es.fragmentation_fraction = fraction;
  es.lms = false;
  es.garbage_collection = gc;
  es.guarded = true;
  EngineUnderTest eu(es);
  tflms::Engine* e = eu.get();

  std::vector<void*> tp(t.num_ids, nullptr), ep(t.num_ids, nullptr);
  Side ts, esd;
  int64_t first_in_use_diff = -1, first_outcome_diff = -1, first_offset_diff = -1;
  int64_t first_reserved_diff = -1;
  std::string first_offset_detail;
  std::vector<int64_t> cps;  // op, tf in use, engine in use, tf pool, engine reserved
  int64_t alloc_ordinal = -1;
  const char* e_base = nullptr;
  const char* t_base = nullptr;
  tflms::Status st;
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const TraceOp& op = t.ops[i];
    if (op.bytes) {
      ++alloc_ordinal;
      void* a = tf ? tf->Allocate(op.bytes) : nullptr;
      void* b = e->AllocateRaw(op.bytes, &st);
      // Without TensorFlow, mirror the engine so nothing below reports a
      // difference.
      if (!tf) a = b;
      tp[op.id] = a;
      ep[op.id] = b;
      if (!a) {
        ++ts.num_ooms;
        if (ts.oom_ops.size() < 16) {
          ts.oom_ops.push_back(static_cast<int64_t>(i));
          ts.oom_allocs.push_back(alloc_ordinal);
        }
      }
      if (!b) {
        ++esd.num_ooms;
        if (esd.oom_ops.size() < 16) {
          esd.oom_ops.push_back(static_cast<int64_t>(i));
          esd.oom_allocs.push_back(alloc_ordinal);
        }
      }
      if ((a == nullptr) != (b == nullptr) && first_outcome_diff < 0) {
        first_outcome_diff = static_cast<int64_t>(i);
      }
      if (a && b) {
        // Offsets relative to the first chunk each handed out: the same
        // when both lay regions out alike and pick the same chunks.
        if (!t_base) {
          t_base = static_cast<const char*>(a);
          e_base = static_cast<const char*>(b);
        }
        int64_t to_off = static_cast<const char*>(a) - t_base;
        int64_t eo_off = static_cast<const char*>(b) - e_base;
        if (to_off != eo_off && first_offset_diff < 0) {
          first_offset_diff = static_cast<int64_t>(i);
          first_offset_detail = "bytes " + std::to_string(op.bytes) + ": tf offset " +
                                std::to_string(to_off) + ", engine offset " +
                                std::to_string(eo_off);
        }
      }
    } else {
      if (tp[op.id] && tf) tf->Deallocate(tp[op.id]);
      if (ep[op.id]) e->DeallocateRaw(ep[op.id]);
      tp[op.id] = ep[op.id] = nullptr;
    }
    tflms::EngineStats b = e->GetStats();
    TfBfcStats a = tf ? tf->Stats() : MirrorStats(b);
    if (a.bytes_in_use != b.bytes_in_use && first_in_use_diff < 0) {
      first_in_use_diff = static_cast<int64_t>(i);
    }
    if (a.pool_bytes != b.bytes_reserved && first_reserved_diff < 0) {
      first_reserved_diff = static_cast<int64_t>(i);
    }
    if (i % checkpoint == 0 || i + 1 == t.ops.size()) {
      cps.insert(cps.end(), {static_cast<int64_t>(i), a.bytes_in_use, b.bytes_in_use,
                             a.pool_bytes, b.bytes_reserved});
    }
  }
  tflms::EngineStats b = e->GetStats();
  TfBfcStats a = tf ? tf->Stats() : MirrorStats(b);
  std::string out = "{\"trace\": \"" + t.name + "\", \"ops\": " + std::to_string(t.ops.size()) +
                    ", \"allocs\": " + std::to_string(t.num_allocs) +
                    ", \"max_live_bytes\": " + std::to_string(t.max_live_bytes) +
                    ", \"limit\": " + std::to_string(limit) +
                    ", \"capacity\": " + std::to_string(capacity) +
                    ", \"growth\": " + (growth ? "true" : "false") +
                    ", \"side\": \"" + side + "\"" +
                    ", \"gc\": " + (gc ? "true" : "false") + ", \"engine_has_gc\": " +
                    (EngineHasGarbageCollection() ? "true" : "false");
  out += ", \"tf\": {\"oom_ops\": " + JsonList(ts.oom_ops) +
         ", \"oom_allocs\": " + JsonList(ts.oom_allocs) +
         ", \"num_ooms\": " + std::to_string(ts.num_ooms) +
         ", \"num_allocs\": " + std::to_string(a.num_allocs) +
         ", \"peak_bytes_in_use\": " + std::to_string(a.peak_bytes_in_use) +
         ", \"largest_alloc_size\": " + std::to_string(a.largest_alloc_size) +
         ", \"bytes_limit\": " + std::to_string(a.bytes_limit) +
         ", \"bytes_reserved\": " + std::to_string(a.bytes_reserved) +
         ", \"peak_bytes_reserved\": " + std::to_string(a.peak_bytes_reserved) +
         ", \"pool_bytes\": " + std::to_string(a.pool_bytes) +
         ", \"peak_pool_bytes\": " + std::to_string(a.peak_pool_bytes) +
         ", \"bytes_in_use\": " + std::to_string(a.bytes_in_use) + "}";
  out += ", \"engine\": {\"oom_ops\": " + JsonList(esd.oom_ops) +
         ", \"oom_allocs\": " + JsonList(esd.oom_allocs) +
         ", \"num_ooms\": " + std::to_string(esd.num_ooms) +
         ", \"num_allocs\": " + std::to_string(b.num_allocs) +
         ", \"peak_bytes_in_use\": " + std::to_string(b.peak_bytes_in_use) +
         ", \"largest_alloc_size\": " + std::to_string(b.largest_alloc_size) +
         ", \"bytes_limit\": " + std::to_string(b.bytes_limit) +
         ", \"bytes_reserved\": " + std::to_string(b.bytes_reserved) +
         ", \"peak_bytes_reserved\": " + std::to_string(b.peak_bytes_reserved) +
         ", \"bytes_in_use\": " + std::to_string(b.bytes_in_use) +
         ", \"num_ooms_counted\": " + std::to_string(b.num_ooms) + "}";
  out += ", \"first_outcome_diff\": " + std::to_string(first_outcome_diff) +
         ", \"first_in_use_diff\": " + std::to_string(first_in_use_diff) +
         ", \"first_reserved_diff\": " + std::to_string(first_reserved_diff) +
         ", \"first_offset_diff\": " + std::to_string(first_offset_diff) +
         ", \"first_offset_detail\": \"" + first_offset_detail + "\"" +
         ", \"checkpoints\": " + JsonList(cps) + "}";
  std::printf("%s\n", out.c_str());
  return 0;
}

}  // namespace
}  // namespace tflms_bench

int main(int argc, char** argv) {
  tflms_bench::QuietTensorFlowLogs();
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "bench") return tflms_bench::RunBench(tflms_bench::Args(argc, argv));
  if (mode == "parity") return tflms_bench::RunParity(tflms_bench::Args(argc, argv));
  if (mode == "profile") return tflms_bench::RunProfile(tflms_bench::Args(argc, argv));
  std::fprintf(stderr,
               "usage: tf_bfc_harness bench [reps=N] [scale=small|full]\n"
               "       tf_bfc_harness parity trace=training|random|large limit=BYTES "
               "[capacity=BYTES] [growth=0|1] [fraction=F] [seed=S]\n"
               "       tf_bfc_harness profile variant=NAME [trace=training|random] "
               "[reps=N]\n");
  return 2;
}
