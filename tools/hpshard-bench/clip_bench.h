// The clip family of hpshard-bench: global-norm clipping (HybridClip, one rank, no groups)
// over a model's gradients, beside a plain copy of the same bytes, and clipping folded into
// AdamW beside AdamW alone — all on one CPU stream, alternated in the same run.
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
inline constexpr double kClipFoldTarget = 1.1;  // AdamW + folded clip ≤ 1.1× AdamW's time

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
  // fp32 models only: AdamW over every tensor, without and with the clip folded in
  // (HybridClip::run(scale = false) + cpu::adamw reading coefficient()).
  std::optional<double> adamw_seconds;
  std::optional<double> adamw_clip_seconds;
  std::optional<double> torch_seconds;  // torch.nn.utils.clip_grad_norm_, same tensors
};

// Bytes a clip must move: one read for the norm, one read and one write to scale (3S);
// a copy moves 2S.
double clip_bandwidth_gbps(const ClipRow& row, double seconds);
double copy_bandwidth_gbps(const ClipRow& row);

// Runs every model. Exits with status 1 (reason on stderr) on an error.
std::vector<ClipRow> run_clip(const ClipConfig& config);

void print_clip(std::FILE* out, const ClipConfig& config, const RunInfo& info,
                const std::vector<ClipRow>& rows);
std::string clip_to_json(const ClipConfig& config, const RunInfo& info,
                         const std::vector<ClipRow>& rows);

}  // namespace hps::bench
