// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// How long an urgent copy waits behind a long one in the same direction, on a
// real GPU: the question that decides how the engine could serve copies out
// of issue order (issue 11: the Ideal schedule serves the earliest deadline
// first, CUDA copy streams run first in, first out).
//
// For each direction, a 2 GiB "background" copy is running when a 64 MiB
// "urgent" one is enqueued 5 ms later, and the urgent copy's latency (enqueue
// to completion, host clock) is measured five ways:
//   same stream       behind the background copy (what the engine does now);
//   second stream     on another stream, default priorities: do the copy
//                     engines share the link or run one copy after the other?
//   priority stream   the same with the second stream at the highest priority;
//   chunked, 2 streams the background as 32 chunks of 64 MiB, all enqueued;
//   fed, one stream   the background fed by the host 2 chunks ahead, the
//                     urgent copy on the same stream (waits for at most ~2).
// Each is run 5 times; medians are printed with the background's own time, so
// the cost of each way to the long copy shows beside its gain to the short one.
// Without a GPU it says so and exits 0.
//
// Build: make build/cuda_copy_lanes (bench/gpu_session.sh runs it).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

#define CHECK(call)                                                      \
  do {                                                                   \
    cudaError_t err_ = (call);                                           \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kBackground = 2048 * kMiB;
constexpr size_t kUrgent = 64 * kMiB;
constexpr int kRepeats = 5;
constexpr auto kUrgentAfter = std::chrono::milliseconds(5);

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Buffers {
  char* host_bg = nullptr;
  char* host_urgent = nullptr;
  char* dev_bg = nullptr;
  char* dev_urgent = nullptr;
};

struct Lane {
  bool to_host;
  const Buffers* b;
  // Copy `bytes` at `offset` of the background (or the urgent buffer).
  void Copy(cudaStream_t s, bool urgent, size_t offset, size_t bytes) const {
    char* host = (urgent ? b->host_urgent : b->host_bg) + offset;
    char* dev = (urgent ? b->dev_urgent : b->dev_bg) + offset;
    if (to_host) {
      CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s));
    } else {
      CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s));
    }
  }
};

struct Result {
  double urgent_s;      // enqueue to completion of the urgent copy
  double background_s;  // start to completion of the background
};

// Completion times are read on the GPU's clock, from an event recorded as the
// background starts: a host thread busy feeding chunks sees a completion
// only when it next looks. The urgent copy's enqueue is on the host clock,
// from the same start (the two differ by a launch, microseconds).
double Elapsed(cudaEvent_t from, cudaEvent_t to) {
  CHECK(cudaEventSynchronize(to));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, from, to));
  return ms * 1e-3;
}

enum class Way { kSameStream, kSecondStream, kPriorityStream, kChunked, kFed };
const char* const kWayNames[] = {"same stream", "second stream",
                                 "priority stream", "chunked, 2 streams",
                                 "fed, one stream"};

// kChunked and kFed cut the background into `chunk` bytes; kFed keeps
// `depth` of them in flight.
Result RunOnce(const Lane& lane, Way way, cudaStream_t a, cudaStream_t b,
               cudaStream_t high, size_t chunk = 64 * kMiB, size_t depth = 2) {
  cudaEvent_t started, bg_done, urgent_done;
  CHECK(cudaEventCreate(&started));
  CHECK(cudaEventCreate(&bg_done));
  CHECK(cudaEventCreate(&urgent_done));
  const size_t chunks = kBackground / chunk;
  const Clock::time_point start = Clock::now();
  CHECK(cudaEventRecord(started, a));
  Clock::time_point urgent_enqueued;
  cudaStream_t urgent_stream = way == Way::kSameStream || way == Way::kFed ? a
                               : way == Way::kPriorityStream              ? high
                                                                          : b;
  auto enqueue_urgent = [&] {
    urgent_enqueued = Clock::now();
    lane.Copy(urgent_stream, true, 0, kUrgent);
    CHECK(cudaEventRecord(urgent_done, urgent_stream));
  };
  if (way == Way::kFed) {
    // The host keeps `depth` chunks in flight; the urgent copy joins the
    // queue at the 5 ms mark and so waits for at most those.
    std::vector<cudaEvent_t> done(chunks);
    for (auto& e : done) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    bool urgent_sent = false;
    for (size_t i = 0; i < chunks; ++i) {
      if (i >= depth) CHECK(cudaEventSynchronize(done[i - depth]));
      if (!urgent_sent && Clock::now() - start >= kUrgentAfter) {
        enqueue_urgent();
        urgent_sent = true;
      }
      lane.Copy(a, false, i * chunk, chunk);
      CHECK(cudaEventRecord(done[i], a));
    }
    if (!urgent_sent) enqueue_urgent();
    CHECK(cudaEventRecord(bg_done, a));
    CHECK(cudaStreamSynchronize(a));
    for (auto& e : done) CHECK(cudaEventDestroy(e));
  } else {
    if (way == Way::kChunked) {
      for (size_t i = 0; i < chunks; ++i) lane.Copy(a, false, i * chunk, chunk);
    } else {
      lane.Copy(a, false, 0, kBackground);
    }
    CHECK(cudaEventRecord(bg_done, a));
    std::this_thread::sleep_until(start + kUrgentAfter);
    enqueue_urgent();
  }
  const Result r{Elapsed(started, urgent_done) - Seconds(start, urgent_enqueued),
                 Elapsed(started, bg_done)};
  CHECK(cudaEventDestroy(started));
  CHECK(cudaEventDestroy(bg_done));
  CHECK(cudaEventDestroy(urgent_done));
  return r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One copy alone on `s`, for the baselines.
double Alone(const Lane& lane, cudaStream_t s, bool urgent, size_t bytes) {
  std::vector<double> t;
  for (int r = 0; r < kRepeats; ++r) {
    const Clock::time_point start = Clock::now();
    lane.Copy(s, urgent, 0, bytes);
    CHECK(cudaStreamSynchronize(s));
    t.push_back(Seconds(start, Clock::now()));
  }
  return Median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  const char* json_path = argc > 1 ? argv[1] : "cuda_copy_lanes.json";
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0;
  CHECK(cudaDriverGetVersion(&driver));
  int least = 0, greatest = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  std::printf("%s, %d async copy engines, driver %d, stream priorities %d..%d\n",
              prop.name, prop.asyncEngineCount, driver, least, greatest);

  Buffers buf;
  CHECK(cudaHostAlloc(&buf.host_bg, kBackground, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&buf.host_urgent, kUrgent, cudaHostAllocDefault));
  CHECK(cudaMalloc(&buf.dev_bg, kBackground));
  CHECK(cudaMalloc(&buf.dev_urgent, kUrgent));
  CHECK(cudaMemset(buf.dev_bg, 1, kBackground));
  CHECK(cudaMemset(buf.dev_urgent, 2, kUrgent));
  std::fill(buf.host_bg, buf.host_bg + kBackground, 3);
  std::fill(buf.host_urgent, buf.host_urgent + kUrgent, 4);
  cudaStream_t a, b, high;
  CHECK(cudaStreamCreateWithPriority(&a, cudaStreamNonBlocking, least));
  CHECK(cudaStreamCreateWithPriority(&b, cudaStreamNonBlocking, least));
  CHECK(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, greatest));

  FILE* json = std::fopen(json_path, "w");
  if (json == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", json_path);
    return 1;
  }
  std::fprintf(json, "{\"device\": \"%s\", \"async_engines\": %d, \"driver\": %d, \"directions\": {",
               prop.name, prop.asyncEngineCount, driver);
  for (int dir = 0; dir < 2; ++dir) {
    const Lane lane{dir == 0, &buf};
    const char* name = dir == 0 ? "D2H" : "H2D";
    lane.Copy(a, false, 0, kBackground);  // warm-up
    CHECK(cudaStreamSynchronize(a));
    const double bg_alone = Alone(lane, a, false, kBackground);
    const double urgent_alone = Alone(lane, a, true, kUrgent);
    std::printf("\n%s: 2 GiB alone %.2f ms (%.1f GB/s); 64 MiB alone %.3f ms\n",
                name, bg_alone * 1e3, kBackground / bg_alone / 1e9,
                urgent_alone * 1e3);
    std::printf("  %-20s %14s %12s %16s %12s\n", "way", "urgent (ms)",
                "x alone", "background (ms)", "x alone");
    std::fprintf(json, "%s\"%s\": {\"background_alone_s\": %.6f, \"urgent_alone_s\": %.6f, \"ways\": {",
                 dir == 0 ? "" : ", ", name, bg_alone, urgent_alone);
    for (int w = 0; w < 5; ++w) {
      std::vector<double> urgent, background;
      for (int r = 0; r < kRepeats; ++r) {
        Result res = RunOnce(lane, static_cast<Way>(w), a, b, high);
        urgent.push_back(res.urgent_s);
        background.push_back(res.background_s);
      }
      const double u = Median(urgent), g = Median(background);
      std::printf("  %-20s %14.3f %12.2f %16.2f %12.3f\n", kWayNames[w],
                  u * 1e3, u / urgent_alone, g * 1e3, g / bg_alone);
      std::fprintf(json, "%s\"%s\": {\"urgent_s\": %.6f, \"background_s\": %.6f}",
                   w == 0 ? "" : ", ", kWayNames[w], u, g);
    }
    std::fprintf(json, "}, \"fed\": [");
    // What feeding costs and buys, by chunk size and depth.
    std::printf("  fed, one stream, by chunk and depth:\n");
    bool first = true;
    for (size_t chunk : {16 * kMiB, 64 * kMiB, 256 * kMiB}) {
      for (size_t depth : {1, 2, 4}) {
        std::vector<double> urgent, background;
        for (int r = 0; r < kRepeats; ++r) {
          Result res = RunOnce(lane, Way::kFed, a, b, high, chunk, depth);
          urgent.push_back(res.urgent_s);
          background.push_back(res.background_s);
        }
        const double u = Median(urgent), g = Median(background);
        std::printf("    %4zu MiB x %zu %14.3f %12.2f %16.2f %12.3f\n",
                    chunk / kMiB, depth, u * 1e3, u / urgent_alone, g * 1e3,
                    g / bg_alone);
        std::fprintf(json, "%s{\"chunk\": %zu, \"depth\": %zu, \"urgent_s\": %.6f, \"background_s\": %.6f}",
                     first ? "" : ", ", chunk, depth, u, g);
        first = false;
      }
    }
    std::fprintf(json, "]}");
  }
  std::fprintf(json, "}}\n");
  std::fclose(json);
  CHECK(cudaStreamDestroy(a));
  CHECK(cudaStreamDestroy(b));
  CHECK(cudaStreamDestroy(high));
  CHECK(cudaFree(buf.dev_bg));
  CHECK(cudaFree(buf.dev_urgent));
  CHECK(cudaFreeHost(buf.host_bg));
  CHECK(cudaFreeHost(buf.host_urgent));
  std::printf("\nwrote %s\n", json_path);
  return 0;
}
