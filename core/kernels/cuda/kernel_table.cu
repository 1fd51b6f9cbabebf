// The CUDA kernel table: each entry checks its arguments on the host (sizes, nulls, the
// stream's device — never device memory), makes the stream's device current and enqueues
// its kernels (kernels/cuda/cast.cu, norm.cu, optimizer.cu) on the stream. Nothing here
// blocks the host or reads device memory on the host.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/device/cpu/stream.h"
#include "core/device/cuda/error.h"
#include "core/device/cuda/stream.h"
#include "core/kernels/cuda/launch.h"
#include "core/kernels/kernel_table_backends.h"

namespace hps::cuda {

Status launched(const char* kernel) { return cuda_status(cudaGetLastError(), kernel); }

unsigned grid_for(const void* kernel, size_t items, size_t min_per_thread) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> resident_blocks;  // per device
  int device = 0;
  size_t wave = 1;
  if (cudaGetDevice(&device) == cudaSuccess) {
    std::lock_guard lock(mutex);
    auto [it, inserted] = resident_blocks.try_emplace({kernel, device}, 0);
    if (inserted) {
      int per_sm = 0, sms = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) !=
              cudaSuccess ||
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
        per_sm = sms = 1;
        (void)cudaGetLastError();  // a failed query is not the next launch's error
      }
      it->second = static_cast<size_t>(per_sm > 0 ? per_sm : 1) * static_cast<size_t>(sms);
    }
    wave = it->second;
  }
  const size_t per_block = static_cast<size_t>(kThreads) * min_per_thread;
  size_t blocks = (items + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > wave) blocks = wave;
  return static_cast<unsigned>(blocks);
}

namespace {

StatusOr<LaunchContext> context(Stream& stream, const char* entry) {
  if (stream.device().type != DeviceType::kCuda) {
    return invalid_argument(std::string(entry) + ": a cuda kernel on a stream on " +
                            stream.device().to_string());
  }
  HPS_RETURN_IF_ERROR(set_device(stream.device().index));
  return LaunchContext{stream, static_cast<CudaStream&>(stream).native()};
}

Status null_argument(const char* entry, const char* which) {
  return invalid_argument(std::string(entry) + ": " + which + " is null");
}

Status check_float(const char* entry, DType dtype) {
  if (dtype_is_floating(dtype)) return Status::Ok();
  return invalid_argument(std::string(entry) + ": dtype " + std::string(dtype_name(dtype)) +
                          " is not a float type");
}

#define HPS_CONTEXT(entry) HPS_ASSIGN_OR_RETURN(LaunchContext ctx, context(stream, entry))
#define HPS_REQUIRE(pointer, entry, which) \
  if (!(pointer)) return null_argument(entry, which)

class CudaKernels final : public Kernels {
 public:
  DeviceType device_type() const override { return DeviceType::kCuda; }

  Status cast(Stream& stream, DType from, DevicePtr<const void> in, DType to, DevicePtr<void> out,
              size_t count) const override {
    HPS_CONTEXT("cast");
    if (count == 0) return Status::Ok();
    HPS_REQUIRE(in, "cast", "the input");
    HPS_REQUIRE(out, "cast", "the output");
    if (from == to) {
      if (in.get() == out.get()) return Status::Ok();
      return cuda_status(cudaMemcpyAsync(out.get(), in.get(), count * dtype_size(from),
                                         cudaMemcpyDeviceToDevice, ctx.native),
                         "cast: cudaMemcpyAsync");
    }
    return launch_cast(ctx, from, in.get(), to, out.get(), count);
  }

  Status accumulate(Stream& stream, DevicePtr<float> dst, DType src_dtype,
                    DevicePtr<const void> src, size_t count) const override {
    HPS_CONTEXT("accumulate");
    HPS_RETURN_IF_ERROR(check_float("accumulate", src_dtype));
    if (count == 0) return Status::Ok();
    HPS_REQUIRE(dst, "accumulate", "the destination");
    HPS_REQUIRE(src, "accumulate", "the source");
    return launch_accumulate(ctx, dst.get(), src_dtype, src.get(), count);
  }

  Status fill(Stream& stream, DType dtype, DevicePtr<void> data, size_t count,
              double value) const override {
    HPS_CONTEXT("fill");
    if (count == 0) return Status::Ok();
    HPS_REQUIRE(data, "fill", "the data");
    // The element's bits from the CPU table itself (the calling thread runs it at once),
    // so both devices convert the value the same way.
    uint64_t element = 0;
    cpu::CallerStream caller;
    HPS_RETURN_IF_ERROR(
        cpu::kernel_table().fill(caller, dtype, DevicePtr<void>(&element), 1, value));
    const size_t bytes = dtype_size(dtype);
    if (bytes == 1) {
      return cuda_status(
          cudaMemsetAsync(data.get(), static_cast<int>(element & 0xff), count, ctx.native),
          "fill: cudaMemsetAsync");
    }
    return launch_fill(ctx, data.get(), bytes, element, count);
  }

  Status sum_of_squares(Stream& stream, DType dtype, DevicePtr<const void> data, size_t count,
                        DevicePtr<double> partial) const override {
    HPS_CONTEXT("sum_of_squares");
    HPS_RETURN_IF_ERROR(check_float("sum_of_squares", dtype));
    if (count == 0) return Status::Ok();
    HPS_REQUIRE(data, "sum_of_squares", "the data");
    HPS_REQUIRE(partial, "sum_of_squares", "the partial sum");
    return launch_sum_of_squares(ctx, dtype, data.get(), count, partial.get());
  }

  Status sum_of_squares_fixed(Stream& stream, DType dtype, DevicePtr<const void> data, size_t count,
                              DevicePtr<FixedSquares> out) const override {
    HPS_CONTEXT("sum_of_squares_fixed");
    HPS_RETURN_IF_ERROR(check_float("sum_of_squares_fixed", dtype));
    if (count == 0) return Status::Ok();
    HPS_REQUIRE(data, "sum_of_squares_fixed", "the data");
    HPS_REQUIRE(out, "sum_of_squares_fixed", "the sum");
    return launch_sum_of_squares_fixed(ctx, dtype, data.get(), count, out.get());
  }

  Status finish_clip(Stream& stream, DevicePtr<ClipState> clip, bool deterministic,
                     double max_norm) const override {
    HPS_CONTEXT("finish_clip");
    HPS_REQUIRE(clip, "finish_clip", "the clip state");
    return launch_finish_clip(ctx, clip.get(), deterministic, max_norm);
  }

  Status scale(Stream& stream, DType dtype, DevicePtr<void> data, size_t count,
               DevicePtr<const ClipState> clip) const override {
    HPS_CONTEXT("scale");
    HPS_RETURN_IF_ERROR(check_float("scale", dtype));
    if (count == 0) return Status::Ok();
    HPS_REQUIRE(data, "scale", "the data");
    HPS_REQUIRE(clip, "scale", "the clip state");
    return launch_scale(ctx, dtype, data.get(), count, clip.get());
  }

  Status unscale(Stream& stream, const UnscaleArgs& a) const override {
    HPS_CONTEXT("unscale");
    if (a.src_dtype != DType::kFloat32 && a.src_dtype != DType::kFloat16 &&
        a.src_dtype != DType::kBFloat16) {
      return invalid_argument("unscale: the gradient's dtype " +
                              std::string(dtype_name(a.src_dtype)) +
                              " is not float32, float16 or bfloat16");
    }
    if (a.clip && a.partial != -1 && a.partial != kClipPartialD && a.partial != kClipPartialN) {
      return invalid_argument("unscale: partial " + std::to_string(a.partial) +
                              " is not kClipPartialD, kClipPartialN or -1");
    }
    if (a.count == 0) return Status::Ok();
    HPS_REQUIRE(a.src, "unscale", "the source");
    HPS_REQUIRE(a.dst, "unscale", "the destination");
    HPS_REQUIRE(a.state, "unscale", "the step state");
    return launch_unscale(ctx, a);
  }

  Status write_step_state(Stream& stream, DevicePtr<StepState> state,
                          const StepState& value) const override {
    HPS_CONTEXT("write_step_state");
    HPS_REQUIRE(state, "write_step_state", "the step state");
    return launch_write_step_state(ctx, state.get(), value);
  }

  Status update_step_state(Stream& stream, DevicePtr<StepState> state,
                           const StepRule& rule) const override {
    HPS_CONTEXT("update_step_state");
    HPS_REQUIRE(state, "update_step_state", "the step state");
    return launch_update_step_state(ctx, state.get(), rule);
  }

  Status sgd(Stream& stream, const SgdArgs& a) const override {
    HPS_CONTEXT("sgd");
    if (a.count == 0) return Status::Ok();
    HPS_REQUIRE(a.param, "sgd", "the parameter");
    HPS_REQUIRE(a.grad, "sgd", "the gradient");
    HPS_REQUIRE(a.state, "sgd", "the step state");
    if (a.hyper.momentum != 0.0f) HPS_REQUIRE(a.momentum, "sgd", "the momentum buffer");
    return launch_sgd(ctx, a);
  }

  Status adamw(Stream& stream, const AdamWArgs& a) const override {
    HPS_CONTEXT("adamw");
    if (a.count == 0) return Status::Ok();
    HPS_REQUIRE(a.param, "adamw", "the parameter");
    HPS_REQUIRE(a.grad, "adamw", "the gradient");
    HPS_REQUIRE(a.exp_avg, "adamw", "exp_avg");
    HPS_REQUIRE(a.exp_avg_sq, "adamw", "exp_avg_sq");
    HPS_REQUIRE(a.state, "adamw", "the step state");
    return launch_adamw(ctx, a);
  }
};

#undef HPS_CONTEXT
#undef HPS_REQUIRE

}  // namespace

const Kernels& kernel_table() {
  static const CudaKernels table;
  return table;
}

}  // namespace hps::cuda
