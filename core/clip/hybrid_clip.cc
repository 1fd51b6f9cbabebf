#include "core/clip/hybrid_clip.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

#include "core/comm/agreement.h"

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

}  // namespace

HybridClip::HybridClip(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> mp,
                       std::shared_ptr<Communicator> pp, ClipOptions options)
    : sharding_(std::move(sharding)),
      mp_(std::move(mp)),
      pp_(std::move(pp)),
      failure_link_(Communicator::link_failures({sharding_.get(), mp_.get(), pp_.get()}, "clip")),
      options_(options),
      has_groups_(sharding_ || mp_ || pp_) {}

HybridClip::~HybridClip() { wait_in_flight(); }

void HybridClip::wait_in_flight() {
  for (const auto& work : in_flight_) (void)work->done_event().synchronize_uncounted();
  if (done_ && done_->recorded()) (void)done_->synchronize_uncounted();
}

void HybridClip::drop_groups() {
  wait_in_flight();
  in_flight_.clear();
  tensors_.clear();
  failure_link_.reset();
  sharding_.reset();
  mp_.reset();
  pp_.reset();
  dropped_ = true;
}

Status HybridClip::check_not_dropped() const {
  if (!dropped_) return Status::Ok();
  return failed_precondition("clip: its communicators were let go (its handle was destroyed)");
}

void HybridClip::mark_enqueued(Stream& stream) {
  if (!done_ || done_->device() != stream.device()) {
    auto event = create_event(stream.device());
    if (!event.ok()) {
      // Without an event the destructor cannot wait: wait now (set-up-time failure only).
      (void)stream.synchronize();
      return;
    }
    done_ = std::move(*event);
  }
  if (!done_->record(stream).ok()) (void)stream.synchronize();
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
    if (!kernels_for(d.type).ok()) {
      return unimplemented("clip: gradients on " + d.to_string() +
                           " need clip kernels this build does not have");
    }
    if (device && *device != d) {
      return invalid_argument("clip: the communicators are on different devices (" +
                              device->to_string() + " and " + d.to_string() + ")");
    }
    device = d;
  }
  // One communicator as two axes would count its ranks' partial norms twice.
  if ((sharding && (sharding == mp || sharding == pp)) || (mp && mp == pp)) {
    return invalid_argument(
        "clip: the same communicator is given for two of sharding, mp and pp (give none for "
        "an axis the job does not have)");
  }
  if (mp) HPS_RETURN_IF_ERROR(check_topology_axis(*mp, "mp", "clip"));
  if (pp) HPS_RETURN_IF_ERROR(check_topology_axis(*pp, "pp", "clip"));
  return std::unique_ptr<HybridClip>(
      new HybridClip(std::move(sharding), std::move(mp), std::move(pp), options));
}

Status HybridClip::add_tensor(const ClipTensor& tensor) {
  HPS_RETURN_IF_ERROR(check_not_dropped());
  if (sealed_) return failed_precondition("clip: add_tensor after seal()");
  if (!dtype_is_floating(tensor.dtype)) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) + " has dtype " +
                            std::string(dtype_name(tensor.dtype)) +
                            "; gradients must be float32, float64, float16 or bfloat16");
  }
  if (tensor.data == nullptr && tensor.count > 0) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) + " is null");
  }
  // The same bound as a collective's count: its bytes must fit a size_t (and 2^60 elements).
  const uint64_t element = dtype_size(tensor.dtype);
  if (tensor.count > (uint64_t{1} << 60) ||
      tensor.count > std::numeric_limits<size_t>::max() / element) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) + " has count " +
                            std::to_string(tensor.count) + ", whose byte size overflows");
  }
  const auto start = reinterpret_cast<uintptr_t>(tensor.data);
  if (tensor.count > 0 && start % element != 0) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) +
                            " is not aligned to its " + std::string(dtype_name(tensor.dtype)) +
                            " elements (" + std::to_string(element) + " bytes)");
  }
  // A gradient registered twice, or two that share memory, would be counted twice in the norm
  // and scaled twice.
  const uint64_t bytes = tensor.count * element;
  if (tensor.count > 0 && start > std::numeric_limits<uintptr_t>::max() - bytes) {
    return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) +
                            " runs past the end of the address space");
  }
  for (size_t i = 0; i < tensors_.size() && tensor.count > 0; ++i) {
    const ClipTensor& t = tensors_[i];
    const auto s = reinterpret_cast<uintptr_t>(t.data);
    const uint64_t b = t.count * dtype_size(t.dtype);
    if (b > 0 && start < s + b && s < start + bytes) {
      return invalid_argument("clip: tensor " + std::to_string(tensors_.size()) +
                              " overlaps tensor " + std::to_string(i) +
                              " (registered already): its elements would be counted and scaled "
                              "twice");
    }
  }
  tensors_.push_back(tensor);
  return Status::Ok();
}

Status HybridClip::allocate_state(Device device) {
  HPS_ASSIGN_OR_RETURN(kernels_, kernels_for(device.type));
  HPS_ASSIGN_OR_RETURN(DeviceBuffer memory, DeviceBuffer::allocate(device, sizeof(ClipState)));
  // The coefficient reads 1 until the first finish: written once at set-up and waited for.
  HPS_ASSIGN_OR_RETURN(auto stream, create_stream(device));
  const ClipState initial;
  HPS_RETURN_IF_ERROR(stream->memcpy_async(memory.data().get(), &initial, sizeof initial));
  HPS_RETURN_IF_ERROR(stream->synchronize());
  if (!state_.empty()) retired_.push_back(std::move(state_));
  state_ = std::move(memory);
  return Status::Ok();
}

Status HybridClip::seal() {
  HPS_RETURN_IF_ERROR(check_not_dropped());
  if (sealed_) return failed_precondition("clip: sealed twice");
  Device device = Device::cpu();
  for (const auto* c : {&sharding_, &mp_, &pp_}) {
    if (*c) device = (*c)->device();
  }
  // Small all-gathers at set-up; counted as host syncs, never in the step.
  Status mismatch = Status::Ok();
  if (reduces(mp_)) {
    const uint64_t mine = flags_fingerprint(tensors_);
    HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> all, gather_values(*mp_, mine));
    for (size_t r = 0; r < all.size() && mismatch.ok(); ++r) {
      if (all[r] != mine) {
        mismatch = invalid_argument(
            "clip: ranks of the mp group registered different gradients or flags (this rank: " +
            std::to_string(tensors_.size()) + " tensors; mp " +
            mp_->rank_names()(static_cast<int32_t>(r)) +
            " differs); is_distributed, need_clip and shared_not_first must match across mp");
      }
    }
  }
  // Every rank learns whether any mp group found a difference, so all refuse together: the
  // ranks of the other mp groups would otherwise wait in their first run() for peers that
  // never come.
  HPS_ASSIGN_OR_RETURN(uint64_t found,
                       combine_over({sharding_.get(), mp_.get(), pp_.get()}, mismatch.ok() ? 0 : 1,
                                    [](uint64_t a, uint64_t b) { return a | b; }));
  if (!mismatch.ok()) return mismatch;
  if (found != 0) {
    return invalid_argument(
        "clip: seal refused on every rank: ranks of an mp group registered different "
        "gradients or flags (those ranks name it in their errors)");
  }
  HPS_RETURN_IF_ERROR(allocate_state(device));
  sealed_ = true;
  return Status::Ok();
}

const float* HybridClip::coefficient() const {
  return state_.empty() ? nullptr : &state().get()->coefficient;  // an address, not a read
}

Status HybridClip::use_stream(Stream& stream) {
  HPS_RETURN_IF_ERROR(check_not_dropped());
  if (!sealed_) return failed_precondition("clip: run() before seal()");
  const Device device = stream.device();
  if (device == state_.device()) return Status::Ok();
  if (has_groups_) {
    return invalid_argument("clip: run() on a stream on " + device.to_string() +
                            " but the clip's communicators are on " + state_.device().to_string());
  }
  if (!kernels_for(device.type).ok()) {
    return unimplemented("clip: " + device.to_string() +
                         " streams need clip kernels this build does not have");
  }
  wait_in_flight();  // the old state may still be in use on the other device (set-up time)
  return allocate_state(device);
}

Status HybridClip::begin(Stream& stream) {
  HPS_RETURN_IF_ERROR(use_stream(stream));
  return stream.memset_async(state().get(), 0, offsetof(ClipState, coefficient_fp64));
}

Status HybridClip::finish(Stream& stream, float* norm_out) {
  HPS_RETURN_IF_ERROR(use_stream(stream));
  DevicePtr<ClipState> s = state();
  // D over sharding, mp and pp; N over sharding and pp — each group once, each collective
  // after the previous one, stream-side. Both partials travel in one buffer per group.
  Stream* last = &stream;
  std::shared_ptr<Work> work;
  in_flight_.clear();
  const std::pair<const std::shared_ptr<Communicator>*, bool> steps[] = {
      {&sharding_, true}, {&mp_, false}, {&pp_, true}};
  for (const auto& [group, both] : steps) {
    if (!reduces(*group)) continue;
    if (options_.deterministic) {
      // D's slots and N's slots are contiguous; over mp only D travels.
      int64_t* fixed = s.get()->fixed[0].slots.data();
      const size_t count = static_cast<size_t>(FixedSquares::kSlots) * (both ? 2 : 1);
      HPS_ASSIGN_OR_RETURN(work, (*group)->all_reduce(fixed, fixed, count, DType::kInt64,
                                                      ReduceOp::kSum, last, options_.tag));
      in_flight_.push_back(work);
    } else {
      double* partials = s.get()->partials;
      HPS_ASSIGN_OR_RETURN(work,
                           (*group)->all_reduce(partials, partials, both ? 2 : 1, DType::kFloat64,
                                                ReduceOp::kSum, last, options_.tag));
      in_flight_.push_back(work);
    }
    last = &(*group)->stream();
  }
  if (work) HPS_RETURN_IF_ERROR(work->wait_on(stream));
  HPS_RETURN_IF_ERROR(kernels_->finish_clip(stream, s, options_.deterministic, options_.max_norm));
  if (norm_out != nullptr) {
    HPS_RETURN_IF_ERROR(stream.memcpy_async(norm_out, &s.get()->norm, sizeof(float)));
  }
  return Status::Ok();
}

Status HybridClip::run(Stream& stream, float* norm_out, bool scale) {
  HPS_RETURN_IF_ERROR(begin(stream));
  // Whichever way this returns, what it enqueued is behind done_.
  struct Mark {
    HybridClip& clip;
    Stream& stream;
    ~Mark() { clip.mark_enqueued(stream); }
  } mark{*this, stream};
  DevicePtr<ClipState> s = state();
  for (const auto& t : tensors_) {
    if (!t.need_clip || t.shared_not_first) continue;
    const int which = t.is_distributed ? kClipPartialD : kClipPartialN;
    DevicePtr<const void> data(t.data);
    if (options_.deterministic) {
      HPS_RETURN_IF_ERROR(kernels_->sum_of_squares_fixed(
          stream, t.dtype, data, t.count, DevicePtr<FixedSquares>(&s.get()->fixed[which])));
    } else {
      HPS_RETURN_IF_ERROR(kernels_->sum_of_squares(stream, t.dtype, data, t.count,
                                                   DevicePtr<double>(&s.get()->partials[which])));
    }
  }
  HPS_RETURN_IF_ERROR(finish(stream, norm_out));
  if (!scale) return Status::Ok();
  for (const auto& t : tensors_) {
    if (!t.need_clip) continue;
    HPS_RETURN_IF_ERROR(kernels_->scale(stream, t.dtype, DevicePtr<void>(t.data), t.count, s));
  }
  return Status::Ok();
}

}  // namespace hps
