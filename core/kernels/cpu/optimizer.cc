#include "core/kernels/optimizer.h"

#include <cmath>

namespace hps {

AdamWConstants adamw_constants(const AdamWHyper& h, int64_t step) {
  const double s = static_cast<double>(step);
  const auto bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta1), s));
  const auto bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta2), s));
  return {h.learning_rate / bias1, std::sqrt(bias2)};
}

namespace cpu {

// AVX2 clones where the processor has it, chosen once at load time (as the norm kernels).
// No FMA: every product rounds on its own, as in the CUDA kernels (--fmad=false). The file
// is compiled with -fno-math-errno, so sqrt vectorises (it never sets errno here: v >= 0).
#define HPS_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))

HPS_KERNEL_CLONES void sgd(float* param, const float* grad, float* momentum_buffer, size_t count,
                           const SgdHyper& h, const float* clip_coefficient, float grad_scale,
                           bool first_step) {
  const float g_scale = (clip_coefficient ? *clip_coefficient : 1.0f) * grad_scale;
  const float lr = h.learning_rate, wd = h.weight_decay, mu = h.momentum;
  if (mu == 0.0f) {
#pragma omp simd
    for (size_t i = 0; i < count; ++i) {
      const float g = grad[i] * g_scale + wd * param[i];
      param[i] -= lr * g;
    }
    return;
  }
#pragma omp simd
  for (size_t i = 0; i < count; ++i) {
    const float g = grad[i] * g_scale + wd * param[i];
    // torch: the first step initialises the buffer with the gradient itself.
    const float b = first_step ? g : mu * momentum_buffer[i] + g;
    momentum_buffer[i] = b;
    param[i] -= lr * (h.nesterov ? g + mu * b : b);
  }
}

void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
           const AdamWHyper& h, long step, const float* clip_coefficient, float grad_scale) {
  adamw(param, grad, exp_avg, exp_avg_sq, count, h, adamw_constants(h, step), clip_coefficient,
        grad_scale);
}

HPS_KERNEL_CLONES void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                             size_t count, const AdamWHyper& h, AdamWConstants constants,
                             const float* clip_coefficient, float grad_scale) {
  const float g_scale = (clip_coefficient ? *clip_coefficient : 1.0f) * grad_scale;
  const float step_size = constants.step_size;
  const float bias2_sqrt = constants.bias2_sqrt;
  const float decay = 1.0f - h.learning_rate * h.weight_decay;
  const float b1 = h.beta1, b2 = h.beta2, eps = h.epsilon;
#pragma omp simd
  for (size_t i = 0; i < count; ++i) {
    const float g = grad[i] * g_scale;
    const float m = b1 * exp_avg[i] + (1.0f - b1) * g;
    const float v = b2 * exp_avg_sq[i] + (1.0f - b2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = param[i] * decay - step_size * m / (std::sqrt(v) / bias2_sqrt + eps);
  }
}

}  // namespace cpu
}  // namespace hps
