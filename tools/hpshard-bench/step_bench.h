// The step family of hpshard-bench: one training step of an MLP (forward and backward
// written here, the same code for every contender) with ranks as threads, timed with
// hpshard's Stage2Engine and Stage3Engine beside an unsharded data-parallel step on the
// same backend (full gradients all-reduced by the Communicator, the optimizer on the full
// parameters), alternated in the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/sharding/sharded_engine.h"
#include "tools/hpshard-bench/report.h"

namespace hps::bench {

// Targets of /work/shared/PERFORMANCE.md for the step.
inline constexpr double kStepUnshardedTarget = 1.15;  // stage 2, 3 ≤ 1.15× the unsharded step
inline constexpr double kStepTorchTarget = 3.0;       // ≥ 3× faster than torch

struct StepConfig {
  std::vector<int32_t> ranks{2, 4};
  int32_t width = 1024;
  int32_t depth = 8;
  int32_t batch = 8;   // samples per rank per step
  int32_t steps = 3;   // steps per timed repetition
  int32_t reps = 5;    // timed repetitions per contender
  int32_t warmup = 1;  // untimed repetitions per contender
  bool adamw = true;   // false: SGD with momentum 0.9
  double clip = 1.0;   // global-norm max_norm; 0: no clipping
  int32_t prefetch_window = EngineOptions{}.prefetch_window;  // stage 3
  // Also time stage 2 and stage 3 with the timeline recording (core/trace, what HPS_TRACE
  // turns on), alternated with the untraced ones: its cost.
  bool trace_overhead = false;
  bool progress = true;
  // Set: the runtime's own step on this device at world size 1 (device_step.h) instead.
  std::string device;
  // --scale: the sweep of widths × kScaleWidths and kScaleRanks instead of `ranks`.
  bool scale = false;
};

// The scaling sweep: widths ×1, ×2, ×4 of the configured one (≈ ×1, ×4, ×16 parameters) at
// 1, 2 and 4 ranks.
inline constexpr int32_t kScaleWidths[] = {1, 2, 4};
inline constexpr int32_t kScaleRanks[] = {1, 2, 4};

struct StepWorld {
  int32_t ranks = 0;
  int32_t width = 0;
  size_t parameters = 0;  // elements
  // Set when the cell did not run (the scaling sweep skips what would not fit in memory).
  std::string skipped;
  std::string transport;  // how the communicators moved collective data: "shm" or "tcp"
  // Seconds per step: the median over repetitions of the slowest rank's time for `steps`
  // steps (the last one drained), divided by `steps`.
  double stage2_seconds = 0;
  double stage3_seconds = 0;
  double unsharded_seconds = 0;
  double compute_seconds = 0;  // forward + backward alone, no communication or optimizer
  std::optional<double> torch_seconds;
  std::optional<double> torch_compute_seconds;
  uint64_t stage2_resident_bytes = 0;  // per rank: params, grads, shard grads, state
  // Per rank: the most bytes stage 3 held at once over the run (shards, state, the live
  // gathered units and gradient buffers, reductions in flight): peak_resident_bytes().
  uint64_t stage3_resident_bytes = 0;
  uint64_t unsharded_resident_bytes = 0;  // per rank: params, grads, optimizer state
  uint64_t stage2_host_syncs_max = 0;     // most host syncs seen in one steady step, any rank
  uint64_t stage3_host_syncs_max = 0;
  uint64_t unsharded_host_syncs_max = 0;  // the reference waits on its all-reduces (counted)
  // The reference's step split, per step, mean over ranks: blocked on its all-reduces, and
  // its clip + optimizer (the rest of its time is forward and backward).
  double unsharded_wait_seconds = 0;
  double unsharded_optimizer_seconds = 0;
  // Dependency waits (a forward or backward that had to wait for its layer's all-gather),
  // over all timed steps and ranks, counted apart for each engine.
  uint64_t dependency_waits = 0;  // stage 2
  double dependency_wait_seconds = 0;
  uint64_t stage3_dependency_waits = 0;
  double stage3_dependency_wait_seconds = 0;
  int64_t timed_steps = 0;           // per rank, per contender (reps × steps)
  double max_param_diff = 0;         // stage 2 vs unsharded parameters after the same training
  double stage3_max_param_diff = 0;  // stage 3 (gather_all()) vs unsharded
  // With trace_overhead: the same steps while the timeline records, and the events per step
  // and rank it recorded.
  std::optional<double> stage2_traced_seconds;
  std::optional<double> stage3_traced_seconds;
  double trace_events_per_step = 0;
  double trace_seconds_per_event = 0;  // recording one stream task's span, alone
};

StepWorld run_step_world(const StepConfig& config, int32_t ranks);
// Bytes the bench holds for `ranks` ranks of `config` (every contender's buffers), roughly.
uint64_t step_memory_estimate(const StepConfig& config, int32_t ranks);

void print_step(std::FILE* out, const StepConfig& config, const RunInfo& info,
                const std::vector<StepWorld>& worlds);
Json step_to_json(const StepConfig& config, const RunInfo& info,
                  const std::vector<StepWorld>& worlds);

}  // namespace hps::bench
