// The clip family of hpshard-bench, all on one CPU stream, alternated in the same run:
//  - global-norm clipping (HybridClip, one rank, no groups) over a model's gradients beside a
//    plain copy of the same bytes;
//  - the clip as the engines fold it into their step (the sharded optimizer's pipeline on
//    the kernel table): the unscale pass taking the partial sums of squares, the clip's
//    finish and AdamW reading the coefficient, beside the same step without a clip (the
//    unscale pass and AdamW);
//  - each CPU kernel over fp32, bf16 and fp16 data beside a copy of the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/common/dtype.h"
#include "tools/hpshard-bench/report.h"

namespace hps::bench {

// Targets of /work/shared/PERFORMANCE.md for the clip.
inline constexpr double kClipCopyTarget = 0.8;  // clip bandwidth ≥ 0.8× the copy's (CPU)
inline constexpr double kClipFoldTarget = 1.1;  // step + folded clip ≤ 1.1× the step's time

// One model's gradients: `bytes` in total, fp32 throughout or mixed (bf16 weights, fp32
// biases).
struct ClipModel {
  size_t bytes = 0;
  bool mixed = false;
};

struct ClipConfig {
  std::vector<ClipModel> models{
      {size_t{16} << 20, false}, {size_t{64} << 20, false}, {size_t{32} << 20, true}};
  int32_t iters = 0;   // 0: by size (clip_iterations_for)
  int32_t warmup = 2;  // untimed rounds of every contender
  double max_norm = 1.0;
  // fp32 elements × 4 of each kernel's buffers in the kernel table; 0: no kernel table.
  // Four times this machine's 32 MiB L3, so neither a kernel nor the copy runs from cache.
  size_t kernel_bytes = size_t{128} << 20;
  bool progress = true;
};

int32_t clip_iterations_for(const ClipConfig& config, size_t bytes);

struct ClipTensorSpec {
  DType dtype;
  size_t count;
};
// The tensors of `model`: [1024 x 1024] weights and [1024] biases in turn, the last one cut
// so the total is `model.bytes` (rounded down to whole elements).
std::vector<ClipTensorSpec> model_tensors(const ClipModel& model);
std::string model_label(const ClipModel& model);  // "16 MiB fp32", "32 MiB fp32/bf16"

struct ClipRow {
  ClipModel model;
  size_t tensors = 0;
  size_t bytes = 0;  // exact gradient bytes (S)
  size_t fp32_bytes = 0;
  int32_t iters = 0;
  // Medians over iterations, seconds (enqueue on the stream + synchronize).
  double copy_seconds = 0;           // memcpy_async of S bytes, tensor by tensor
  double clip_seconds = 0;           // HybridClip::run(scale = true), float partials
  double deterministic_seconds = 0;  // the same, ClipOptions::deterministic
  // The engines' step over every tensor through the kernel table, as ShardedOptimizer
  // enqueues it: without a clip (per tensor the unscale pass, then AdamW), and with the
  // clip folded (HybridClip::begin, every unscale pass adding its partial, finish, then
  // AdamW reading the coefficient).
  double step_seconds = 0;
  double step_clip_seconds = 0;
  // The same medians by the process's CPU time (time slices other processes took on this
  // shared machine left out).
  double copy_cpu_seconds = 0;
  double clip_cpu_seconds = 0;
  double step_cpu_seconds = 0;
  double step_clip_cpu_seconds = 0;
  std::optional<double> torch_seconds;  // torch.nn.utils.clip_grad_norm_, same tensors
};

// One CPU kernel over `count` elements of `dtype`, beside a copy in the same rounds.
struct KernelRow {
  std::string kernel;  // "sum_of_squares", "scale", "unscale", "cast to fp32", ...
  DType dtype = DType::kFloat32;
  size_t count = 0;
  double bytes = 0;  // bytes the kernel must read and write
  double seconds = 0;
  double copy_seconds = 0;  // memcpy of count × 4 bytes (2 × that moved), same rounds
  double cpu_seconds = 0;   // the same two by the process's CPU time
  double copy_cpu_seconds = 0;
};

struct ClipResult {
  std::vector<ClipRow> rows;
  std::vector<KernelRow> kernels;
};

// Bytes a clip must move: one read for the norm, one read and one write to scale (3S);
// a copy moves 2S.
double clip_bandwidth_gbps(const ClipRow& row, double seconds);
double copy_bandwidth_gbps(const ClipRow& row);
double kernel_bandwidth_gbps(const KernelRow& row);
// The ratios by CPU time instead of wall time.
double clip_cpu_ratio(const ClipRow& row);
double kernel_cpu_ratio(const KernelRow& row);
double kernel_copy_bandwidth_gbps(const KernelRow& row);

// Runs every model, then the kernel table. Exits with status 1 (reason on stderr) on an
// error.
ClipResult run_clip(const ClipConfig& config);

void print_clip(std::FILE* out, const ClipConfig& config, const RunInfo& info,
                const ClipResult& result);
Json clip_to_json(const ClipConfig& config, const RunInfo& info, const ClipResult& result);

}  // namespace hps::bench
