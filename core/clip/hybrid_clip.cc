#include "core/clip/hybrid_clip.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <optional>

#include "core/common/config.h"
#include "core/device/allocator.h"
#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"

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

Status HybridClip::check_mp_flags_on_device(uint64_t, std::vector<uint64_t>&) {
  return unimplemented("clip: CUDA gradients need the kernel table's clip");
}
Status HybridClip::allocate_device_state(Device, bool) {
  return unimplemented("clip: CUDA gradients need the kernel table's clip");
}
Status HybridClip::run_cuda(Stream&, float*, bool) {
  return unimplemented("clip: CUDA gradients need the kernel table's clip");
}

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
