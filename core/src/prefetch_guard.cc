// Copyright 2026 The tflms Authors. Licensed under the Apache License 2.0.
//
// The prefetch guard: prefetch is kept only where it makes steps faster.
//
// Prefetch wins at every planner point where it fits, but not everywhere: on
// an H200 (docs/results.md, "Measured on a GPU") the training workload at
// six times its device stepped 9% slower with it than paging on demand, and
// in the TensorFlow-on-CPU harness at a quarter of the peak the Keras fit
// took 4-6% longer. Which one wins depends on the model, the batch and the
// machine, and only timing the steps says it. So, once kSettleSteps steps
// are learned, the guard runs kTrialSteps steps with prefetch and kTrialSteps
// without, times each (the first of each run is a transition: buffers
// prefetched, or still resident, from the other mode), and keeps the
// faster. After
// kHoldSteps steps in the kept mode it tries the other one again for
// kTrialSteps steps against the kept mode's last kMeasuredSteps, since the
// data, the learning rate or other processes can change the answer.
//
// A step is what the prefetcher tells apart: StepBegin, or inside
// TensorFlow a new step id that pinned enough in a row (step_finding.cc). Steps
// are timed on Device::NowSeconds at their boundaries: the host's clock,
// the modelled host clock in the planner's replays. With the host running
// ahead of the GPU a boundary is when the host got there, which over a few
// steps keeps the GPU's pace: the host waits on the launch queue or on the
// step's results.
//
// Off by default (EngineOptions::prefetch_guard), because a switch can cost
// more than time: over 12 planner steps UNet3D at 272^3 on the DGX-1, which
// runs with prefetch in every step and on demand in every step, ran out of
// memory in the second step the guard paused, a concatenation's 5.15 GB
// output meeting its inputs where prefetch had left them (docs/how-it-works.md).
//
// Pausing changes no state a step relies on: the engine keeps learning the
// order and planning, and acts as without prefetch (FollowingLearnedOrder
// says no: no look-ahead, no planned copies, least-recently-used victims).
// Prefetches already made stay until their pin. What a pause does change is
// the layout and the shortened prefetch distances the next prefetch steps
// start from: in the training workload at six times its device (lookahead
// 256) prefetch steps in 0.495 s right after a pause against 0.429 s once
// settled, and a trial of kTrialSteps times the former (docs/tuning.md).
//
// Invariants: everything here runs under mu_, at step boundaries only, and
// with prefetch_guard off nothing changes (paused stays false). Data is never
// at stake, only time and, at the memory edge, fitting.
#include "engine_impl.h"

namespace tflms {
namespace {

// Steps the prefetcher learns before the first trial: its first learned
// steps still change its plan from step to step, and one such step can be
// far slower than the rest (InceptionV3 at batch 356 on the DGX-1: 4.37 s
// for its third step, 3.31-3.36 s for the others, a fragment reclaim paging
// in 8 GB more), which a trial that timed it would blame on prefetch.
constexpr int kSettleSteps = 4;
constexpr int kTrialSteps = 3;     // steps run in a mode to time it
constexpr int kMeasuredSteps = 2;  // the last ones, which are timed
constexpr int kHoldSteps = 50;     // steps in the kept mode between trials
// The other mode must be this much faster to be kept: noise between two
// steps of the same mode does not flip the choice back and forth.
constexpr double kMargin = 0.02;

}  // namespace

void Engine::Impl::GuardStepEndedLocked(double at) {
  using Phase = PrefetchState::Guard::Phase;
  PrefetchState::Guard& g = prefetch_.guard;
  if (!options_.prefetch_enabled || !options_.prefetch_guard) return;
  const double took = g.has_start ? at - g.step_start : 0;
  g.has_start = true;
  g.step_start = at;
  if (g.paused) ++counters_.num_prefetch_paused_steps;
  // Counts the step that ended in the phase; true once the phase's steps
  // are done. Its last kMeasuredSteps are summed into `measured`.
  auto phase_done = [&](int steps) {
    ++g.steps;
    if (g.steps > steps - kMeasuredSteps) g.measured += took;
    return g.steps >= steps;
  };
  auto enter = [&](Phase phase, bool paused) {
    g.phase = phase;
    g.paused = paused;
    g.steps = 0;
    g.measured = 0;
  };
  switch (g.phase) {
    case Phase::kWaiting:
      // Prefetch runs from the first learned step; it is timed once its
      // plan has settled. Counted here, not read from num_prefetch_steps,
      // which ClearStats resets.
      if (phase_done(kSettleSteps)) enter(Phase::kTrialOn, false);
      break;
    case Phase::kTrialOn:
      if (phase_done(kTrialSteps)) {
        g.reference = g.measured;
        enter(Phase::kTrialOff, true);
      }
      break;
    case Phase::kTrialOff:
      if (phase_done(kTrialSteps)) {
        enter(Phase::kHolding, g.measured < g.reference * (1 - kMargin));
      }
      break;
    case Phase::kHolding:
      if (phase_done(kHoldSteps)) {
        g.reference = g.measured;
        enter(Phase::kProbing, !g.paused);
      }
      break;
    case Phase::kProbing:
      if (phase_done(kTrialSteps)) {
        const bool other_wins = g.measured < g.reference * (1 - kMargin);
        enter(Phase::kHolding, other_wins ? g.paused : !g.paused);
      }
      break;
  }
}

}  // namespace tflms
