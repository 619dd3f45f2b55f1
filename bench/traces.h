// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// Deterministic allocation traces for the allocator benchmark and the BFC
// parity test. A trace is a flat list of allocate/free events over small
// integer ids; every id is allocated once and freed at most once, and a
// trace always ends with nothing live, so one allocator instance can replay
// it again and again (the benchmark times the repeated, warmed-up replays).
//
// Two shapes:
//   * training: the pattern of a ResNet-50-like training step at a given
//     batch size (float32): the forward pass keeps its activations alive
//     until the matching backward op, convolutions take short-lived
//     workspaces, every op makes a few tiny tensors (shapes, scalars), the
//     backward pass produces input and weight gradients, and the optimizer
//     frees the weight gradients at the end of the step. Weights live across
//     all steps. Sizes span 256 B .. ~100 MB. Steps repeat with the same
//     sizes (a static graph), tiny tensors vary per step.
//   * random: the probe's trace: sizes log-uniform in [1 B, max_bytes], a
//     live set that hovers around `live_target` entries, frees of uniformly
//     chosen live ids (so lifetimes mix stack, FIFO and random order).
#ifndef TFLMS_BENCH_TRACES_H_
#define TFLMS_BENCH_TRACES_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tflms_bench {

struct TraceOp {
  uint32_t id;
  uint64_t bytes;  // > 0: allocate `bytes` for id; 0: free id
};

struct Trace {
  std::string name;
  std::vector<TraceOp> ops;
  uint32_t num_ids = 0;
  size_t num_allocs = 0;
  uint64_t max_live_bytes = 0;  // peak of sum of requested bytes (no rounding)
};

// SplitMix64: tiny, fast, and identical on every platform (std::
// distributions are not specified bit-for-bit across standard libraries).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  uint64_t Below(uint64_t n) { return Next() % n; }
  // Log-uniform integer in [lo, hi].
  uint64_t LogUniform(uint64_t lo, uint64_t hi) {
    double l = std::log(static_cast<double>(lo));
    double h = std::log(static_cast<double>(hi) + 1.0);
    uint64_t v = static_cast<uint64_t>(std::exp(l + (h - l) * Uniform()));
    return v < lo ? lo : (v > hi ? hi : v);
  }

 private:
  uint64_t state_;
};

class TraceBuilder {
 public:
  explicit TraceBuilder(std::string name) { trace_.name = std::move(name); }
  uint32_t Alloc(uint64_t bytes) {
    uint32_t id = trace_.num_ids++;
    trace_.ops.push_back({id, bytes});
    ++trace_.num_allocs;
    live_ += bytes;
    sizes_.push_back(bytes);
    if (live_ > trace_.max_live_bytes) trace_.max_live_bytes = live_;
    return id;
  }
  void Free(uint32_t id) {
    trace_.ops.push_back({id, 0});
    live_ -= sizes_[id];
  }
  Trace Finish() { return std::move(trace_); }

 private:
  Trace trace_;
  uint64_t live_ = 0;
  std::vector<uint64_t> sizes_;
};

inline Trace RandomTrace(uint64_t seed, size_t num_allocs, size_t live_target,
                         uint64_t max_bytes) {
  Rng rng(seed);
  TraceBuilder tb("random");
  std::vector<uint32_t> live;
  live.reserve(live_target * 2);
  size_t allocated = 0;
  while (allocated < num_allocs) {
    // Bias towards allocating while below the target, freeing above it.
    double p_alloc = live.size() < live_target ? 0.6 : 0.4;
    if (live.empty() || rng.Uniform() < p_alloc) {
      live.push_back(tb.Alloc(rng.LogUniform(1, max_bytes)));
      ++allocated;
    } else {
      size_t i = rng.Below(live.size());
      tb.Free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
  }
  while (!live.empty()) {
    size_t i = rng.Below(live.size());
    tb.Free(live[i]);
    live[i] = live.back();
    live.pop_back();
  }
  return tb.Finish();
}

// Allocates `sizes` in order, then frees them in reverse: for directed
// cases (region growth against a device that holds less than the limit).
inline Trace SequenceTrace(std::string name, const std::vector<uint64_t>& sizes) {
  TraceBuilder tb(std::move(name));
  std::vector<uint32_t> ids;
  for (uint64_t s : sizes) ids.push_back(tb.Alloc(s));
  for (size_t i = ids.size(); i-- > 0;) tb.Free(ids[i]);
  return tb.Finish();
}

// One op of the modelled network's forward pass.
struct LayerOp {
  uint64_t in_bytes;       // activation consumed
  uint64_t out_bytes;      // activation produced (kept for backward)
  uint64_t weight_bytes;   // 0: no weights
  uint64_t saved_small;    // bytes of small saved tensors (BN statistics)
  uint64_t workspace;      // 0: none
};

inline std::vector<LayerOp> ResNet50Layers(uint64_t batch, Rng* rng) {
  std::vector<LayerOp> ops;
  const uint64_t f = 4 * batch;  // float32 bytes per element, times batch
  auto workspace = [&]() -> uint64_t {
    // cuDNN-style workspaces: often none, else anything from KBs to ~100 MB.
    if (rng->Uniform() < 0.3) return 0;
    return rng->LogUniform(1 << 10, 100ull << 20);
  };
  auto conv = [&](uint64_t hw_in, uint64_t c_in, uint64_t hw_out,
                  uint64_t c_out, uint64_t k) {
    ops.push_back({f * hw_in * hw_in * c_in, f * hw_out * hw_out * c_out,
                   4 * k * k * c_in * c_out, 0, workspace()});
  };
  auto bn = [&](uint64_t hw, uint64_t c) {
    ops.push_back({f * hw * hw * c, f * hw * hw * c, 4 * 2 * c, 4 * 2 * c, 0});
  };
  auto eltwise = [&](uint64_t hw, uint64_t c) {  // relu, add
    ops.push_back({f * hw * hw * c, f * hw * hw * c, 0, 0, 0});
  };
  ops.push_back({f * 224 * 224 * 3, f * 224 * 224 * 3, 0, 0, 0});  // input
  conv(224, 3, 112, 64, 7);
  bn(112, 64);
  eltwise(112, 64);
  ops.push_back({f * 112 * 112 * 64, f * 56 * 56 * 64, 0, 0, 0});  // maxpool
  struct Stage {
    uint64_t hw, mid, out, blocks;
  };
  const Stage stages[] = {
      {56, 64, 256, 3}, {28, 128, 512, 4}, {14, 256, 1024, 6}, {7, 512, 2048, 3}};
  uint64_t c_in = 64, hw_in = 56;
  for (const Stage& s : stages) {
    for (uint64_t b = 0; b < s.blocks; ++b) {
      conv(hw_in, c_in, s.hw, s.mid, 1);
      bn(s.hw, s.mid);
      eltwise(s.hw, s.mid);
      conv(s.hw, s.mid, s.hw, s.mid, 3);
      bn(s.hw, s.mid);
      eltwise(s.hw, s.mid);
      conv(s.hw, s.mid, s.hw, s.out, 1);
      bn(s.hw, s.out);
      if (b == 0) {  // projection shortcut
        conv(hw_in, c_in, s.hw, s.out, 1);
        bn(s.hw, s.out);
      }
      eltwise(s.hw, s.out);  // add
      eltwise(s.hw, s.out);  // relu
      c_in = s.out;
      hw_in = s.hw;
    }
  }
  ops.push_back({f * 7 * 7 * 2048, f * 2048, 0, 0, 0});  // global pool
  ops.push_back({f * 2048, f * 1000, 4 * 2048 * 1000 + 4 * 1000, 0, 0});  // fc
  ops.push_back({f * 1000, 4 * batch, 0, 0, 0});  // loss per example
  return ops;
}

inline Trace TrainingTrace(uint64_t seed, uint64_t batch, int steps) {
  Rng rng(seed);
  const std::vector<LayerOp> layers = ResNet50Layers(batch, &rng);
  TraceBuilder tb("training");
  auto tiny = [&]() {  // shape vectors, scalars, step counters
    return rng.LogUniform(4, 4096);
  };
  // Variables and optimizer slots (momentum) live for the whole trace.
  std::vector<uint32_t> persistent;
  for (const LayerOp& l : layers) {
    if (l.weight_bytes == 0) continue;
    persistent.push_back(tb.Alloc(l.weight_bytes));
    persistent.push_back(tb.Alloc(l.weight_bytes));
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<uint32_t> act(layers.size()), saved(layers.size(), 0);
    std::vector<bool> has_saved(layers.size(), false);
    uint32_t input = tb.Alloc(layers[0].in_bytes);
    for (size_t i = 0; i < layers.size(); ++i) {
      const LayerOp& l = layers[i];
      uint32_t t = tb.Alloc(tiny());
      act[i] = tb.Alloc(l.out_bytes);
      if (l.saved_small) {
        saved[i] = tb.Alloc(l.saved_small);
        has_saved[i] = true;
      }
      if (l.workspace) tb.Free(tb.Alloc(l.workspace));
      tb.Free(t);
    }
    // Loss reduction: a scalar and its gradient seed.
    uint32_t loss = tb.Alloc(4);
    uint32_t grad = tb.Alloc(layers.back().out_bytes);
    std::vector<uint32_t> weight_grads;
    for (size_t i = layers.size(); i-- > 0;) {
      const LayerOp& l = layers[i];
      uint32_t t = tb.Alloc(tiny());
      uint32_t grad_in = tb.Alloc(l.in_bytes);
      if (l.weight_bytes) weight_grads.push_back(tb.Alloc(l.weight_bytes));
      if (l.workspace) tb.Free(tb.Alloc(l.workspace));
      tb.Free(grad);
      tb.Free(act[i]);
      if (has_saved[i]) tb.Free(saved[i]);
      tb.Free(t);
      grad = grad_in;
    }
    tb.Free(grad);
    tb.Free(input);
    tb.Free(loss);
    // Optimizer: in-place updates, a small temporary per variable, then the
    // gradients die in the order they were produced.
    for (uint32_t g : weight_grads) {
      tb.Free(tb.Alloc(tiny()));
      tb.Free(g);
    }
  }
  for (uint32_t p : persistent) tb.Free(p);
  return tb.Finish();
}

}  // namespace tflms_bench

#endif  // TFLMS_BENCH_TRACES_H_
