// The optimizer entries of the CUDA kernel table: the step-state update (one thread),
// SGD and AdamW on flat fp32 shards — the CPU kernels' arithmetic, operation for operation
// (--fmad=false: no product is fused into an addition). Every scalar that steers the step
// (skip, the step count, AdamW's constants, the clip coefficient) is read from device
// memory by the kernels, never by the host.
#include <cuda_runtime.h>

#include "core/kernels/cuda/device_math.cuh"

namespace hps::cuda {
namespace {

constexpr int kFloats = kGroupOf<float>;

__global__ void write_step_state_kernel(StepState* state, StepState value) { *state = value; }

// The verdict of a step, as the CPU table's update().
__global__ void update_step_state_kernel(StepState* state, StepRule rule) {
  StepState s = *state;
  if (s.found_inf != 0) {
    ++s.skipped_steps;
    s.good_steps = 0;
    s.loss_scale *= rule.backoff_factor;
    s.found_inf = 0;
    s.skip = 1;
    *state = s;
    return;
  }
  s.skip = 0;
  ++s.applied_steps;
  if (rule.dynamic_loss_scaling && ++s.good_steps >= rule.growth_interval) {
    s.loss_scale *= rule.growth_factor;
    s.good_steps = 0;
  }
  if (rule.adamw) {
    // adamw_constants(): the bias corrections in fp64 (the device's pow), rounded to fp32.
    const auto t = static_cast<double>(s.applied_steps);
    const AdamWHyper& h = rule.adamw_hyper;
    const float bias1 = __double2float_rn(1.0 - pow(static_cast<double>(h.beta1), t));
    const float bias2 = __double2float_rn(1.0 - pow(static_cast<double>(h.beta2), t));
    s.adamw_step_size = h.learning_rate / bias1;
    s.adamw_bias2_sqrt = sqrtf(bias2);
  }
  *state = s;
}

struct SgdOp {
  float* param;
  const float* grad;
  float* momentum;
  SgdHyper h;
  const StepState* state;
  const float* clip_coefficient;

  template <int N>
  __device__ void apply(size_t i) const {
    if (state->skip != 0) return;
    const float g_scale = clip_coefficient != nullptr ? *clip_coefficient : 1.0f;
    const float lr = h.learning_rate, wd = h.weight_decay, mu = h.momentum;
    auto p = load_group<N>(param, i);
    const auto gr = load_group<N>(grad, i);
    if (mu == 0.0f) {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float g = gr.v[j] * g_scale + wd * p.v[j];
        p.v[j] -= lr * g;
      }
      store_group<N>(param, i, p);
      return;
    }
    // torch: the first step initialises the buffer with the gradient itself.
    const bool first_step = state->applied_steps == 1;
    auto b = load_group<N>(momentum, i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float g = gr.v[j] * g_scale + wd * p.v[j];
      const float buffer = first_step ? g : mu * b.v[j] + g;
      b.v[j] = buffer;
      p.v[j] -= lr * (h.nesterov ? g + mu * buffer : buffer);
    }
    store_group<N>(momentum, i, b);
    store_group<N>(param, i, p);
  }
};

struct AdamWOp {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float b1, b2, eps, decay;
  const StepState* state;
  const float* clip_coefficient;

  template <int N>
  __device__ void apply(size_t i) const {
    if (state->skip != 0) return;
    const float g_scale = clip_coefficient != nullptr ? *clip_coefficient : 1.0f;
    const float step_size = state->adamw_step_size;
    const float bias2_sqrt = state->adamw_bias2_sqrt;
    auto p = load_group<N>(param, i);
    const auto gr = load_group<N>(grad, i);
    auto m = load_group<N>(exp_avg, i);
    auto v = load_group<N>(exp_avg_sq, i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float g = gr.v[j] * g_scale;
      const float mj = b1 * m.v[j] + (1.0f - b1) * g;
      const float vj = b2 * v.v[j] + (1.0f - b2) * g * g;
      m.v[j] = mj;
      v.v[j] = vj;
      p.v[j] = p.v[j] * decay - step_size * mj / (sqrtf(vj) / bias2_sqrt + eps);
    }
    store_group<N>(exp_avg, i, m);
    store_group<N>(exp_avg_sq, i, v);
    store_group<N>(param, i, p);
  }
};

bool floats_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && !group_aligned<float, kFloats>(p)) return false;
  }
  return true;
}

}  // namespace

Status launch_write_step_state(const LaunchContext& ctx, StepState* state, const StepState& value) {
  // The value travels as a kernel argument: stream-ordered, and nothing on the host has
  // to outlive the call.
  write_step_state_kernel<<<1, 1, 0, ctx.native>>>(state, value);
  return launched("write_step_state kernel");
}

Status launch_update_step_state(const LaunchContext& ctx, StepState* state, const StepRule& rule) {
  update_step_state_kernel<<<1, 1, 0, ctx.native>>>(state, rule);
  return launched("update_step_state kernel");
}

Status launch_sgd(const LaunchContext& ctx, const SgdArgs& a) {
  const SgdOp op{a.param.get(), a.grad.get(),  a.momentum.get(),
                 a.hyper,       a.state.get(), a.clip_coefficient.get()};
  if (floats_aligned({op.param, op.grad, op.momentum})) {
    return launch_elementwise<kFloats>(ctx.native, a.count, op, "sgd kernel");
  }
  return launch_elementwise<1>(ctx.native, a.count, op, "sgd kernel");
}

Status launch_adamw(const LaunchContext& ctx, const AdamWArgs& a) {
  const AdamWHyper& h = a.hyper;
  const AdamWOp op{a.param.get(),
                   a.grad.get(),
                   a.exp_avg.get(),
                   a.exp_avg_sq.get(),
                   h.beta1,
                   h.beta2,
                   h.epsilon,
                   1.0f - h.learning_rate * h.weight_decay,  // as cpu::adamw computes it
                   a.state.get(),
                   a.clip_coefficient.get()};
  if (floats_aligned({op.param, op.grad, op.exp_avg, op.exp_avg_sq})) {
    return launch_elementwise<kFloats>(ctx.native, a.count, op, "adamw kernel");
  }
  return launch_elementwise<1>(ctx.native, a.count, op, "adamw kernel");
}

}  // namespace hps::cuda
