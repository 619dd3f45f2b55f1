// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// A training step's shape over the engine, with kernels that really read and
// write the buffers' bytes. One driver, two backends:
//   * SimDevice: each kernel is host code on the sim's compute worker
//     (SimDevice::Launch), racing with the copy workers (engine_test.cc);
//   * CudaDevice: each kernel is a CUDA kernel on the engine's compute
//     stream (cuda_engine_test.cu, bench/cuda_bench.cu).
//
// What it keeps, and checks on every read: each 32-bit word i of a buffer
// holds Pattern(seed, i), where the seed names the buffer and the write that
// produced it (layer, step, generation). A kernel that reads a buffer checks
// every word against the seed of the last kernel that wrote it, so a page-in
// that landed after its reader, a page-out that copied before its writer, a
// chunk handed out while its last reader was still queued, or a stale copy
// brought back shows as a counted error, not as a crash.
//
// The driver follows TensorFlow's executor: an op's inputs are pinned
// before its output is allocated and its kernels launched, and unpinned
// right after the launch (not after the kernels ran); a buffer is freed as
// soon as its last op was launched. The host only waits at the end of a
// step (the loss fetch).
#ifndef TFLMS_CORE_TESTS_TRAINING_WORKLOAD_H_
#define TFLMS_CORE_TESTS_TRAINING_WORKLOAD_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "tflms/engine.h"

#ifdef __CUDACC__
#define TFLMS_HOST_DEVICE __host__ __device__
#else
#define TFLMS_HOST_DEVICE
#endif

namespace tflms {
namespace workload {

// Word i of a buffer written with `seed` (a 32-bit mix; words of different
// seeds differ almost everywhere, so one stale word is enough to notice).
TFLMS_HOST_DEVICE inline uint32_t Pattern(uint32_t seed, uint64_t i) {
  uint32_t x = seed * 0x9E3779B1u ^ static_cast<uint32_t>(i) ^
               static_cast<uint32_t>(i >> 32) * 0x85EBCA77u;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The kernels a backend provides. Every call enqueues on the compute stream
// the engine orders its copies against, and returns without waiting.
class Kernels {
 public:
  virtual ~Kernels() = default;
  // Words [0, bytes / 4) of `p` become Pattern(seed, i).
  virtual void Fill(void* p, size_t bytes, uint32_t seed) = 0;
  // Counts the words of `p` that are not Pattern(seed, i).
  virtual void Check(const void* p, size_t bytes, uint32_t seed) = 0;
  // Keeps the compute stream busy for `seconds` (the layer's arithmetic).
  virtual void Busy(double seconds) = 0;
  // Blocks the host until every kernel enqueued so far has run.
  virtual void Synchronize() = 0;
  // Words counted wrong so far (after Synchronize).
  virtual int64_t Errors() = 0;
  // The host's clock in seconds: wall time on a GPU, the modelled host
  // clock on the sim (whose planner mode has no real time).
  virtual double Now() {
    return std::chrono::duration<double>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

struct Shape {
  int layers = 8;
  size_t activation_bytes = size_t{1} << 20;  // each layer's output
  size_t weight_bytes = size_t{256} << 10;    // each layer's weights
  int steps = 3;
  double forward_seconds = 0;   // Busy per layer, forward
  double backward_seconds = 0;  // Busy per layer, backward
  // Call Engine::StepBegin at each step (the engine learns steps from it).
  bool step_begin = true;
  // Defragment halfway through the backward pass, where the freed
  // activations have left holes.
  bool defragment = false;

  Shape() = default;
  Shape(int layers, size_t activation_bytes, size_t weight_bytes, int steps,
        double forward_seconds, double backward_seconds)
      : layers(layers),
        activation_bytes(activation_bytes),
        weight_bytes(weight_bytes),
        steps(steps),
        forward_seconds(forward_seconds),
        backward_seconds(backward_seconds) {}

  // Live bytes at the end of the forward pass (every activation and weight,
  // and the first backward op's two gradients): the step's peak.
  size_t PeakBytes() const {
    return layers * (activation_bytes + weight_bytes) + 2 * activation_bytes;
  }
};

struct Result {
  Status status;        // the first engine call that failed, if any
  int64_t errors = 0;   // words a kernel read wrong
  int64_t checked = 0;  // buffers the kernels checked
  std::vector<double> step_seconds;  // Kernels::Now() per step
  std::vector<EngineStats> step_stats;  // at the end of each step
  EngineStats stats;
};

namespace internal {

inline uint32_t Seed(uint32_t kind, uint32_t layer, uint32_t generation) {
  return (kind << 28) ^ (layer << 16) ^ generation;
}

// The engine calls around one kernel: pins, launch, unpins.
class Launcher {
 public:
  Launcher(Engine* engine, Kernels* kernels, Result* result)
      : engine_(engine), kernels_(kernels), result_(result) {}

  bool ok() const { return result_->status.ok(); }

  void* Pin(Buffer* b) {
    void* p = nullptr;
    if (!ok()) return nullptr;
    Status s = engine_->Pin(b, &p);
    if (!s.ok()) {
      result_->status = s;
      return nullptr;
    }
    return p;
  }
  void Unpin(Buffer* b) {
    if (!ok()) return;
    Status s = engine_->Unpin(b);
    if (!s.ok()) result_->status = s;
  }
  Buffer* Allocate(size_t bytes, void** ptr) {
    if (!ok()) return nullptr;
    Status s;
    Buffer* b = engine_->AllocateBuffer(bytes, /*pinned=*/true, &s, ptr);
    if (b == nullptr) result_->status = s;
    return b;
  }
  void Free(Buffer* b) {
    if (b == nullptr) return;
    Status s = engine_->FreeBuffer(b);
    if (!s.ok() && ok()) result_->status = s;
  }
  // One op as TensorFlow's executor runs it: its inputs pinned (paged in
  // if needed) before its output is allocated, so no reclaim for the output
  // can take them; the kernels launched (each input checked against the
  // seed it was written with, the output filled, `busy` seconds of
  // arithmetic, `update` -- one of the inputs -- overwritten in place with
  // `update_seed`, as an optimizer's apply op does); then everything
  // unpinned right after the launch. *out is null when no output is asked
  // (out_bytes 0) or the op failed.
  struct In {
    Buffer* b;
    uint32_t seed;
  };
  void Op(std::initializer_list<In> inputs, size_t out_bytes,
          uint32_t out_seed, double busy, Buffer** out,
          Buffer* update = nullptr, uint32_t update_seed = 0) {
    *out = nullptr;
    std::vector<std::pair<Buffer*, void*>> pinned;
    for (const In& in : inputs) {
      if (in.b == nullptr) continue;
      void* p = Pin(in.b);
      if (p == nullptr) break;
      pinned.push_back({in.b, p});
    }
    void* out_ptr = nullptr;
    if (pinned.size() == CountInputs(inputs) && out_bytes > 0) {
      *out = Allocate(out_bytes, &out_ptr);
    }
    if (ok()) {
      size_t i = 0;
      for (const In& in : inputs) {
        if (in.b == nullptr) continue;
        kernels_->Check(pinned[i++].second, engine_->BufferSize(in.b),
                        in.seed);
        ++result_->checked;
      }
      if (*out != nullptr) kernels_->Fill(out_ptr, out_bytes, out_seed);
      kernels_->Busy(busy);
      for (const auto& pb : pinned) {
        if (pb.first == update) {
          kernels_->Fill(pb.second, engine_->BufferSize(update), update_seed);
        }
      }
    }
    for (const auto& pb : pinned) Unpin(pb.first);
    if (*out != nullptr) Unpin(*out);
  }

 private:
  static size_t CountInputs(std::initializer_list<In> inputs) {
    size_t n = 0;
    for (const In& in : inputs) n += in.b != nullptr;
    return n;
  }

  Engine* engine_;
  Kernels* kernels_;
  Result* result_;
};

}  // namespace internal

// Runs `shape.steps` steps. Forward: layer i's op reads its weights and
// the previous activation and writes its activation. Backward, from the last
// layer: one op reads the activation, the incoming gradient and the weights,
// writes the outgoing gradient and updates the weights in place; the
// activation and the incoming gradient are freed right after it, as
// TensorFlow frees a tensor once its last consumer was launched. Every
// buffer the workload created is freed before it returns, also on failure.
inline Result Run(Engine* engine, Kernels* kernels, const Shape& shape) {
  using internal::Seed;
  enum : uint32_t { kWeight = 1, kActivation = 2, kGradient = 3 };
  Result r;
  internal::Launcher k(engine, kernels, &r);
  const int n = shape.layers;
  std::vector<Buffer*> weights(n, nullptr), acts(n, nullptr);
  for (int i = 0; i < n && k.ok(); ++i) {
    k.Op({}, shape.weight_bytes, Seed(kWeight, i, 0), 0, &weights[i]);
  }
  for (int step = 0; step < shape.steps && k.ok(); ++step) {
    const double start = kernels->Now();
    if (shape.step_begin) engine->StepBegin();
    for (int i = 0; i < n && k.ok(); ++i) {
      k.Op({{weights[i], Seed(kWeight, i, step)},
            {i > 0 ? acts[i - 1] : nullptr, Seed(kActivation, i - 1, step)}},
           shape.activation_bytes, Seed(kActivation, i, step),
           shape.forward_seconds, &acts[i]);
    }
    Buffer* grad = nullptr;
    for (int i = n - 1; i >= 0 && k.ok(); --i) {
      if (shape.defragment && i == n / 2) {
        size_t moved = 0;
        Status s = engine->Defragment(&moved);
        if (!s.ok()) r.status = s;
      }
      Buffer* out = nullptr;
      k.Op({{acts[i], Seed(kActivation, i, step)},
            {grad, Seed(kGradient, i + 1, step)},
            {weights[i], Seed(kWeight, i, step)}},
           shape.activation_bytes, Seed(kGradient, i, step),
           shape.backward_seconds, &out, weights[i],
           Seed(kWeight, i, step + 1));
      k.Free(acts[i]);
      acts[i] = nullptr;
      k.Free(grad);
      grad = out;
    }
    k.Free(grad);
    kernels->Synchronize();
    r.step_seconds.push_back(kernels->Now() - start);
    r.step_stats.push_back(engine->GetStats());
  }
  kernels->Synchronize();
  r.errors = kernels->Errors();
  r.stats = engine->GetStats();
  for (Buffer* b : acts) k.Free(b);
  for (Buffer* b : weights) k.Free(b);
  return r;
}

}  // namespace workload
}  // namespace tflms

#endif  // TFLMS_CORE_TESTS_TRAINING_WORKLOAD_H_
