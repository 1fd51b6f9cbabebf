#include "core/clip/hybrid_clip.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <optional>

#include "core/common/config.h"
#include "core/device/allocator.h"
#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"

#if HPS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/device/cuda/error.h"
#include "core/device/cuda/stream.h"
#endif

namespace hps {
namespace {

bool reduces(const std::shared_ptr<Communicator>& c) { return c && c->size() > 1; }

// FNV-1a over the registered flags: what every mp rank must agree on.
uint64_t flags_fingerprint(const std::vector<ClipTensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  mix(tensors.size());
  for (const auto& t : tensors) {
    mix((t.is_distributed ? 1u : 0u) | (t.need_clip ? 2u : 0u) | (t.shared_not_first ? 4u : 0u));
  }
  return h;
}

// The clip's device memory on CUDA: what travels (as in State), the coefficient in fp32
// (for fused optimizers) and fp64 (for fp64 gradients), then the reduction scratch.
struct DeviceState {
  double partials[2];
  FixedSquares fixed[2];
  double coefficient_fp64;
  float coefficient;
};
constexpr size_t kScratchOffset = (sizeof(DeviceState) + 255) / 256 * 256;

template <typename T>
T* device_field(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

HybridClip::HybridClip(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> mp,
                       std::shared_ptr<Communicator> pp, ClipOptions options)
    : sharding_(std::move(sharding)),
      mp_(std::move(mp)),
      pp_(std::move(pp)),
      options_(options),
      state_(std::make_unique<State>()) {
  for (const auto* c : {&sharding_, &mp_, &pp_}) {
    if (*c) device_ = (*c)->device();
  }
}

HybridClip::~HybridClip() {
  if (device_memory_ == nullptr) return;
  auto allocator = allocator_for(device_);
  if (allocator.ok()) (*allocator)->deallocate(device_memory_);
}

StatusOr<std::unique_ptr<HybridClip>> HybridClip::create(std::shared_ptr<Communicator> sharding,
                                                         std::shared_ptr<Communicator> mp,
                                                         std::shared_ptr<Communicator> pp,
                                                         const ClipOptions& options) {
  if (!(options.max_norm > 0) || !std::isfinite(options.max_norm)) {
    return invalid_argument("clip: max_norm must be positive and finite, not " +
                            std::to_string(options.max_norm));
  }
  std::optional<Device> device;
  for (const auto* c : {&sharding, &mp, &pp}) {
    if (!*c) continue;
    const Device d = (*c)->device();
    if (d.type != DeviceType::kCpu && !(d.type == DeviceType::kCuda && HPS_HAVE_CUDA)) {
      return unimplemented("clip: gradients on " + d.to_string() +
                           " need clip kernels this build does not have");
    }
    if (device && *device != d) {
      return invalid_argument("clip: the communicators are on different devices (" +
                              device->to_string() + " and " + d.to_string() + ")");
    }
    device = d;
  }
  return std::unique_ptr<HybridClip>(
      new HybridClip(std::move(sharding), std::move(mp), std::move(pp), options));
}

Status HybridClip::add_tensor(const ClipTensor& tensor) {
  if (sealed_) return failed_precondition("clip: add_tensor after seal()");
  if (!dtype_is_floating(tensor.dtype)) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) + " has dtype " +
                            std::string(dtype_name(tensor.dtype)) +
                            "; gradients must be float32, float64, float16 or bfloat16");
  }
  if (tensor.data == nullptr && tensor.count > 0) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) + " is null");
  }
  tensors_.push_back(tensor);
  return Status::Ok();
}

Status HybridClip::seal() {
  if (sealed_) return failed_precondition("clip: sealed twice");
  if (device_.type == DeviceType::kCuda) HPS_RETURN_IF_ERROR(allocate_device_state(device_, true));
  if (reduces(mp_)) {
    // One small all-gather at set-up; counted as a host sync, never in the step.
    const uint64_t mine = flags_fingerprint(tensors_);
    std::vector<uint64_t> all(static_cast<size_t>(mp_->size()));
    if (mp_->device().type == DeviceType::kCpu) {
      HPS_ASSIGN_OR_RETURN(auto work, mp_->all_gather(&mine, all.data(), 1, DType::kInt64));
      HPS_RETURN_IF_ERROR(work->wait());
    } else {
      HPS_RETURN_IF_ERROR(check_mp_flags_on_device(mine, all));
    }
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] != mine) {
        return invalid_argument(
            "clip: ranks of the mp group registered different gradients or flags (this rank: " +
            std::to_string(tensors_.size()) + " tensors; mp rank " + std::to_string(r) +
            " differs); is_distributed, need_clip and shared_not_first must match across mp");
      }
    }
  }
  sealed_ = true;
  return Status::Ok();
}

StatusOr<std::shared_ptr<Work>> HybridClip::reduce_over(Communicator& comm, bool both,
                                                        Stream& after) {
  State* s = state_.get();
  // On CUDA the same layout lives in device memory (DeviceState).
  int64_t* fixed = device_memory_ != nullptr
                       ? device_field<int64_t>(device_memory_, offsetof(DeviceState, fixed))
                       : s->fixed[0].slots.data();
  double* partials = device_memory_ != nullptr
                         ? device_field<double>(device_memory_, offsetof(DeviceState, partials))
                         : s->partials;
  if (options_.deterministic) {
    // D's slots and N's slots are contiguous; over mp only D travels.
    const size_t count = static_cast<size_t>(FixedSquares::kSlots) * (both ? 2 : 1);
    return comm.all_reduce(fixed, fixed, count, DType::kInt64, ReduceOp::kSum, &after);
  }
  return comm.all_reduce(partials, partials, both ? 2 : 1, DType::kFloat64, ReduceOp::kSum, &after);
}

#if HPS_HAVE_CUDA

Status HybridClip::check_mp_flags_on_device(uint64_t mine, std::vector<uint64_t>& all) {
  HPS_ASSIGN_OR_RETURN(Allocator * allocator, allocator_for(mp_->device()));
  HPS_ASSIGN_OR_RETURN(void* memory, allocator->allocate((all.size() + 1) * sizeof(uint64_t)));
  auto* fingerprints = static_cast<uint64_t*>(memory);
  const Status status = [&]() -> Status {
    HPS_RETURN_IF_ERROR(mp_->stream().memcpy_async(fingerprints, &mine, sizeof(mine)));
    HPS_ASSIGN_OR_RETURN(auto work,
                         mp_->all_gather(fingerprints, fingerprints + 1, 1, DType::kInt64));
    HPS_RETURN_IF_ERROR(work->wait());
    // The gathered fingerprints come back to the host once, at set-up.
    count_host_sync(HostSyncKind::kDeviceToHostRead);
    return cuda::cuda_status(cudaMemcpy(all.data(), fingerprints + 1, all.size() * sizeof(uint64_t),
                                        cudaMemcpyDeviceToHost),
                             "clip: cudaMemcpy of the mp flags");
  }();
  allocator->deallocate(memory);
  return status;
}

Status HybridClip::allocate_device_state(Device device, bool initialize_coefficient) {
  if (device_memory_ != nullptr) return Status::Ok();
  HPS_ASSIGN_OR_RETURN(Allocator * allocator, allocator_for(device));
  HPS_ASSIGN_OR_RETURN(
      device_memory_,
      allocator->allocate(kScratchOffset + cuda::kSumOfSquaresMaxBlocks * sizeof(double)));
  device_ = device;
  device_coefficient_ = device_field<float>(device_memory_, offsetof(DeviceState, coefficient));
  // The coefficient reads 1 until the first run(), as on the CPU (a copy at set-up; from
  // run() the finish_clip kernel writes it before any reader in stream order).
  if (!initialize_coefficient) return Status::Ok();
  const float one = 1.0f;
  return cuda::cuda_status(
      cudaMemcpy(device_coefficient_, &one, sizeof(one), cudaMemcpyHostToDevice),
      "clip: cudaMemcpy of the initial coefficient");
}

Status HybridClip::run_cuda(Stream& stream, float* norm_out, bool scale) {
  const Device device = stream.device();
  if (device_memory_ != nullptr || device_.type == DeviceType::kCuda) {
    if (device != device_) {
      return invalid_argument("clip: run() on a stream on " + device.to_string() +
                              " but the clip's gradients are on " + device_.to_string());
    }
  } else if (sharding_ || mp_ || pp_) {
    return invalid_argument("clip: run() on a stream on " + device.to_string() +
                            " but the communicators are on " + device_.to_string());
  }
  HPS_RETURN_IF_ERROR(allocate_device_state(device, false));
  HPS_RETURN_IF_ERROR(cuda::set_device(device.index));
  cudaStream_t native = static_cast<cuda::CudaStream&>(stream).native();
  double* partials = device_field<double>(device_memory_, offsetof(DeviceState, partials));
  auto* fixed = device_field<FixedSquares>(device_memory_, offsetof(DeviceState, fixed));
  auto* coefficient_fp64 =
      device_field<double>(device_memory_, offsetof(DeviceState, coefficient_fp64));
  double* scratch = device_field<double>(device_memory_, kScratchOffset);
  const bool deterministic = options_.deterministic;

  // 1. The local partial sums, on the caller's stream.
  HPS_RETURN_IF_ERROR(cuda::cuda_status(
      cudaMemsetAsync(device_memory_, 0, offsetof(DeviceState, coefficient_fp64), native),
      "clip: cudaMemsetAsync of the partial sums"));
  for (const auto& t : tensors_) {
    if (!t.need_clip || t.shared_not_first) continue;
    const int which = t.is_distributed ? 0 : 1;
    if (deterministic) {
      HPS_RETURN_IF_ERROR(
          cuda::sum_of_squares_fixed(t.dtype, t.data, t.count, &fixed[which], native));
    } else {
      HPS_RETURN_IF_ERROR(
          cuda::sum_of_squares(t.dtype, t.data, t.count, &partials[which], scratch, native));
    }
  }

  // 2. The same groups as the CPU path, each collective after the previous one.
  Stream* last = &stream;
  std::shared_ptr<Work> work;
  const std::pair<std::shared_ptr<Communicator>*, bool> steps[] = {
      {&sharding_, true}, {&mp_, false}, {&pp_, true}};
  for (const auto& [group, both] : steps) {
    if (!reduces(*group)) continue;
    HPS_ASSIGN_OR_RETURN(work, reduce_over(**group, both, *last));
    last = &(*group)->stream();
  }
  if (work) HPS_RETURN_IF_ERROR(work->wait_on(stream));

  // 3. The norm and the coefficient on the device, then the scaling.
  HPS_RETURN_IF_ERROR(cuda::finish_clip(partials, fixed, deterministic, options_.max_norm, norm_out,
                                        device_coefficient_, coefficient_fp64, native));
  if (!scale) return Status::Ok();
  for (const auto& t : tensors_) {
    if (!t.need_clip) continue;
    HPS_RETURN_IF_ERROR(cuda::scale(t.dtype, t.data, t.count, coefficient_fp64, native));
  }
  return Status::Ok();
}

#else

Status HybridClip::check_mp_flags_on_device(uint64_t, std::vector<uint64_t>&) {
  return unimplemented("clip: this build has no CUDA");
}
Status HybridClip::allocate_device_state(Device, bool) {
  return unimplemented("clip: this build has no CUDA");
}
Status HybridClip::run_cuda(Stream&, float*, bool) {
  return unimplemented("clip: this build has no CUDA");
}

#endif

Status HybridClip::run(Stream& stream, float* norm_out, bool scale) {
  if (!sealed_) return failed_precondition("clip: run() before seal()");
  if (stream.device().type == DeviceType::kCuda && HPS_HAVE_CUDA) {
    return run_cuda(stream, norm_out, scale);
  }
  if (stream.device().type != DeviceType::kCpu) {
    return unimplemented("clip: " + stream.device().to_string() +
                         " streams need clip kernels this build does not have");
  }
  if (device_.type != DeviceType::kCpu) {
    return invalid_argument("clip: run() on a CPU stream but the gradients are on " +
                            device_.to_string());
  }
  auto& cpu_stream = static_cast<cpu::CpuStream&>(stream);
  State* s = state_.get();
  const bool deterministic = options_.deterministic;
  const std::vector<ClipTensor>* tensors = &tensors_;

  // 1. The local partial sums, on the caller's stream.
  cpu_stream.enqueue([s, tensors, deterministic] {
    s->partials[0] = s->partials[1] = 0;
    s->fixed[0] = FixedSquares{};
    s->fixed[1] = FixedSquares{};
    for (const auto& t : *tensors) {
      if (!t.need_clip || t.shared_not_first) continue;
      const int which = t.is_distributed ? 0 : 1;
      if (deterministic) {
        cpu::sum_of_squares_fixed(t.dtype, t.data, t.count, s->fixed[which]);
      } else {
        s->partials[which] += cpu::sum_of_squares(t.dtype, t.data, t.count);
      }
    }
  });

  // 2. D over sharding, mp and pp; N over sharding and pp — each group once, each
  // collective waiting on the previous one stream-side.
  Stream* last = &stream;
  std::shared_ptr<Work> work;
  const std::pair<std::shared_ptr<Communicator>*, bool> steps[] = {
      {&sharding_, true}, {&mp_, false}, {&pp_, true}};
  for (const auto& [group, both] : steps) {
    if (!reduces(*group)) continue;
    HPS_ASSIGN_OR_RETURN(work, reduce_over(**group, both, *last));
    last = &(*group)->stream();
  }
  if (work) HPS_RETURN_IF_ERROR(work->wait_on(stream));

  // 3. The norm, the coefficient and the scaling, on the caller's stream again.
  const double max_norm = options_.max_norm;
  cpu_stream.enqueue([s, tensors, deterministic, max_norm, norm_out, scale] {
    const double squares =
        deterministic ? s->fixed[0].value() + s->fixed[1].value() : s->partials[0] + s->partials[1];
    const double norm = std::sqrt(squares);
    // NaN stays NaN (torch's clip_grad_norm_ without error_if_nonfinite); Inf gives 0.
    const double denominator = (norm < max_norm ? max_norm : norm) + 1e-6;
    const double coefficient = max_norm / denominator;
    s->coefficient = static_cast<float>(coefficient);
    if (norm_out != nullptr) *norm_out = static_cast<float>(norm);
    if (!scale) return;
    for (const auto& t : *tensors) {
      if (t.need_clip) cpu::scale(t.dtype, t.data, t.count, coefficient);
    }
  });
  return Status::Ok();
}

}  // namespace hps
