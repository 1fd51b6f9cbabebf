#include "core/sharding/stage2_engine.h"

#include <algorithm>
#include <cstring>

#include "core/device/host_sync.h"
#include "core/kernels/cast.h"
#include "core/kernels/norm.h"
#include "core/trace/trace.h"

namespace hps {

Stage2Engine::Stage2Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
                           EngineOptions options)
    : sharding_(std::move(sharding)),
      dp_(std::move(dp)),
      options_(options),
      optimizer_stream_(std::make_unique<cpu::CpuStream>()) {}

Stage2Engine::~Stage2Engine() { (void)synchronize(); }

StatusOr<std::unique_ptr<Stage2Engine>> Stage2Engine::create(std::shared_ptr<Communicator> sharding,
                                                             std::shared_ptr<Communicator> dp,
                                                             const EngineOptions& options) {
  HPS_RETURN_IF_ERROR(check_engine_arguments(sharding, dp, options));
  return std::unique_ptr<Stage2Engine>(
      new Stage2Engine(std::move(sharding), std::move(dp), options));
}

StatusOr<size_t> Stage2Engine::add_param(ParamSpec spec) {
  return add_engine_param(plan_, std::move(spec));
}

Status Stage2Engine::seal() {
  HPS_RETURN_IF_ERROR(seal_plan(plan_, sealed_, *sharding_, dp_.get(), options_.alignment_bytes));
  const size_t n = plan_.buffers().size();
  params_.resize(n);
  grads_.resize(n);
  shard_grads_.resize(n);
  state_a_.resize(n);
  state_b_.resize(n);
  buckets_.resize(n);
  position_in_buffer_.assign(plan_.params().size(), 0);
  const bool adamw = options_.optimizer == OptimizerKind::kAdamW;
  const bool momentum = options_.optimizer == OptimizerKind::kSgd && options_.sgd.momentum != 0.0f;
  reduced_.resize(n);
  masters_.resize(n);
  for (size_t b = 0; b < n; ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    const size_t element = dtype_size(buf.dtype);
    params_[b].assign(buf.numel * element, 0);
    if (buf.trainable) {
      grads_[b].assign(buf.numel * element, 0);
      shard_grads_[b].assign(buf.shard_numel, 0.0f);
      if (buf.dtype != DType::kFloat32) {
        reduced_[b].assign(buf.shard_numel * element, 0);
        masters_[b].assign(buf.shard_numel, 0.0f);
      }
      if (adamw || momentum) state_a_[b].assign(buf.shard_numel, 0.0f);
      if (adamw) state_b_[b].assign(buf.shard_numel, 0.0f);
    }
    buckets_[b].checked_in.assign(buf.params.size(), 0);
    buckets_[b].pending = buf.trainable ? buf.params.size() : 0;
    for (size_t k = 0; k < buf.params.size(); ++k) position_in_buffer_[buf.params[k]] = k;
  }
  HPS_ASSIGN_OR_RETURN(clip_,
                       make_shard_clip(sharding_, options_, plan_, shard_pointers(shard_grads_)));
  step_state_.loss_scale = options_.dynamic_loss_scaling ? options_.initial_loss_scale : 1.0f;
  sealed_ = true;
  return Status::Ok();
}

Status Stage2Engine::broadcast_parameters() {
  if (!sealed_) return failed_precondition("engine: broadcast_parameters() before seal()");
  const int32_t rank = sharding_->rank();
  for (size_t b = 0; b < params_.size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    void* p = params_[b].data();
    HPS_ASSIGN_OR_RETURN(auto w, sharding_->broadcast(p, buf.numel, buf.dtype, 0));
    HPS_RETURN_IF_ERROR(w->wait());
    if (dp_) {
      HPS_ASSIGN_OR_RETURN(auto d, dp_->broadcast(p, buf.numel, buf.dtype, 0));
      HPS_RETURN_IF_ERROR(d->wait());
    }
    if (!masters_[b].empty()) {  // fp32 masters start from the broadcast values
      const uint64_t begin = plan_.shard(b, rank).first;
      cpu::cast(buf.dtype, params_[b].data() + begin * dtype_size(buf.dtype), DType::kFloat32,
                masters_[b].data(), buf.shard_numel);
    }
  }
  return Status::Ok();
}

StatusOr<void*> Stage2Engine::param_data(size_t index) {
  if (!sealed_) return failed_precondition("engine: views exist after seal()");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const Placement& p = plan_.placement(index);
  const DType d = plan_.buffers()[p.buffer].dtype;
  return static_cast<void*>(params_[p.buffer].data() + p.offset * dtype_size(d));
}

StatusOr<void*> Stage2Engine::grad_data(size_t index) {
  HPS_RETURN_IF_ERROR(param_data(index).status());
  const Placement& pl = plan_.placement(index);
  const FlatBuffer& buf = plan_.buffers()[pl.buffer];
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable and has no gradient"));
  return static_cast<void*>(grads_[pl.buffer].data() + pl.offset * dtype_size(buf.dtype));
}

StatusOr<float*> Stage2Engine::param(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* p, param_data(index));
  HPS_RETURN_IF_ERROR(check_float32_view(plan_, index));
  return static_cast<float*>(p);
}

StatusOr<float*> Stage2Engine::grad(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* g, grad_data(index));
  HPS_RETURN_IF_ERROR(check_float32_view(plan_, index));
  return static_cast<float*>(g);
}

Status Stage2Engine::wait_parameters(int32_t unit) {
  if (!sealed_) return failed_precondition("engine: wait_parameters() before seal()");
  bool known = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (plan_.buffers()[b].unit != unit) continue;
    known = true;
    auto& gathered = buckets_[b].gathered;
    if (!gathered) continue;
    HPS_ASSIGN_OR_RETURN(bool done, gathered->test());
    if (!done) {
      const auto start = std::chrono::steady_clock::now();
      HPS_RETURN_IF_ERROR(gathered->done_event().synchronize_uncounted());
      count_dependency_wait(
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - start)
                                    .count()));
    }
    HPS_RETURN_IF_ERROR(gathered->status());
  }
  if (!known) return not_found("engine: no parameters belong to unit " + std::to_string(unit));
  return Status::Ok();
}

Status Stage2Engine::release(int32_t unit) {
  if (!sealed_) return failed_precondition("engine: release() before seal()");
  for (const auto& b : plan_.buffers()) {
    if (b.unit == unit) return Status::Ok();  // stage 2 keeps parameters resident
  }
  return not_found("engine: no parameters belong to unit " + std::to_string(unit));
}

Status Stage2Engine::launch_reduce(size_t b, Stream* ready) {
  const FlatBuffer& buf = plan_.buffers()[b];
  // fp32 buffers reduce straight into the optimizer's shard; fp16/bf16 ones into a shard
  // of their own dtype (the ring adds in fp32), converted at the step.
  void* out = buf.dtype == DType::kFloat32 ? static_cast<void*>(shard_grads_[b].data())
                                           : static_cast<void*>(reduced_[b].data());
  HPS_ASSIGN_OR_RETURN(auto work, sharding_->reduce_scatter(grads_[b].data(), out, buf.shard_numel,
                                                            buf.dtype, ReduceOp::kSum, ready));
  if (dp_ && dp_->size() > 1) {
    HPS_ASSIGN_OR_RETURN(work, dp_->all_reduce(out, out, buf.shard_numel, buf.dtype, ReduceOp::kSum,
                                               &sharding_->stream()));
  }
  buckets_[b].reduced = std::move(work);
  return Status::Ok();
}

Status Stage2Engine::grad_ready(size_t index, Stream* ready) {
  if (!sealed_) return failed_precondition("engine: grad_ready() before seal()");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const size_t b = plan_.placement(index).buffer;
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable"));
  Bucket& bucket = buckets_[b];
  auto& flag = bucket.checked_in[position_in_buffer_[index]];
  if (flag || bucket.complete) {
    return failed_precondition("engine: the gradient of '" + plan_.params()[index].name +
                               "' checked in twice in one micro-batch");
  }
  flag = 1;
  if (--bucket.pending > 0) return Status::Ok();
  // The bucket is complete for this micro-batch.
  const bool last_micro_batch = micro_batch_ == options_.accumulation_steps - 1;
  if (last_micro_batch) HPS_RETURN_IF_ERROR(launch_reduce(b, ready));
  std::fill(bucket.checked_in.begin(), bucket.checked_in.end(), 0);
  bucket.pending = bucket.checked_in.size();
  bucket.complete = true;
  // When every trained bucket is complete, the micro-batch is over.
  bool all_complete = true;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    if (plan_.buffers()[k].trainable && !buckets_[k].complete) all_complete = false;
  }
  if (all_complete && !last_micro_batch) {
    ++micro_batch_;
    for (auto& other : buckets_) other.complete = false;
  }
  return Status::Ok();
}

Status Stage2Engine::step() {
  trace::step_boundary(2, steps_);
  if (!sealed_) return failed_precondition("engine: step() before seal()");
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    if (!buckets_[b].reduced || !buckets_[b].complete) {
      return failed_precondition(
          "engine: step() before backward finished: not every gradient checked in on the last "
          "micro-batch (" +
          std::to_string(options_.accumulation_steps) + " per step)");
    }
  }
  cpu::CpuStream& opt = *optimizer_stream_;
  const float mean_scale = 1.0f / static_cast<float>(sharding_->size() * (dp_ ? dp_->size() : 1) *
                                                     options_.accumulation_steps);
  const int32_t rank = sharding_->rank();
  ++steps_;
  // The reductions consumed the full gradients: zero them for the next step; take the mean
  // and the loss-scale inverse once, on the shard; with loss scaling, find non-finite ones.
  auto shard_of = [&](size_t b) -> ShardGradients {
    const DType d = plan_.buffers()[b].dtype;
    return {grads_[b].data(),
            grads_[b].size(),
            shard_grads_[b].data(),
            shard_grads_[b].size(),
            d == DType::kFloat32 ? nullptr : reduced_[b].data(),
            d};
  };
  auto optimize = [&](size_t b, const float* coefficient) {
    const FlatBuffer& buf = plan_.buffers()[b];
    // fp32 parameters are their own masters; fp16/bf16 ones step their fp32 masters.
    float* param_shard = masters_[b].empty() ? reinterpret_cast<float*>(params_[b].data()) +
                                                   plan_.shard(b, rank).first
                                             : masters_[b].data();
    enqueue_optimizer(opt, &step_state_, options_, param_shard, shard_grads_[b].data(),
                      state_a_[b].empty() ? nullptr : state_a_[b].data(),
                      state_b_[b].empty() ? nullptr : state_b_[b].data(), buf.shard_numel,
                      coefficient);
  };
  auto gather_back = [&](size_t b) -> Status {
    const FlatBuffer& buf = plan_.buffers()[b];
    uint8_t* param_shard = params_[b].data() + plan_.shard(b, rank).first * dtype_size(buf.dtype);
    if (!masters_[b].empty()) {  // the updated masters, rounded once into the parameters
      const float* master = masters_[b].data();
      const DType d = buf.dtype;
      const size_t count = buf.shard_numel;
      opt.enqueue([master, param_shard, d, count] {
        cpu::cast(DType::kFloat32, master, d, param_shard, count);
      });
    }
    // Bring the updated shards back, in place; the next forward of the unit waits on it.
    HPS_ASSIGN_OR_RETURN(
        buckets_[b].gathered,
        sharding_->all_gather(param_shard, params_[b].data(), buf.shard_numel, buf.dtype, &opt));
    buckets_[b].reduced.reset();
    buckets_[b].complete = false;
    return Status::Ok();
  };
  std::vector<size_t> trained;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (plan_.buffers()[b].trainable) trained.push_back(b);
  }
  if (!clip_ && !options_.dynamic_loss_scaling) {
    // Nothing global in this step: each bucket's update and all-gather start as soon as its
    // own reduction is done, so the first units' parameters come back earliest.
    enqueue_step_update(opt, &step_state_, options_);  // no found-inf: counts the step
    for (size_t b : trained) {
      HPS_RETURN_IF_ERROR(buckets_[b].reduced->wait_on(opt));
      HPS_RETURN_IF_ERROR(enqueue_unscale_and_check(opt, &step_state_, {shard_of(b)}, mean_scale,
                                                    options_, *sharding_, dp_.get()));
      optimize(b, nullptr);
      HPS_RETURN_IF_ERROR(gather_back(b));
    }
  } else {
    // The clip's norm and the found-inf flag need every reduced shard first.
    std::vector<ShardGradients> shards;
    for (size_t b : trained) {
      HPS_RETURN_IF_ERROR(buckets_[b].reduced->wait_on(opt));
      shards.push_back(shard_of(b));
    }
    HPS_RETURN_IF_ERROR(enqueue_unscale_and_check(opt, &step_state_, shards, mean_scale, options_,
                                                  *sharding_, dp_.get()));
    if (clip_) HPS_RETURN_IF_ERROR(clip_->run(opt, nullptr, /*scale=*/false));
    enqueue_step_update(opt, &step_state_, options_);
    // Each bucket's all-gather waits only for the updates enqueued before it: the first
    // units' parameters travel while the later buckets are still being updated.
    for (size_t b : trained) {
      optimize(b, clip_ ? clip_->coefficient() : nullptr);
      HPS_RETURN_IF_ERROR(gather_back(b));
    }
  }
  micro_batch_ = 0;
  return Status::Ok();
}

Status Stage2Engine::synchronize() {
  if (!sealed_) return Status::Ok();
  // Reductions started by grad_ready() may still read the gradients: wait for them too.
  for (auto& bucket : buckets_) {
    if (bucket.reduced) HPS_RETURN_IF_ERROR(bucket.reduced->wait());
  }
  HPS_RETURN_IF_ERROR(optimizer_stream_->synchronize());
  for (auto& bucket : buckets_) {
    if (bucket.gathered) HPS_RETURN_IF_ERROR(bucket.gathered->wait());
  }
  return Status::Ok();
}

StatusOr<std::vector<std::vector<float>>> Stage2Engine::gather_all() {
  if (!sealed_) return failed_precondition("engine: gather_all() before seal()");
  HPS_RETURN_IF_ERROR(synchronize());  // parameters are resident once the gathers landed
  std::vector<std::vector<float>> out(plan_.params().size());
  for (size_t b = 0; b < params_.size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    std::vector<float> full(buf.numel);
    if (masters_[b].empty()) {
      cpu::cast(buf.dtype, params_[b].data(), DType::kFloat32, full.data(), buf.numel);
    } else {  // fp16/bf16: every rank's fp32 master shard, not the rounded parameters
      HPS_ASSIGN_OR_RETURN(auto w, sharding_->all_gather(masters_[b].data(), full.data(),
                                                         buf.shard_numel, DType::kFloat32));
      HPS_RETURN_IF_ERROR(w->wait());
    }
    split_buffer(plan_, b, full, out);
  }
  return out;
}

uint64_t Stage2Engine::resident_bytes() const {
  uint64_t n = 0;
  for (const auto* group : {&params_, &grads_, &reduced_}) {
    for (const auto& v : *group) n += v.size();
  }
  for (const auto* group : {&shard_grads_, &masters_, &state_a_, &state_b_}) {
    for (const auto& v : *group) n += v.size() * sizeof(float);
  }
  return n;
}

}  // namespace hps
