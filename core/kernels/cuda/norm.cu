// The norm entries of the CUDA kernel table: sums of squares (float and exact fixed-point),
// the fused unscale pass, finish_clip and scale.
//
// One pass kernel serves the sums and the unscale: each thread reads 16-byte groups
// (grid-stride, four groups in flight), converts, optionally multiplies by the unscale
// factor and stores fp32, and adds the squares — in fp32 chunks of at most kSquaresChunk
// elements added in fp64 (as the CPU does), or exactly into integer digits. The float sums
// meet in a fixed tree (warp shuffles, the block's warps, then the block partials in index
// order by a second one-block kernel), so a rerun on the same device and buffer gives the
// same bits; the only atomics are integer ones (the fixed-point digits), exact in any order.
// Every scalar that steers the pass (the loss scale, found-inf, the partials, the clip
// coefficient) is read or written in device memory by the kernels.
#include <cuda_runtime.h>

#include <type_traits>

#include "core/device/buffer.h"
#include "core/kernels/cuda/device_math.cuh"

namespace hps::cuda {
namespace {

constexpr size_t kMinGroupsPerThread = 4;  // fewer blocks for small buffers

enum class Partial { kNone, kFloat, kFixed };

template <typename Type>
struct PassArgs {
  const typename Type::Storage* src = nullptr;
  size_t count = 0;
  // Unscale only: dst[i] = src[i] · (mean_scale / state->loss_scale); with check_finite,
  // state->found_inf = 1 when a result is not finite.
  float* dst = nullptr;
  float mean_scale = 1.0f;
  StepState* state = nullptr;
  bool check_finite = false;
  // Float partials: one per block into block_partials, or straight into *partial_out when
  // the grid is one block.
  double* block_partials = nullptr;
  double* partial_out = nullptr;
  int64_t* fixed_out = nullptr;  // fixed partials: FixedSquares slots
};

// One thread's share of the pass.
template <typename Type, Partial kPartial, bool kUnscale>
struct PassThread {
  using Storage = typename Type::Storage;
  // The squared values: the unscaled fp32 results, or the data in its compute precision.
  using Value = std::conditional_t<kUnscale, float, typename Type::Compute>;

  const PassArgs<Type>& a;
  float factor = 1.0f;
  SquaresAccumulator<Value> squares;
  FixedAccumulator fixed;
  bool nonfinite = false;

  template <int N>
  __device__ __forceinline__ void process(const Group<Storage, N>& g, size_t i) {
    Value x[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (kUnscale) {
        x[j] = Type::widen(g.v[j]) * factor;
      } else {
        x[j] = Type::load(g.v[j]);
      }
    }
    if constexpr (kUnscale) {
      Group<float, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        out.v[j] = x[j];
        nonfinite |= !isfinite(x[j]);
      }
      store_group<N>(a.dst, i, out);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (kPartial == Partial::kFloat) squares.add(x[j]);
      if constexpr (kPartial == Partial::kFixed) fixed.add(static_cast<double>(x[j]));
    }
  }
};

template <typename Type, int W, Partial kPartial, bool kUnscale>
__global__ void __launch_bounds__(kThreads) squares_pass(PassArgs<Type> a) {
  PassThread<Type, kPartial, kUnscale> t{a};
  if constexpr (kUnscale) t.factor = a.mean_scale / a.state->loss_scale;
  const size_t groups = a.count / W;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t g = first;
  // Four groups in flight per thread, then the rest one at a time; always in index order.
  for (; g + 3 * stride < groups; g += 4 * stride) {
    Group<typename Type::Storage, W> v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = load_group<W>(a.src, (g + k * stride) * W);
#pragma unroll
    for (int k = 0; k < 4; ++k) t.template process<W>(v[k], (g + k * stride) * W);
  }
  for (; g < groups; g += stride) t.template process<W>(load_group<W>(a.src, g * W), g * W);
  if constexpr (W > 1) {
    const size_t tail = groups * W + first;
    if (tail < a.count) t.template process<1>(load_group<1>(a.src, tail), tail);
  }

  if constexpr (kPartial == Partial::kFloat) {
    const double sum = block_sum(t.squares.finish());
    if (threadIdx.x == 0) {
      if (gridDim.x == 1) {
        *a.partial_out += sum;
      } else {
        a.block_partials[blockIdx.x] = sum;
      }
    }
  }
  if constexpr (kPartial == Partial::kFixed) add_block_digits(t.fixed, a.fixed_out);
  if constexpr (kUnscale) {
    // Every thread reaches this (a.check_finite is the same for all).
    if (a.check_finite && __syncthreads_or(t.nonfinite) && threadIdx.x == 0) {
      a.state->found_inf = 1;
    }
  }
}

// The block partials of a float pass, added in a fixed order by one block.
__global__ void __launch_bounds__(kThreads)
    add_block_partials(const double* block_partials, unsigned blocks, double* out) {
  double sum = 0;
  for (unsigned i = threadIdx.x; i < blocks; i += blockDim.x) sum += block_partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out += sum;
}

// After every block of a fixed pass: the canonical form the CPU leaves.
__global__ void normalize_slots(int64_t* slots) { fixed_normalize(slots); }

template <typename Type, int W, Partial kPartial, bool kUnscale>
Status run_pass(const LaunchContext& ctx, PassArgs<Type> a) {
  auto* kernel = &squares_pass<Type, W, kPartial, kUnscale>;
  const unsigned blocks =
      grid_for(reinterpret_cast<const void*>(kernel), a.count / W + 1, kMinGroupsPerThread);
  // The block partials live in stream-ordered scratch memory, freed in the stream's order.
  DeviceBuffer scratch;
  if (kPartial == Partial::kFloat && blocks > 1) {
    HPS_ASSIGN_OR_RETURN(scratch, DeviceBuffer::allocate_async(
                                      ctx.stream.device(), blocks * sizeof(double), ctx.stream));
    a.block_partials = scratch.data<double>().get();
  }
  kernel<<<blocks, kThreads, 0, ctx.native>>>(a);
  HPS_RETURN_IF_ERROR(launched("sum of squares kernel"));
  if (kPartial == Partial::kFloat && blocks > 1) {
    add_block_partials<<<1, kThreads, 0, ctx.native>>>(a.block_partials, blocks, a.partial_out);
    HPS_RETURN_IF_ERROR(launched("sum of squares: block partials kernel"));
  }
  if (kPartial == Partial::kFixed) {
    normalize_slots<<<1, 1, 0, ctx.native>>>(a.fixed_out);
    HPS_RETURN_IF_ERROR(launched("sum of squares: normalize kernel"));
  }
  return Status::Ok();
}

// The pass with 16-byte groups where src (and dst) allow them, single elements otherwise.
template <typename Type, Partial kPartial, bool kUnscale>
Status run_pass_aligned(const LaunchContext& ctx, const PassArgs<Type>& a) {
  using S = typename Type::Storage;
  constexpr int W = kGroupOf<S>;
  const bool aligned = group_aligned<S, W>(a.src) && (!kUnscale || group_aligned<float, W>(a.dst));
  if (aligned) return run_pass<Type, W, kPartial, kUnscale>(ctx, a);
  return run_pass<Type, 1, kPartial, kUnscale>(ctx, a);
}

template <typename Type>
struct ScaleOp {
  typename Type::Storage* data;
  const ClipState* clip;

  template <int N>
  __device__ void apply(size_t i) const {
    auto g = load_group<N>(data, i);
    if constexpr (std::is_same_v<Type, Fp64>) {
      // fp64 data by the unrounded coefficient; the others by its fp32 rounding.
      const double c = clip->coefficient_fp64;
#pragma unroll
      for (int j = 0; j < N; ++j) g.v[j] *= c;
    } else {
      const float c = clip->coefficient;
#pragma unroll
      for (int j = 0; j < N; ++j) g.v[j] = Type::store(Type::load(g.v[j]) * c);
    }
    store_group<N>(data, i, g);
  }
};

__global__ void finish_clip_kernel(ClipState* clip, bool deterministic, double max_norm) {
  finish_clip_state(*clip, deterministic, max_norm);
}

}  // namespace

Status launch_sum_of_squares(const LaunchContext& ctx, DType dtype, const void* data, size_t count,
                             double* partial) {
  return with_float_type(dtype, "sum_of_squares", [&](auto type) {
    using Type = decltype(type);
    PassArgs<Type> a;
    a.src = static_cast<const typename Type::Storage*>(data);
    a.count = count;
    a.partial_out = partial;
    return run_pass_aligned<Type, Partial::kFloat, false>(ctx, a);
  });
}

Status launch_sum_of_squares_fixed(const LaunchContext& ctx, DType dtype, const void* data,
                                   size_t count, FixedSquares* out) {
  return with_float_type(dtype, "sum_of_squares_fixed", [&](auto type) {
    using Type = decltype(type);
    PassArgs<Type> a;
    a.src = static_cast<const typename Type::Storage*>(data);
    a.count = count;
    a.fixed_out = reinterpret_cast<int64_t*>(out);
    return run_pass_aligned<Type, Partial::kFixed, false>(ctx, a);
  });
}

Status launch_unscale(const LaunchContext& ctx, const UnscaleArgs& u) {
  if (u.src_dtype == DType::kFloat64) {
    return invalid_argument("unscale: the gradient must be float32, float16 or bfloat16");
  }
  return with_float_type(u.src_dtype, "unscale", [&](auto type) -> Status {
    using Type = decltype(type);
    if constexpr (std::is_same_v<Type, Fp64>) {
      return Status::Ok();  // refused above
    } else {
      PassArgs<Type> a;
      a.src = static_cast<const typename Type::Storage*>(u.src.get());
      a.count = u.count;
      a.dst = u.dst.get();
      a.mean_scale = u.mean_scale;
      a.state = u.state.get();
      a.check_finite = u.check_finite;
      if (!u.clip || u.partial < 0) return run_pass_aligned<Type, Partial::kNone, true>(ctx, a);
      ClipState* clip = u.clip.get();
      if (u.deterministic) {
        a.fixed_out = reinterpret_cast<int64_t*>(&clip->fixed[u.partial]);
        return run_pass_aligned<Type, Partial::kFixed, true>(ctx, a);
      }
      a.partial_out = &clip->partials[u.partial];
      return run_pass_aligned<Type, Partial::kFloat, true>(ctx, a);
    }
  });
}

Status launch_finish_clip(const LaunchContext& ctx, ClipState* clip, bool deterministic,
                          double max_norm) {
  finish_clip_kernel<<<1, 1, 0, ctx.native>>>(clip, deterministic, max_norm);
  return launched("finish_clip kernel");
}

Status launch_scale(const LaunchContext& ctx, DType dtype, void* data, size_t count,
                    const ClipState* clip) {
  return with_float_type(dtype, "scale", [&](auto type) {
    using Type = decltype(type);
    using S = typename Type::Storage;
    constexpr int W = kGroupOf<S>;
    const ScaleOp<Type> op{static_cast<S*>(data), clip};
    if (group_aligned<S, W>(data)) return launch_elementwise<W>(ctx.native, count, op, "scale");
    return launch_elementwise<1>(ctx.native, count, op, "scale kernel");
  });
}

}  // namespace hps::cuda
