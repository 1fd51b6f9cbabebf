// The CPU kernel table: each entry enqueues a task on the CPU stream (a worker's queue, or
// the calling thread) that runs the CPU kernels (kernels/cpu/*.cc). Device memory is host
// memory here, so the tasks read the step's scalars directly — in stream order, as the
// CUDA kernels read them on the device.
#include "core/kernels/kernel_table.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/common/half.h"
#include "core/device/cpu/stream.h"
#include "core/kernels/cast.h"
#include "core/kernels/kernel_table_backends.h"

namespace hps {
namespace cpu {
namespace {

StatusOr<HostQueue*> queue_of(Stream& stream, const char* kernel) {
  if (stream.device().type != DeviceType::kCpu) {
    return invalid_argument(std::string(kernel) + ": a cpu kernel on a stream on " +
                            stream.device().to_string());
  }
  return static_cast<HostQueue*>(&stream);
}

#define HPS_QUEUE(name) HPS_ASSIGN_OR_RETURN(HostQueue* queue, queue_of(stream, name))

void fill_values(DType dtype, void* data, size_t count, double value) {
  switch (dtype) {
    case DType::kFloat32:
      std::fill_n(static_cast<float*>(data), count, static_cast<float>(value));
      return;
    case DType::kFloat64: std::fill_n(static_cast<double*>(data), count, value); return;
    case DType::kFloat16:
      std::fill_n(static_cast<uint16_t*>(data), count,
                  float_to_half_bits(static_cast<float>(value)));
      return;
    case DType::kBFloat16:
      std::fill_n(static_cast<uint16_t*>(data), count,
                  float_to_bf16_bits(static_cast<float>(value)));
      return;
    case DType::kInt32:
      std::fill_n(static_cast<int32_t*>(data), count, static_cast<int32_t>(value));
      return;
    case DType::kInt64:
      std::fill_n(static_cast<int64_t*>(data), count, static_cast<int64_t>(value));
      return;
    case DType::kUInt8:
      std::fill_n(static_cast<uint8_t*>(data), count, static_cast<uint8_t>(value));
      return;
  }
}

class CpuKernels final : public Kernels {
 public:
  DeviceType device_type() const override { return DeviceType::kCpu; }

  Status cast(Stream& stream, DType from, DevicePtr<const void> in, DType to, DevicePtr<void> out,
              size_t count) const override {
    HPS_QUEUE("cast");
    queue->enqueue([from, in, to, out, count] { cpu::cast(from, in.get(), to, out.get(), count); },
                   "cast");
    return Status::Ok();
  }

  Status accumulate(Stream& stream, DevicePtr<float> dst, DType src_dtype,
                    DevicePtr<const void> src, size_t count) const override {
    HPS_QUEUE("accumulate");
    queue->enqueue(
        [dst, src_dtype, src, count] { cpu::accumulate(dst.get(), src_dtype, src.get(), count); },
        "accumulate");
    return Status::Ok();
  }

  Status fill(Stream& stream, DType dtype, DevicePtr<void> data, size_t count,
              double value) const override {
    HPS_QUEUE("fill");
    queue->enqueue([dtype, data, count, value] { fill_values(dtype, data.get(), count, value); },
                   "fill");
    return Status::Ok();
  }

  Status sum_of_squares(Stream& stream, DType dtype, DevicePtr<const void> data, size_t count,
                        DevicePtr<double> partial) const override {
    HPS_QUEUE("sum_of_squares");
    queue->enqueue([dtype, data, count,
                    partial] { *partial.get() += cpu::sum_of_squares(dtype, data.get(), count); },
                   "sum_of_squares");
    return Status::Ok();
  }

  Status sum_of_squares_fixed(Stream& stream, DType dtype, DevicePtr<const void> data, size_t count,
                              DevicePtr<FixedSquares> out) const override {
    HPS_QUEUE("sum_of_squares_fixed");
    queue->enqueue([dtype, data, count,
                    out] { cpu::sum_of_squares_fixed(dtype, data.get(), count, *out.get()); },
                   "sum_of_squares_fixed");
    return Status::Ok();
  }

  Status finish_clip(Stream& stream, DevicePtr<ClipState> clip, bool deterministic,
                     double max_norm) const override {
    HPS_QUEUE("finish_clip");
    queue->enqueue([clip, deterministic,
                    max_norm] { finish_clip_state(*clip.get(), deterministic, max_norm); },
                   "finish_clip");
    return Status::Ok();
  }

  Status scale(Stream& stream, DType dtype, DevicePtr<void> data, size_t count,
               DevicePtr<const ClipState> clip) const override {
    HPS_QUEUE("scale");
    queue->enqueue(
        [dtype, data, count, clip] {
          const ClipState& c = *clip.get();
          // fp64 data by the unrounded coefficient; the others by its fp32 rounding.
          cpu::scale(dtype, data.get(), count,
                     dtype == DType::kFloat64 ? c.coefficient_fp64 : c.coefficient);
        },
        "scale");
    return Status::Ok();
  }

  Status unscale(Stream& stream, const UnscaleArgs& a) const override {
    HPS_QUEUE("unscale");
    queue->enqueue(
        [a] {
          StepState& state = *a.state.get();
          const float factor = a.mean_scale / state.loss_scale;
          double* partial = nullptr;
          FixedSquares* fixed = nullptr;
          if (a.clip && a.partial >= 0) {
            ClipState& c = *a.clip.get();
            if (a.deterministic) {
              fixed = &c.fixed[a.partial];
            } else {
              partial = &c.partials[a.partial];
            }
          }
          const bool finite = cpu::unscale(a.src_dtype, a.src.get(), a.dst.get(), a.count, factor,
                                           a.check_finite, partial, fixed);
          if (!finite) state.found_inf = 1;
        },
        "unscale");
    return Status::Ok();
  }

  Status write_step_state(Stream& stream, DevicePtr<StepState> state,
                          const StepState& value) const override {
    HPS_QUEUE("write_step_state");
    queue->enqueue([state, value] { *state.get() = value; }, "write_step_state");
    return Status::Ok();
  }

  Status update_step_state(Stream& stream, DevicePtr<StepState> state,
                           const StepRule& rule) const override {
    HPS_QUEUE("update_step_state");
    queue->enqueue([state, rule] { advance_step_state(*state.get(), rule); }, "update_step_state");
    return Status::Ok();
  }

  Status sgd(Stream& stream, const SgdArgs& a) const override {
    HPS_QUEUE("sgd");
    queue->enqueue(
        [a] {
          const StepState& state = *a.state.get();
          if (state.skip != 0) return;
          cpu::sgd(a.param.get(), a.grad.get(), a.momentum.get(), a.count, a.hyper,
                   a.clip_coefficient.get(), 1.0f, state.applied_steps == 1);
        },
        "sgd");
    return Status::Ok();
  }

  Status adamw(Stream& stream, const AdamWArgs& a) const override {
    HPS_QUEUE("adamw");
    queue->enqueue(
        [a] {
          const StepState& state = *a.state.get();
          if (state.skip != 0) return;
          cpu::adamw(a.param.get(), a.grad.get(), a.exp_avg.get(), a.exp_avg_sq.get(), a.count,
                     a.hyper, AdamWConstants{state.adamw_step_size, state.adamw_bias2_sqrt},
                     a.clip_coefficient.get(), 1.0f);
        },
        "adamw");
    return Status::Ok();
  }
};

#undef HPS_QUEUE

}  // namespace

const Kernels& kernel_table() {
  static const CpuKernels table;
  return table;
}

}  // namespace cpu
}  // namespace hps
