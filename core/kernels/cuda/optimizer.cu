// Optimizer kernels on CUDA (declared in kernels/optimizer.h): the CPU kernels'
// arithmetic, operation for operation. Compiled with --fmad=false, so no product is fused
// into an addition and each step rounds as on the CPU. The clip coefficient is read from
// device memory by every thread, never by the host.
#include <cuda_runtime.h>

#include <cmath>

#include "core/device/cuda/error.h"
#include "core/kernels/optimizer.h"

namespace hps::cuda {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 8192;

unsigned blocks_for(size_t count) {
  size_t blocks = (count + kThreads * 4 - 1) / (kThreads * 4);
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks);
}

__global__ void __launch_bounds__(kThreads)
    sgd_kernel(float* param, const float* grad, float* momentum_buffer, size_t count, SgdHyper h,
               const float* clip_coefficient, float grad_scale, bool first_step) {
  const float g_scale = (clip_coefficient ? *clip_coefficient : 1.0f) * grad_scale;
  const float lr = h.learning_rate, wd = h.weight_decay, mu = h.momentum;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const float g = grad[i] * g_scale + wd * param[i];
    if (mu == 0.0f) {
      param[i] -= lr * g;
      continue;
    }
    // torch: the first step initialises the buffer with the gradient itself.
    const float b = first_step ? g : mu * momentum_buffer[i] + g;
    momentum_buffer[i] = b;
    param[i] -= lr * (h.nesterov ? g + mu * b : b);
  }
}

__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
                 float b1, float b2, float eps, float step_size, float bias2_sqrt, float decay,
                 const float* clip_coefficient, float grad_scale) {
  const float g_scale = (clip_coefficient ? *clip_coefficient : 1.0f) * grad_scale;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const float g = grad[i] * g_scale;
    const float m = b1 * exp_avg[i] + (1.0f - b1) * g;
    const float v = b2 * exp_avg_sq[i] + (1.0f - b2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = param[i] * decay - step_size * m / (sqrtf(v) / bias2_sqrt + eps);
  }
}

__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(float* dst, const float* src, size_t count) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] += src[i];
  }
}

}  // namespace

Status accumulate(float* dst, const float* src, size_t count, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) return invalid_argument("accumulate: null buffer");
  accumulate_kernel<<<blocks_for(count), kThreads, 0, stream>>>(dst, src, count);
  return cuda_status(cudaGetLastError(), "accumulate kernel");
}

Status sgd(float* param, const float* grad, float* momentum_buffer, size_t count, const SgdHyper& h,
           const float* clip_coefficient, float grad_scale, bool first_step, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  if (param == nullptr || grad == nullptr || (h.momentum != 0.0f && momentum_buffer == nullptr)) {
    return invalid_argument("sgd: null parameter, gradient or momentum buffer");
  }
  sgd_kernel<<<blocks_for(count), kThreads, 0, stream>>>(param, grad, momentum_buffer, count, h,
                                                         clip_coefficient, grad_scale, first_step);
  return cuda_status(cudaGetLastError(), "sgd kernel");
}

Status adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
             const AdamWHyper& h, long step, const float* clip_coefficient, float grad_scale,
             cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
    return invalid_argument("adamw: null parameter, gradient or moment buffer");
  }
  // The per-step constants exactly as cpu::adamw computes them, on the host.
  const double s = static_cast<double>(step);
  const auto bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta1), s));
  const auto bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta2), s));
  const float step_size = h.learning_rate / bias1;
  const float bias2_sqrt = std::sqrt(bias2);
  const float decay = 1.0f - h.learning_rate * h.weight_decay;
  adamw_kernel<<<blocks_for(count), kThreads, 0, stream>>>(
      param, grad, exp_avg, exp_avg_sq, count, h.beta1, h.beta2, h.epsilon, step_size, bias2_sqrt,
      decay, clip_coefficient, grad_scale);
  return cuda_status(cudaGetLastError(), "adamw kernel");
}

}  // namespace hps::cuda
