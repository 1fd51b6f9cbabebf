// The optimizer entries of the CUDA kernel table: the step-state update (one thread),
// SGD and AdamW on flat fp32 shards — the rules the CPU kernels apply (optimizer.h,
// kernel_table.h), compiled for the device (--fmad=false: no product is fused into an
// addition). Every scalar that steers the step
// (skip, the step count, AdamW's constants, the clip coefficient) is read from device
// memory by the kernels, never by the host.
#include <cuda_runtime.h>

#include "core/kernels/cuda/device_math.cuh"

namespace hps::cuda {
namespace {

constexpr int kFloats = kGroupOf<float>;

__global__ void write_step_state_kernel(StepState* state, StepState value) { *state = value; }

// The verdict of a step (advance_step_state, kernel_table.h), on the device's state.
__global__ void update_step_state_kernel(StepState* state, StepRule rule) {
  StepState s = *state;
  advance_step_state(s, rule);
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
    const SgdTerms t = sgd_terms(h, clip_coefficient != nullptr ? *clip_coefficient : 1.0f);
    auto p = load_group<N>(param, i);
    const auto gr = load_group<N>(grad, i);
    if (t.mu == 0.0f) {
#pragma unroll
      for (int j = 0; j < N; ++j) p.v[j] = sgd_plain(p.v[j], gr.v[j], t);
      store_group<N>(param, i, p);
      return;
    }
    const bool first_step = state->applied_steps == 1;
    auto b = load_group<N>(momentum, i);
#pragma unroll
    for (int j = 0; j < N; ++j) sgd_momentum(p.v[j], b.v[j], gr.v[j], t, first_step);
    store_group<N>(momentum, i, b);
    store_group<N>(param, i, p);
  }
};

struct AdamWOp {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  AdamWHyper h;
  const StepState* state;
  const float* clip_coefficient;

  template <int N>
  __device__ void apply(size_t i) const {
    if (state->skip != 0) return;
    const AdamWTerms t =
        adamw_terms(h, AdamWConstants{state->adamw_step_size, state->adamw_bias2_sqrt},
                    clip_coefficient != nullptr ? *clip_coefficient : 1.0f);
    auto p = load_group<N>(param, i);
    const auto gr = load_group<N>(grad, i);
    auto m = load_group<N>(exp_avg, i);
    auto v = load_group<N>(exp_avg_sq, i);
#pragma unroll
    for (int j = 0; j < N; ++j) adamw_element(p.v[j], m.v[j], v.v[j], gr.v[j], t);
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
  const AdamWOp op{a.param.get(), a.grad.get(),  a.exp_avg.get(),
                   a.exp_avg_sq.get(), a.hyper, a.state.get(), a.clip_coefficient.get()};
  if (floats_aligned({op.param, op.grad, op.exp_avg, op.exp_avg_sq})) {
    return launch_elementwise<kFloats>(ctx.native, a.count, op, "adamw kernel");
  }
  return launch_elementwise<1>(ctx.native, a.count, op, "adamw kernel");
}

}  // namespace hps::cuda
