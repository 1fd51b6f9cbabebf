#include "core/sharding/sharded_optimizer.h"

namespace hps {

void ShardedOptimizer::drop_groups() {
  groups_ = {};
  if (clip_) clip_->drop_groups();
}

std::vector<RoleLayout> ShardedOptimizer::state_roles(const EngineOptions& options) {
  auto trainable = [](const FlatBuffer& b) { return b.trainable; };
  if (options.optimizer == OptimizerKind::kAdamW) {
    return {{StorageRole::kExpAvg, false, false, trainable},
            {StorageRole::kExpAvgSq, false, false, trainable}};
  }
  if (options.sgd.momentum != 0.0f) return {{StorageRole::kMomentum, false, false, trainable}};
  return {};
}

StatusOr<std::unique_ptr<ShardedOptimizer>> ShardedOptimizer::create(const EngineOptions& options,
                                                                     Device device,
                                                                     const ShardedStorage& storage,
                                                                     StepGroups groups,
                                                                     Stream& stream) {
  std::unique_ptr<ShardedOptimizer> o(new ShardedOptimizer());
  o->options_ = options;
  HPS_ASSIGN_OR_RETURN(o->kernels_, kernels_for(device.type));
  o->storage_ = &storage;
  o->groups_ = std::move(groups);
  if (options.clip_max_norm > 0) {
    // Not over dp: its replicas hold the same reduced gradients.
    const StepGroups& g = o->groups_;
    HPS_ASSIGN_OR_RETURN(
        o->clip_,
        HybridClip::create(g.sharding, g.mp, g.pp,
                           {options.clip_max_norm, options.deterministic_clip, kEngineClipTag}));
    HPS_RETURN_IF_ERROR(o->clip_->seal());
  }
  HPS_ASSIGN_OR_RETURN(o->state_, DeviceBuffer::allocate(device, sizeof(StepState)));
  StepState initial;
  initial.loss_scale = options.dynamic_loss_scaling ? options.initial_loss_scale : 1.0f;
  HPS_RETURN_IF_ERROR(o->kernels_->write_step_state(stream, o->state(), initial));
  o->rule_ = {options.dynamic_loss_scaling,
              options.growth_factor,
              options.backoff_factor,
              options.growth_interval,
              options.optimizer == OptimizerKind::kAdamW,
              options.adamw};
  return o;
}

Status ShardedOptimizer::optimize(Stream& stream, const ShardStep& shard,
                                  const ShardSpan& span) const {
  const size_t count = span.end - span.begin;
  if (count == 0) return Status::Ok();
  const size_t b = shard.buffer;
  DevicePtr<const float> coefficient;
  if (clip_ && span.clipped) coefficient = DevicePtr<const float>(clip_->coefficient());
  DevicePtr<float> param = shard.master + span.begin;
  DevicePtr<const float> grad = shard.grad + span.begin;
  if (options_.optimizer == OptimizerKind::kAdamW) {
    AdamWHyper h = options_.adamw;
    if (!span.decayed) h.weight_decay = 0.0f;
    return kernels_->adamw(
        stream, {param, grad, storage_->get<float>(StorageRole::kExpAvg, b) + span.begin,
                 storage_->get<float>(StorageRole::kExpAvgSq, b) + span.begin, count, h, state(),
                 coefficient});
  }
  SgdHyper h = options_.sgd;
  if (!span.decayed) h.weight_decay = 0.0f;
  DevicePtr<float> momentum = storage_->get<float>(StorageRole::kMomentum, b);
  if (momentum) momentum = momentum + span.begin;
  return kernels_->sgd(stream, {param, grad, momentum, count, h, state(), coefficient});
}

Status ShardedOptimizer::unscale(Stream& stream, const ShardStep& s, float mean_scale) const {
  // One pass per run of equal partial: the spans' other differences (clip scaling, weight
  // decay) are the optimizer's, not the unscale's.
  for (size_t k = 0; k < s.spans.size();) {
    const ShardSpan& span = s.spans[k];
    uint64_t end = span.end;
    for (++k; k < s.spans.size() && s.spans[k].partial == span.partial; ++k) end = s.spans[k].end;
    UnscaleArgs a;
    a.src = s.grad + span.begin;
    a.dst = s.grad + span.begin;
    a.count = end - span.begin;
    a.mean_scale = mean_scale;
    a.state = state();
    a.check_finite = options_.dynamic_loss_scaling;
    if (clip_) a.clip = clip_->state();
    a.partial = clip_ ? span.partial : -1;
    a.deterministic = options_.deterministic_clip;
    HPS_RETURN_IF_ERROR(kernels_->unscale(stream, a));
  }
  return Status::Ok();
}

Status ShardedOptimizer::begin_step(Stream& stream) {
  if (begun_) return Status::Ok();
  // The previous step's verdict reset found_inf; the partials start from zero.
  if (clip_) HPS_RETURN_IF_ERROR(clip_->begin(stream));
  begun_ = true;
  return Status::Ok();
}

Status ShardedOptimizer::reduced(Stream& stream, const ShardStep& s, float mean_scale,
                                 const std::function<Status()>& wait_reduced) {
  if (!unscales_early()) return Status::Ok();
  HPS_RETURN_IF_ERROR(begin_step(stream));
  HPS_RETURN_IF_ERROR(wait_reduced());
  HPS_RETURN_IF_ERROR(unscale(stream, s, mean_scale));
  if (unscaled_.size() <= s.buffer) unscaled_.resize(s.buffer + 1, 0);
  unscaled_[s.buffer] = 1;
  return Status::Ok();
}

Status ShardedOptimizer::step(Stream& stream, const std::vector<ShardStep>& shards,
                              float mean_scale, const std::function<Status(size_t)>& wait_reduced,
                              const std::function<Status(size_t)>& updated) {
  const bool check = options_.dynamic_loss_scaling;
  auto unscaled = [&](const ShardStep& s) {
    return s.buffer < unscaled_.size() && unscaled_[s.buffer] != 0;
  };
  // The full gradients are zeroed at the step, not at the reduction: the framework may
  // read them until it calls step().
  auto consumed = [&](const ShardStep& s) -> Status {
    if (!s.consumed) return Status::Ok();
    return stream.memset_async(s.consumed.get(), 0, s.consumed_bytes);
  };
  auto update = [&](const ShardStep& s) -> Status {
    for (const ShardSpan& span : s.spans) HPS_RETURN_IF_ERROR(optimize(stream, s, span));
    if (s.rounded) {
      HPS_RETURN_IF_ERROR(
          kernels_->cast(stream, DType::kFloat32, s.master, s.rounded_dtype, s.rounded, s.count));
    }
    return updated(s.buffer);
  };

  if (!clip_ && !check) {
    // Nothing global in this step: each buffer's update (and the stage's hook: its
    // all-gather) starts as soon as its own reduction is done.
    HPS_RETURN_IF_ERROR(kernels_->update_step_state(stream, state(), rule_));
    for (const ShardStep& s : shards) {
      HPS_RETURN_IF_ERROR(wait_reduced(s.buffer));
      HPS_RETURN_IF_ERROR(unscale(stream, s, mean_scale));
      HPS_RETURN_IF_ERROR(consumed(s));
      HPS_RETURN_IF_ERROR(update(s));
    }
    return Status::Ok();
  }
  // The clip's norm and the found-inf flag need every reduced shard first. Most were
  // unscaled by reduced() as their reductions completed; the rest are unscaled now.
  HPS_RETURN_IF_ERROR(begin_step(stream));
  for (const ShardStep& s : shards) {
    if (!unscaled(s)) HPS_RETURN_IF_ERROR(wait_reduced(s.buffer));
  }
  for (const ShardStep& s : shards) {
    if (!unscaled(s)) HPS_RETURN_IF_ERROR(unscale(stream, s, mean_scale));
    HPS_RETURN_IF_ERROR(consumed(s));
  }
  begun_ = false;
  std::fill(unscaled_.begin(), unscaled_.end(), 0);
  if (check) {
    // Every rank skips or steps together: the flag is the max over the groups.
    int32_t* found = &state().get()->found_inf;  // an address: the collectives read it
    Stream* after = &stream;
    std::shared_ptr<Work> work;
    for (Communicator* c :
         {groups_.sharding.get(), groups_.dp.get(), groups_.mp.get(), groups_.pp.get()}) {
      if (c == nullptr || c->size() == 1) continue;
      HPS_ASSIGN_OR_RETURN(work, c->all_reduce(found, found, 1, DType::kInt32, ReduceOp::kMax,
                                               after, kEngineFoundInfTag));
      after = &c->stream();
    }
    if (work) HPS_RETURN_IF_ERROR(work->wait_on(stream));
  }
  if (clip_) HPS_RETURN_IF_ERROR(clip_->finish(stream, nullptr));
  HPS_RETURN_IF_ERROR(kernels_->update_step_state(stream, state(), rule_));
  // Each buffer's hook (an all-gather) waits only for the updates enqueued before it: the
  // first buffers' parameters travel while the later ones are still being updated.
  for (const ShardStep& s : shards) HPS_RETURN_IF_ERROR(update(s));
  return Status::Ok();
}

}  // namespace hps
