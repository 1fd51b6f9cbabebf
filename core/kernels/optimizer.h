// Optimizer kernels on flat fp32 shards (master weights). Each takes an optional
// `clip_coefficient`: device memory holding the global-norm clip coefficient, read by the
// kernel itself, so clipping folds into the update as one extra read instead of a pass.
#pragma once

#include <cstddef>

#include "core/common/config.h"
#include "core/common/status.h"

namespace hps {

struct SgdHyper {
  float learning_rate = 0.01f;
  float momentum = 0.0f;      // 0: plain SGD (the momentum buffer is not touched)
  float weight_decay = 0.0f;  // L2, added to the gradient (torch.optim.SGD)
  bool nesterov = false;
};

struct AdamWHyper {
  float learning_rate = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.01f;  // decoupled (torch.optim.AdamW)
};

// AdamW's per-step constants from its step count t (from 1): lr / (1 - beta1^t) and
// sqrt(1 - beta2^t), computed in fp64 and rounded to fp32.
struct AdamWConstants {
  float step_size = 0;
  float bias2_sqrt = 0;
};
AdamWConstants adamw_constants(const AdamWHyper& h, int64_t step);

namespace cpu {

// g' = g · coef (coef = *clip_coefficient, or 1 when null) · grad_scale
void sgd(float* param, const float* grad, float* momentum_buffer, size_t count, const SgdHyper& h,
         const float* clip_coefficient, float grad_scale, bool first_step);

// `step` counts from 1 (bias correction).
void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
           const AdamWHyper& h, long step, const float* clip_coefficient, float grad_scale);
// The same update with the step's constants given.
void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
           const AdamWHyper& h, AdamWConstants constants, const float* clip_coefficient,
           float grad_scale);

}  // namespace cpu
}  // namespace hps
