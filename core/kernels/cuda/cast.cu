// Casts, accumulation and fills of the CUDA kernel table: elementwise, 16-byte groups
// where the buffers' alignment allows (single elements otherwise), the CPU's bits.
#include <cuda_runtime.h>

#include "core/kernels/cuda/device_math.cuh"

namespace hps::cuda {
namespace {

template <typename From, typename To>
struct CastOp {
  const typename From::Storage* in;
  typename To::Storage* out;

  template <int N>
  __device__ void apply(size_t i) const {
    const auto src = load_group<N>(in, i);
    Group<typename To::Storage, N> dst;
#pragma unroll
    for (int j = 0; j < N; ++j) dst.v[j] = To::store(From::exact(src.v[j]));
    store_group<N>(out, i, dst);
  }
};

template <typename Src>
struct AccumulateOp {
  float* dst;
  const typename Src::Storage* src;

  template <int N>
  __device__ void apply(size_t i) const {
    const auto s = load_group<N>(src, i);
    auto d = load_group<N>(dst, i);
#pragma unroll
    for (int j = 0; j < N; ++j) d.v[j] += Src::widen(s.v[j]);
    store_group<N>(dst, i, d);
  }
};

template <typename Element>
struct FillOp {
  Element* data;
  Element value;

  template <int N>
  __device__ void apply(size_t i) const {
    Group<Element, N> g;
#pragma unroll
    for (int j = 0; j < N; ++j) g.v[j] = value;
    store_group<N>(data, i, g);
  }
};

template <typename From, typename To>
Status cast_typed(cudaStream_t stream, const void* in, void* out, size_t count) {
  using S = typename From::Storage;
  using D = typename To::Storage;
  constexpr int W = kGroupOf<S>;
  const CastOp<From, To> op{static_cast<const S*>(in), static_cast<D*>(out)};
  if (group_aligned<S, W>(in) && group_aligned<D, W>(out)) {
    return launch_elementwise<W>(stream, count, op, "cast kernel");
  }
  return launch_elementwise<1>(stream, count, op, "cast kernel");
}

template <typename Element>
Status fill_typed(cudaStream_t stream, void* data, uint64_t pattern, size_t count) {
  constexpr int W = kGroupOf<Element>;
  const FillOp<Element> op{static_cast<Element*>(data), static_cast<Element>(pattern)};
  if (group_aligned<Element, W>(data)) {
    return launch_elementwise<W>(stream, count, op, "fill kernel");
  }
  return launch_elementwise<1>(stream, count, op, "fill kernel");
}

}  // namespace

Status launch_cast(const LaunchContext& ctx, DType from, const void* in, DType to, void* out,
                   size_t count) {
  return with_float_type(from, "cast", [&](auto source) {
    return with_float_type(to, "cast", [&](auto target) {
      return cast_typed<decltype(source), decltype(target)>(ctx.native, in, out, count);
    });
  });
}

Status launch_accumulate(const LaunchContext& ctx, float* dst, DType src_dtype, const void* src,
                         size_t count) {
  return with_float_type(src_dtype, "accumulate", [&](auto type) {
    using Src = decltype(type);
    using S = typename Src::Storage;
    constexpr int W = kGroupOf<S>;
    const AccumulateOp<Src> op{dst, static_cast<const S*>(src)};
    if (group_aligned<S, W>(src) && group_aligned<float, W>(dst)) {
      return launch_elementwise<W>(ctx.native, count, op, "accumulate kernel");
    }
    return launch_elementwise<1>(ctx.native, count, op, "accumulate kernel");
  });
}

Status launch_fill(const LaunchContext& ctx, void* data, size_t element_bytes, uint64_t pattern,
                   size_t count) {
  switch (element_bytes) {
    case 2: return fill_typed<uint16_t>(ctx.native, data, pattern, count);
    case 4: return fill_typed<uint32_t>(ctx.native, data, pattern, count);
    case 8: return fill_typed<unsigned long long>(ctx.native, data, pattern, count);
    default:
      return invalid_argument("fill: elements of " + std::to_string(element_bytes) + " bytes");
  }
}

}  // namespace hps::cuda
