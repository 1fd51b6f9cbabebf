// The kernel table: every computation the engines and the clip run on device memory, one
// table per device type (kernels_for). Each entry enqueues its work on the given stream
// (a CPU stream's queue, or a CUDA stream) and returns at once; nothing here blocks the
// host or reads device memory on the host. Scalars that steer a step (the loss scale, the
// skip verdict, the step count, the clip partials and coefficient) live in device memory
// (StepState, ClipState) and are read by the kernels.
//
// Contract shared by the CPU (kernels/cpu/kernel_table.cc) and CUDA
// (kernels/cuda/kernel_table.cu) tables, checked by tests/core/kernels/kernel_table_test.cc
// on every available device against the CPU table:
//  - bitwise equal to the CPU table: cast, accumulate, fill, scale, sum_of_squares_fixed,
//    unscale (its data and found-inf; its fixed partials), update_step_state (but for its
//    AdamW constants), sgd;
//  - within a stated tolerance: sum_of_squares and unscale's float partials (the CPU
//    accumulates fp32 chunks of kSquaresChunk elements and adds them in fp64; CUDA adds
//    per-thread fp32 sums of at most kSquaresChunk elements in a fixed tree), finish_clip's
//    fp32 outputs from those, adamw (its bias corrections use the device's pow).
//  - no fused multiply-adds in any of them.
#pragma once

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "core/common/dtype.h"
#include "core/common/status.h"
#include "core/device/device.h"
#include "core/device/device_ptr.h"
#include "core/device/stream.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"

namespace hps {

// fp32 sums of squares restart every this many elements (then add in fp64).
inline constexpr size_t kSquaresChunk = 4096;

// The optimizer step's scalars, in device memory. After set-up only kernels touch them.
struct StepState {
  float loss_scale = 1.0f;
  int32_t found_inf = 0;  // set by unscale (any non-finite value); max-reduced over ranks
  int32_t skip = 0;       // this step's verdict, set by update_step_state
  int32_t good_steps = 0;
  int64_t applied_steps = 0;  // steps that updated the parameters (AdamW's t, SGD's first step)
  int64_t skipped_steps = 0;
  // This step's AdamW constants, from applied_steps (update_step_state with an AdamW rule).
  float adamw_step_size = 0;   // lr / (1 - beta1^t)
  float adamw_bias2_sqrt = 0;  // sqrt(1 - beta2^t)
};

// What update_step_state does with the verdict.
struct StepRule {
  bool dynamic_loss_scaling = false;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
  bool adamw = false;  // compute the AdamW constants of the step
  AdamWHyper adamw_hyper;
};

// The clip's scalars, in device memory: the partial sums of squares (D: is_distributed
// gradients, N: the others) and what finish_clip makes of them.
struct ClipState {
  double partials[2] = {0, 0};  // float mode
  FixedSquares fixed[2];        // deterministic mode
  double coefficient_fp64 = 1.0;
  float coefficient = 1.0f;
  float norm = 0.0f;
};

// The rules the two tables' update_step_state and finish_clip apply, written once for the
// host (the CPU table) and the device (the CUDA table's one-thread kernels).

// The step's verdict from found_inf: a skipped step backs the loss scale off; an applied
// one counts, grows the scale after growth_interval good steps in a row (dynamic loss
// scaling; as torch's GradScaler, not beyond the largest float: an infinite scale would
// skip every step after it, since inf × backoff stays inf) and, for AdamW, sets the step's
// constants.
HPS_HOST_DEVICE void advance_step_state(StepState& s, const StepRule& rule) {
  if (s.found_inf != 0) {
    ++s.skipped_steps;
    s.good_steps = 0;
    s.loss_scale *= rule.backoff_factor;
    s.found_inf = 0;
    s.skip = 1;
    return;
  }
  s.skip = 0;
  ++s.applied_steps;
  if (rule.dynamic_loss_scaling && ++s.good_steps >= rule.growth_interval) {
    const float grown = s.loss_scale * rule.growth_factor;
    if (grown <= FLT_MAX) s.loss_scale = grown;
    s.good_steps = 0;
  }
  if (rule.adamw) {
    const AdamWConstants c = adamw_constants(rule.adamw_hyper, s.applied_steps);
    s.adamw_step_size = c.step_size;
    s.adamw_bias2_sqrt = c.bias2_sqrt;
  }
}

// The global norm from the partial sums of squares (exact digits in deterministic mode) and
// the clip coefficient max_norm / (max(norm, max_norm) + 1e-6) (DESIGN.md: below max_norm
// it is 1 - 1e-6 / max_norm, where torch's clip_grad_norm_ clamps at 1): NaN stays NaN
// (torch without error_if_nonfinite), Inf gives 0.
HPS_HOST_DEVICE void finish_clip_state(ClipState& c, bool deterministic, double max_norm) {
  const double squares =
      deterministic ? fixed_value(fixed_slots(c.fixed[0])) + fixed_value(fixed_slots(c.fixed[1]))
                    : c.partials[0] + c.partials[1];
  const double norm = sqrt(squares);
  const double denominator = (norm < max_norm ? max_norm : norm) + 1e-6;
  c.coefficient_fp64 = max_norm / denominator;
  c.coefficient = static_cast<float>(c.coefficient_fp64);
  c.norm = static_cast<float>(norm);
}

// One unscale pass over a reduced gradient shard (see Kernels::unscale).
struct UnscaleArgs {
  DType src_dtype = DType::kFloat32;  // fp32 (src may equal dst), fp16 or bf16
  DevicePtr<const void> src;
  DevicePtr<float> dst;
  size_t count = 0;
  float mean_scale = 1.0f;     // 1 / (ranks × micro-batches)
  DevicePtr<StepState> state;  // loss_scale is read; found_inf is set when check_finite
  bool check_finite = false;   // dynamic loss scaling: look for Inf / NaN
  DevicePtr<ClipState> clip;   // null: no partial sums
  int partial = -1;            // kClipPartialD, kClipPartialN, or -1: not counted
  bool deterministic = false;  // add to clip->fixed[partial] instead of partials[partial]
};

// One optimizer update of a flat fp32 shard (master weights). Skipped entirely when
// state->skip is set. The gradient is multiplied by *clip_coefficient when it is given.
struct SgdArgs {
  DevicePtr<float> param;
  DevicePtr<const float> grad;
  DevicePtr<float> momentum;  // null when h.momentum == 0
  size_t count = 0;
  SgdHyper hyper;
  DevicePtr<const StepState> state;  // skip; applied_steps == 1 is the first step
  DevicePtr<const float> clip_coefficient;
};
struct AdamWArgs {
  DevicePtr<float> param;
  DevicePtr<const float> grad;
  DevicePtr<float> exp_avg;
  DevicePtr<float> exp_avg_sq;
  size_t count = 0;
  AdamWHyper hyper;
  DevicePtr<const StepState> state;  // skip and the step's AdamW constants
  DevicePtr<const float> clip_coefficient;
};

class Kernels {
 public:
  virtual ~Kernels() = default;
  virtual DeviceType device_type() const = 0;

  // out[i] = in[i] converted (float dtypes; round to nearest even; NaN stays NaN).
  virtual Status cast(Stream& stream, DType from, DevicePtr<const void> in, DType to,
                      DevicePtr<void> out, size_t count) const = 0;
  // dst[i] += src[i] converted to fp32.
  virtual Status accumulate(Stream& stream, DevicePtr<float> dst, DType src_dtype,
                            DevicePtr<const void> src, size_t count) const = 0;
  // data[i] = value (float or integer dtypes; the value converted to the dtype).
  virtual Status fill(Stream& stream, DType dtype, DevicePtr<void> data, size_t count,
                      double value) const = 0;

  // *partial += Σ x²: fp16 / bf16 / fp32 in fp32 chunks of kSquaresChunk added in fp64; fp64
  // in fp64.
  virtual Status sum_of_squares(Stream& stream, DType dtype, DevicePtr<const void> data,
                                size_t count, DevicePtr<double> partial) const = 0;
  // The same squares added exactly to *out (left normalized).
  virtual Status sum_of_squares_fixed(Stream& stream, DType dtype, DevicePtr<const void> data,
                                      size_t count, DevicePtr<FixedSquares> out) const = 0;
  // squares = D + N (fixed or float); norm = sqrt(squares); coefficient = max_norm /
  // (max(norm, max_norm) + 1e-6), written in fp64 and fp32. NaN stays NaN, Inf gives 0.
  virtual Status finish_clip(Stream& stream, DevicePtr<ClipState> clip, bool deterministic,
                             double max_norm) const = 0;
  // data[i] *= the clip coefficient (fp64 for fp64 data, fp32 otherwise, 16-bit types
  // computed in fp32 and rounded once).
  virtual Status scale(Stream& stream, DType dtype, DevicePtr<void> data, size_t count,
                       DevicePtr<const ClipState> clip) const = 0;

  // dst[i] = src[i] · (mean_scale / state->loss_scale), in fp32 (src converted first); with
  // check_finite, state->found_inf = 1 when any result is not finite (never reset here);
  // with a clip and a partial, that partial gets Σ dst[i]² as sum_of_squares (or
  // sum_of_squares_fixed) would add it.
  virtual Status unscale(Stream& stream, const UnscaleArgs& args) const = 0;
  // Writes `value` into *state (set-up, loading a checkpoint).
  virtual Status write_step_state(Stream& stream, DevicePtr<StepState> state,
                                  const StepState& value) const = 0;
  // The verdict of a step, before its optimizer updates: found_inf → skip = 1, skipped_steps
  // + 1, good_steps = 0, loss_scale × backoff; else skip = 0, applied_steps + 1 and with
  // dynamic loss scaling good_steps + 1, growing the scale by growth_factor every
  // growth_interval good steps. found_inf is reset. With an AdamW rule, the step's AdamW
  // constants from applied_steps.
  virtual Status update_step_state(Stream& stream, DevicePtr<StepState> state,
                                   const StepRule& rule) const = 0;
  virtual Status sgd(Stream& stream, const SgdArgs& args) const = 0;
  virtual Status adamw(Stream& stream, const AdamWArgs& args) const = 0;
};

// The table of `type`; UNAVAILABLE when this build has no kernels for it.
StatusOr<const Kernels*> kernels_for(DeviceType type);

}  // namespace hps
