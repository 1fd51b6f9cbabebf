#include "core/kernels/optimizer.h"

#include <cmath>

#include "core/kernels/cpu/kernel_set.h"

namespace hps {

namespace cpu {

// The vectorised kernels are those of the instruction-set variant in use (kernel_set.h).
void sgd(float* param, const float* grad, float* momentum_buffer, size_t count, const SgdHyper& h,
         const float* clip_coefficient, float grad_scale, bool first_step) {
  active_cpu_kernels().sgd(param, grad, momentum_buffer, count, h, clip_coefficient, grad_scale,
                           first_step);
}

void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
           const AdamWHyper& h, long step, const float* clip_coefficient, float grad_scale) {
  adamw(param, grad, exp_avg, exp_avg_sq, count, h, adamw_constants(h, step), clip_coefficient,
        grad_scale);
}

void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
           const AdamWHyper& h, AdamWConstants constants, const float* clip_coefficient,
           float grad_scale) {
  active_cpu_kernels().adamw(param, grad, exp_avg, exp_avg_sq, count, h, constants,
                             clip_coefficient, grad_scale);
}

}  // namespace cpu
}  // namespace hps
