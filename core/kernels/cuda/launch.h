// The launchers behind the CUDA kernel table (kernels/cuda/kernel_table.cu): one per
// kernel family, in cast.cu, norm.cu and optimizer.cu. Arguments are checked by the table
// before they get here; every launcher enqueues on ctx.native and returns the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/common/dtype.h"
#include "core/common/status.h"
#include "core/kernels/kernel_table.h"

namespace hps::cuda {

inline constexpr int kThreads = 256;  // per block; a multiple of the warp size

struct LaunchContext {
  Stream& stream;       // for stream-ordered scratch memory
  cudaStream_t native;  // its cudaStream_t
};

// Blocks for a grid-stride kernel over `items` units of work, each thread taking at least
// `min_per_thread` of them: never more than the device holds resident at once (one full
// wave, from the kernel's occupancy, cached per kernel and device), so every block starts
// at once and the loads of the whole device are in flight.
unsigned grid_for(const void* kernel, size_t items, size_t min_per_thread);

Status launched(const char* kernel);  // the launch error of the last kernel, as a Status

// cast.cu
Status launch_cast(const LaunchContext& ctx, DType from, const void* in, DType to, void* out,
                   size_t count);
Status launch_accumulate(const LaunchContext& ctx, float* dst, DType src_dtype, const void* src,
                         size_t count);
// Writes the element `pattern` (its low `element_bytes` bytes: 2, 4 or 8) `count` times.
Status launch_fill(const LaunchContext& ctx, void* data, size_t element_bytes, uint64_t pattern,
                   size_t count);

// norm.cu
Status launch_sum_of_squares(const LaunchContext& ctx, DType dtype, const void* data, size_t count,
                             double* partial);
Status launch_sum_of_squares_fixed(const LaunchContext& ctx, DType dtype, const void* data,
                                   size_t count, FixedSquares* out);
Status launch_finish_clip(const LaunchContext& ctx, ClipState* clip, bool deterministic,
                          double max_norm);
Status launch_scale(const LaunchContext& ctx, DType dtype, void* data, size_t count,
                    const ClipState* clip);
Status launch_unscale(const LaunchContext& ctx, const UnscaleArgs& args);

// optimizer.cu
Status launch_write_step_state(const LaunchContext& ctx, StepState* state, const StepState& value);
Status launch_update_step_state(const LaunchContext& ctx, StepState* state, const StepRule& rule);
Status launch_sgd(const LaunchContext& ctx, const SgdArgs& args);
Status launch_adamw(const LaunchContext& ctx, const AdamWArgs& args);

}  // namespace hps::cuda
