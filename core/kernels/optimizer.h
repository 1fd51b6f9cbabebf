// Optimizer kernels on flat fp32 shards (master weights). Each takes an optional
// `clip_coefficient`: device memory holding the global-norm clip coefficient, read by the
// kernel itself, so clipping folds into the update as one extra read instead of a pass.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/common/config.h"
#include "core/common/host_device.h"
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
// sqrt(1 - beta2^t), the powers in fp64 (the device's pow on a GPU), rounded to fp32.
struct AdamWConstants {
  float step_size = 0;
  float bias2_sqrt = 0;
};
HPS_HOST_DEVICE AdamWConstants adamw_constants(const AdamWHyper& h, int64_t step) {
  const auto t = static_cast<double>(step);
  const auto bias1 = static_cast<float>(1.0 - pow(static_cast<double>(h.beta1), t));
  const auto bias2 = static_cast<float>(1.0 - pow(static_cast<double>(h.beta2), t));
  return {h.learning_rate / bias1, sqrtf(bias2)};
}

// The updates of one element, written once for the CPU kernels (over arrays) and the CUDA
// ones (over vector groups): each product rounds on its own (the CPU kernels compile with
// -ffp-contract=off, the CUDA ones with --fmad=false), so both give the same bits. The
// gradient is multiplied by `g_scale` (the clip coefficient times the kernel's grad_scale)
// first.

// SGD's scalars of one update (torch.optim.SGD; weight decay is L2, added to the gradient).
struct SgdTerms {
  float g_scale, lr, wd, mu;
  bool nesterov;
};
HPS_HOST_DEVICE SgdTerms sgd_terms(const SgdHyper& h, float g_scale) {
  return {g_scale, h.learning_rate, h.weight_decay, h.momentum, h.nesterov};
}
// The scaled gradient with its L2 decay; none without decay, as torch adds none (0 · an
// infinite parameter would make it NaN).
HPS_HOST_DEVICE float sgd_decayed(float param, float grad, const SgdTerms& t) {
  const float g = grad * t.g_scale;
  return t.wd == 0.0f ? g : g + t.wd * param;
}
// Without momentum (t.mu == 0): the new parameter.
HPS_HOST_DEVICE float sgd_plain(float param, float grad, const SgdTerms& t) {
  const float g = sgd_decayed(param, grad, t);
  return param - t.lr * g;
}
// With momentum: the buffer starts as the gradient itself on the first step (torch).
HPS_HOST_DEVICE void sgd_momentum(float& param, float& buffer, float grad, const SgdTerms& t,
                                  bool first_step) {
  const float g = sgd_decayed(param, grad, t);
  const float b = first_step ? g : t.mu * buffer + g;
  buffer = b;
  param = param - t.lr * (t.nesterov ? g + t.mu * b : b);
}

// AdamW's scalars of one update (torch.optim.AdamW: decoupled weight decay).
struct AdamWTerms {
  float g_scale, b1, one_minus_b1, b2, one_minus_b2, eps, decay, step_size, bias2_sqrt;
};
HPS_HOST_DEVICE AdamWTerms adamw_terms(const AdamWHyper& h, AdamWConstants c, float g_scale) {
  return {g_scale,
          h.beta1,
          1.0f - h.beta1,
          h.beta2,
          1.0f - h.beta2,
          h.epsilon,
          1.0f - h.learning_rate * h.weight_decay,
          c.step_size,
          c.bias2_sqrt};
}
HPS_HOST_DEVICE void adamw_element(float& param, float& exp_avg, float& exp_avg_sq, float grad,
                                   const AdamWTerms& t) {
  const float g = grad * t.g_scale;
  const float m = t.b1 * exp_avg + t.one_minus_b1 * g;
  const float v = t.b2 * exp_avg_sq + t.one_minus_b2 * g * g;
  exp_avg = m;
  exp_avg_sq = v;
  param = param * t.decay - t.step_size * m / (sqrtf(v) / t.bias2_sqrt + t.eps);
}

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
