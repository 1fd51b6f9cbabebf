#include "core/sharding/sharded_engine.h"

#include <cmath>
#include <cstring>

#include "core/kernels/cast.h"
#include "core/kernels/norm.h"
#include "core/sharding/stage2_engine.h"
#include "core/sharding/stage3_engine.h"

namespace hps {

Status check_engine_arguments(const std::shared_ptr<Communicator>& sharding,
                              const std::shared_ptr<Communicator>& dp, const EngineOptions& options,
                              DeviceType device) {
  if (!sharding) return invalid_argument("engine: the sharding communicator is null");
  for (const auto* c : {&sharding, &dp}) {
    if (*c && (*c)->device().type != device) {
      return invalid_argument("engine: a communicator is on " + (*c)->device().to_string() +
                              " and this engine works on " +
                              (device == DeviceType::kCpu ? "the cpu" : "CUDA devices"));
    }
  }
  if (dp && !(dp->device() == sharding->device())) {
    return invalid_argument("engine: the dp and sharding communicators are on different devices");
  }
  if (options.accumulation_steps < 1) {
    return invalid_argument("engine: accumulation_steps must be >= 1");
  }
  if (!(options.clip_max_norm >= 0)) return invalid_argument("engine: clip_max_norm must be >= 0");
  if (options.optimizer != OptimizerKind::kSgd && options.optimizer != OptimizerKind::kAdamW) {
    return invalid_argument("engine: unknown optimizer");
  }
  if (options.prefetch_window < 1) return invalid_argument("engine: prefetch_window must be >= 1");
  if (options.dynamic_loss_scaling &&
      (!(options.initial_loss_scale > 0) || !std::isfinite(options.initial_loss_scale) ||
       !(options.growth_factor >= 1) ||
       !(options.backoff_factor > 0 && options.backoff_factor < 1) ||
       options.growth_interval < 1)) {
    return invalid_argument(
        "engine: loss scaling needs initial_loss_scale > 0, growth_factor >= 1, 0 < "
        "backoff_factor < 1 and growth_interval >= 1");
  }
  return Status::Ok();
}

Status check_same_model(Communicator& comm, const LayoutPlan& plan) {
  if (comm.size() == 1) return Status::Ok();
  const uint64_t mine = plan.fingerprint();
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  HPS_ASSIGN_OR_RETURN(auto work, comm.all_gather(&mine, all.data(), 1, DType::kInt64));
  HPS_RETURN_IF_ERROR(work->wait());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] != mine) {
      return invalid_argument("engine: rank " + std::to_string(r) + " of group '" + comm.name() +
                              "' registered different parameters (names, shapes, dtypes, flags "
                              "or units differ from this rank's " +
                              std::to_string(plan.params().size()) + ")");
    }
  }
  return Status::Ok();
}

void split_buffer(const LayoutPlan& plan, size_t b, const std::vector<float>& full,
                  std::vector<std::vector<float>>& out) {
  for (size_t i : plan.buffers()[b].params) {
    const Placement& p = plan.placement(i);
    out[i].assign(full.begin() + static_cast<std::ptrdiff_t>(p.offset),
                  full.begin() + static_cast<std::ptrdiff_t>(p.offset + p.numel));
  }
}

Status check_param_index(const LayoutPlan& plan, size_t index) {
  if (index < plan.params().size()) return Status::Ok();
  return out_of_range("engine: no parameter " + std::to_string(index));
}

Status check_trainable(const LayoutPlan& plan, size_t index, const char* what) {
  if (plan.buffers()[plan.placement(index).buffer].trainable) return Status::Ok();
  return failed_precondition("engine: parameter '" + plan.params()[index].name + "' " + what);
}

Status not_gathered(const LayoutPlan& plan, size_t index) {
  return failed_precondition("engine: parameter '" + plan.params()[index].name + "' of unit " +
                             std::to_string(plan.buffers()[plan.placement(index).buffer].unit) +
                             " is not gathered: call gather(unit) first (stage 3)");
}

Status seal_plan(LayoutPlan& plan, bool sealed, Communicator& sharding, Communicator* dp,
                 uint64_t alignment_bytes) {
  if (sealed) return failed_precondition("engine: sealed twice");
  if (plan.params().empty()) return failed_precondition("engine: no parameters registered");
  HPS_RETURN_IF_ERROR(check_same_model(sharding, plan));
  if (dp) HPS_RETURN_IF_ERROR(check_same_model(*dp, plan));
  return plan.seal(sharding.size(), alignment_bytes);
}

Status check_float32_view(const LayoutPlan& plan, size_t index) {
  const DType d = plan.buffers()[plan.placement(index).buffer].dtype;
  if (d == DType::kFloat32) return Status::Ok();
  return failed_precondition("engine: parameter '" + plan.params()[index].name + "' is " +
                             std::string(dtype_name(d)) + ": use its data view");
}

StatusOr<size_t> add_engine_param(LayoutPlan& plan, ParamSpec spec) {
  if (plan.sealed()) {
    return failed_precondition("engine: parameter '" + spec.name + "' registered after seal()");
  }
  if (spec.dtype != DType::kFloat32 && spec.dtype != DType::kFloat16 &&
      spec.dtype != DType::kBFloat16) {
    return unimplemented("engine: parameter '" + spec.name + "' is " +
                         std::string(dtype_name(spec.dtype)) +
                         "; parameters must be float32, float16 or bfloat16");
  }
  HPS_RETURN_IF_ERROR(plan.add(std::move(spec)));
  return plan.params().size() - 1;
}

std::vector<float*> shard_pointers(std::vector<std::vector<float>>& shards) {
  std::vector<float*> out;
  for (auto& s : shards) out.push_back(s.empty() ? nullptr : s.data());
  return out;
}

StatusOr<std::unique_ptr<HybridClip>> make_shard_clip(std::shared_ptr<Communicator> sharding,
                                                      const EngineOptions& options,
                                                      const LayoutPlan& plan,
                                                      const std::vector<float*>& grad_shards) {
  if (options.clip_max_norm <= 0) return std::unique_ptr<HybridClip>();
  const int32_t rank = sharding->rank();
  HPS_ASSIGN_OR_RETURN(auto clip,
                       HybridClip::create(sharding, nullptr, nullptr,
                                          {options.clip_max_norm, options.deterministic_clip}));
  for (size_t i = 0; i < plan.params().size(); ++i) {
    const ParamSpec& p = plan.params()[i];
    const Placement& pl = plan.placement(i);
    if (!plan.buffers()[pl.buffer].trainable) continue;
    const auto [lo, hi] = plan.local_part(i, rank);
    if (lo == hi) continue;
    const uint64_t shard_begin = plan.shard(pl.buffer, rank).first;
    float* data = grad_shards[pl.buffer] + (pl.offset + lo - shard_begin);
    HPS_RETURN_IF_ERROR(clip->add_tensor(
        {data, hi - lo, DType::kFloat32, p.is_distributed, p.need_clip, p.shared_not_first}));
  }
  HPS_RETURN_IF_ERROR(clip->seal());
  return clip;
}

Status enqueue_unscale_and_check(cpu::CpuStream& opt, StepState* state,
                                 const std::vector<ShardGradients>& grads, float mean_scale,
                                 const EngineOptions& options, Communicator& sharding,
                                 Communicator* dp) {
  const bool check = options.dynamic_loss_scaling;
  opt.enqueue([state, grads, mean_scale, check] {
    // The loss scale is read here, in stream order: the previous step's update is done.
    const float factor = mean_scale / state->loss_scale;
    int32_t found = 0;
    for (const auto& g : grads) {
      if (g.full != nullptr) std::memset(g.full, 0, g.full_bytes);
      if (g.reduced != nullptr)
        cpu::cast(g.reduced_dtype, g.reduced, DType::kFloat32, g.shard, g.shard_count);
      cpu::scale(DType::kFloat32, g.shard, g.shard_count, factor);
      if (check && found == 0 &&
          !std::isfinite(cpu::sum_of_squares(DType::kFloat32, g.shard, g.shard_count))) {
        found = 1;
      }
    }
    state->found_inf = found;
  });
  if (!check) return Status::Ok();
  // Every rank skips or steps together: the flag is the max over the groups.
  Stream* after = &opt;
  std::shared_ptr<Work> work;
  for (Communicator* c : {&sharding, dp}) {
    if (c == nullptr || c->size() == 1) continue;
    HPS_ASSIGN_OR_RETURN(work, c->all_reduce(&state->found_inf, &state->found_inf, 1, DType::kInt32,
                                             ReduceOp::kMax, after));
    after = &c->stream();
  }
  if (work) HPS_RETURN_IF_ERROR(work->wait_on(opt));
  return Status::Ok();
}

void enqueue_optimizer(cpu::CpuStream& opt, StepState* state, const EngineOptions& options,
                       float* param, float* grad, float* state_a, float* state_b, size_t count,
                       const float* clip_coefficient) {
  const EngineOptions o = options;
  opt.enqueue([o, state, param, grad, state_a, state_b, count, clip_coefficient] {
    if (state->skip != 0) return;               // a skipped step changes no parameter or state
    const int64_t step = state->applied_steps;  // counted by the step update, before us
    if (o.optimizer == OptimizerKind::kAdamW) {
      cpu::adamw(param, grad, state_a, state_b, count, o.adamw, static_cast<long>(step),
                 clip_coefficient, 1.0f);
    } else {
      cpu::sgd(param, grad, state_a, count, o.sgd, clip_coefficient, 1.0f, step == 1);
    }
  });
}

void enqueue_step_update(cpu::CpuStream& opt, StepState* state, const EngineOptions& options) {
  const EngineOptions o = options;
  opt.enqueue([o, state] {
    if (state->found_inf != 0) {
      ++state->skipped_steps;
      state->good_steps = 0;
      state->loss_scale *= o.backoff_factor;
      state->found_inf = 0;
      state->skip = 1;
      return;
    }
    state->skip = 0;
    ++state->applied_steps;
    if (o.dynamic_loss_scaling && ++state->good_steps >= o.growth_interval) {
      state->loss_scale *= o.growth_factor;
      state->good_steps = 0;
    }
  });
}

StatusOr<std::unique_ptr<ShardedEngine>> create_sharded_engine(
    int32_t stage, std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options) {
  if (sharding && sharding->device().type == DeviceType::kCuda) {
    return unimplemented("engine: CUDA communicators need the device-neutral engines");
  }
  if (stage == 2) {
    HPS_ASSIGN_OR_RETURN(auto e, Stage2Engine::create(std::move(sharding), std::move(dp), options));
    return std::unique_ptr<ShardedEngine>(std::move(e));
  }
  if (stage == 3) {
    HPS_ASSIGN_OR_RETURN(auto e, Stage3Engine::create(std::move(sharding), std::move(dp), options));
    return std::unique_ptr<ShardedEngine>(std::move(e));
  }
  return invalid_argument("engine: stage must be 2 or 3, not " + std::to_string(stage));
}

}  // namespace hps
