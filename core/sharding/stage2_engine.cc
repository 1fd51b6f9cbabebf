#include "core/sharding/stage2_engine.h"

#include <algorithm>

#include "core/common/first_error.h"
#include "core/trace/trace.h"

namespace hps {

StatusOr<std::unique_ptr<Stage2Engine>> Stage2Engine::create(std::shared_ptr<Communicator> sharding,
                                                             std::shared_ptr<Communicator> dp,
                                                             const EngineOptions& options) {
  HPS_RETURN_IF_ERROR(check_engine_arguments(sharding, dp, options));
  std::unique_ptr<Stage2Engine> e(new Stage2Engine(std::move(sharding), std::move(dp), options));
  HPS_RETURN_IF_ERROR(e->init_device());
  return e;
}

Stage2Engine::~Stage2Engine() { (void)synchronize(); }

Status Stage2Engine::seal() {
  auto all = [](const FlatBuffer&) { return true; };
  auto trainable = [](const FlatBuffer& b) { return b.trainable; };
  auto trainable_16 = [](const FlatBuffer& b) { return b.trainable && b.dtype != DType::kFloat32; };
  // fp32 parameters are their own masters (their shard of kParams); fp16 / bf16 ones keep
  // fp32 masters and reduce their gradients in their dtype (the CPU rings add in fp32; NCCL
  // adds in the dtype).
  return seal_storage({{StorageRole::kParams, true, true, all},
                       {StorageRole::kGrads, true, true, trainable},
                       {StorageRole::kGradShard, false, false, trainable},
                       {StorageRole::kReducedShard, false, true, trainable_16},
                       {StorageRole::kMasters, false, false, trainable_16}},
                      [&]() -> Status {
                        reduced_.assign(plan_.buffers().size(), nullptr);
                        gathered_.assign(plan_.buffers().size(), nullptr);
                        in_use_.assign(plan_.buffers().size(), 0);
                        HPS_ASSIGN_OR_RETURN(widened_, create_event(device_));
                        return Status::Ok();
                      });
}

DevicePtr<void> Stage2Engine::own_parameters(size_t b) const {
  const FlatBuffer& buf = plan_.buffers()[b];
  return storage_->get(StorageRole::kParams, b)
      .byte_offset(plan_.shard(b, sharding_->rank()).first * dtype_size(buf.dtype));
}

std::pair<DevicePtr<const void>, DType> Stage2Engine::parameter_shard(size_t b) const {
  if (storage_->holds(StorageRole::kMasters, b)) {
    return {storage_->get(StorageRole::kMasters, b), DType::kFloat32};
  }
  return {own_parameters(b), plan_.buffers()[b].dtype};
}

Status Stage2Engine::broadcast_parameters() {
  HPS_RETURN_IF_ERROR(check_sealed("broadcast_parameters()"));
  HPS_RETURN_IF_ERROR(
      broadcast_full([this](size_t b) { return storage_->get(StorageRole::kParams, b); }));
  // fp32 masters start from the broadcast values (in the optimizer stream's order).
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    if (!storage_->holds(StorageRole::kMasters, b)) continue;
    const FlatBuffer& buf = plan_.buffers()[b];
    HPS_RETURN_IF_ERROR(kernels_->cast(optimizer_stream(), buf.dtype, own_parameters(b),
                                       DType::kFloat32, storage_->get(StorageRole::kMasters, b),
                                       buf.shard_numel));
  }
  return Status::Ok();
}

StatusOr<void*> Stage2Engine::param_data(size_t index) {
  HPS_RETURN_IF_ERROR(check_sealed("a parameter view"));
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const Placement& p = plan_.placement(index);
  const size_t element = dtype_size(plan_.buffers()[p.buffer].dtype);
  return storage_->get(StorageRole::kParams, p.buffer).byte_offset(p.offset * element).get();
}

StatusOr<void*> Stage2Engine::grad_data(size_t index) {
  HPS_RETURN_IF_ERROR(param_data(index).status());
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable and has no gradient"));
  const Placement& p = plan_.placement(index);
  const size_t element = dtype_size(plan_.buffers()[p.buffer].dtype);
  return storage_->get(StorageRole::kGrads, p.buffer).byte_offset(p.offset * element).get();
}

Status Stage2Engine::wait_parameters(int32_t unit) {
  HPS_RETURN_IF_ERROR(check_sealed("wait_parameters()"));
  bool known = false;
  bool updated = false;
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    if (plan_.buffers()[b].unit != unit) continue;
    known = true;
    updated |= plan_.buffers()[b].trainable;
    if (gathered_[b]) HPS_RETURN_IF_ERROR(wait_for(compute(), *gathered_[b]));
    in_use_[b] = 1;
  }
  if (!known) return not_found("engine: no parameters belong to unit " + std::to_string(unit));
  return wait_stepped(updated);
}

Status Stage2Engine::release(int32_t unit) {
  HPS_RETURN_IF_ERROR(check_sealed("release()"));
  bool known = false;
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    if (plan_.buffers()[b].unit != unit) continue;
    known = true;
    in_use_[b] = 0;  // the parameters stay resident
  }
  if (!known) return not_found("engine: no parameters belong to unit " + std::to_string(unit));
  return Status::Ok();
}

Status Stage2Engine::check_loadable() const {
  HPS_RETURN_IF_ERROR(check_has_state());
  for (size_t b = 0; b < in_use_.size(); ++b) {
    if (in_use_[b]) {
      return failed_precondition("engine: unit " + std::to_string(plan_.buffers()[b].unit) +
                                 " is gathered: release it before loading state");
    }
  }
  return Status::Ok();
}

Status Stage2Engine::launch_reduce(size_t b, Stream* ready) {
  const FlatBuffer& buf = plan_.buffers()[b];
  // fp32 buffers reduce straight into the optimizer's shard; fp16/bf16 ones reduce in their
  // dtype (the CPU rings add in fp32 and round the sum once; NCCL adds in the dtype at each
  // step) and are widened before the dp all-reduce, which adds the dp replicas' rounded sums
  // in fp32 (as in stage 3).
  Stream& comm = sharding_->stream();
  DevicePtr<float> shard = storage_->get<float>(StorageRole::kGradShard, b);
  const bool fp32 = buf.dtype == DType::kFloat32;
  DevicePtr<void> out =
      fp32 ? DevicePtr<void>(shard) : storage_->get(StorageRole::kReducedShard, b);
  HPS_ASSIGN_OR_RETURN(
      auto work,
      sharding_->reduce_scatter(storage_->get(StorageRole::kGrads, b).get(), out.get(),
                                buf.shard_numel, buf.dtype, ReduceOp::kSum, ready, bucket_tag(b)));
  // Kept at once: when what follows fails (a dp group that failed refuses its all-reduce),
  // synchronize() still waits for this reduce-scatter, which reads the gradients.
  reduced_[b] = work;
  if (!fp32) {
    HPS_RETURN_IF_ERROR(
        kernels_->cast(comm, buf.dtype, out, DType::kFloat32, shard, buf.shard_numel));
  }
  if (dp_ && dp_->size() > 1) {
    HPS_ASSIGN_OR_RETURN(work,
                         dp_->all_reduce(shard.get(), shard.get(), buf.shard_numel, DType::kFloat32,
                                         ReduceOp::kSum, &comm, bucket_tag(b)));
  }
  reduced_[b] = std::move(work);
  if (!optimizer_->unscales_early()) return Status::Ok();
  // With a clip or loss scaling, the shard is unscaled (and its partial sums taken) as soon
  // as it is reduced, beside the rest of the backward.
  Stream& opt = optimizer_stream();
  return optimizer_->reduced(opt, shard_step(b), mean_scale(), [&]() -> Status {
    HPS_RETURN_IF_ERROR(widened_->record(comm));
    HPS_RETURN_IF_ERROR(opt.wait(*widened_));
    return reduced_[b]->wait_on(opt);
  });
}

Status Stage2Engine::grad_ready(size_t index, Stream* ready) {
  HPS_RETURN_IF_ERROR(check_sealed("grad_ready()"));
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable"));
  if (ready != nullptr && !(ready->device() == device_)) {
    return invalid_argument("engine: grad_ready's stream is on " + ready->device().to_string() +
                            ", the engine on " + device_.to_string());
  }
  // Gradients accumulate in the full buffer over micro-batches; the last one reduces.
  return reduce_in_order(index, ready, buckets_.last_micro_batch(),
                         [this](size_t b, Stream* after) { return launch_reduce(b, after); });
}

Status Stage2Engine::step() {
  HPS_RETURN_IF_ERROR(check_sealed("step()"));
  HPS_RETURN_IF_ERROR(buckets_.check_step_due());
  trace::step_boundary(2, steps_);  // a step refused above is none
  std::vector<ShardStep> shards;
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    if (!buf.trainable) continue;
    ShardStep s = shard_step(b);
    const bool fp32 = buf.dtype == DType::kFloat32;
    // fp32 parameters are updated in place; fp16/bf16 ones through their masters, rounded
    // back into the parameters.
    s.master =
        fp32 ? own_parameters(b).as<float>() : storage_->get<float>(StorageRole::kMasters, b);
    if (!fp32) {
      s.rounded = own_parameters(b);
      s.rounded_dtype = buf.dtype;
    }
    s.consumed = storage_->get(StorageRole::kGrads, b);
    s.consumed_bytes = buf.numel * dtype_size(buf.dtype);
    shards.push_back(std::move(s));
  }
  Stream& opt = optimizer_stream();
  // The widening of fp16/bf16 reductions runs on the sharding stream after them.
  HPS_RETURN_IF_ERROR(widened_->record(sharding_->stream()));
  HPS_RETURN_IF_ERROR(opt.wait(*widened_));
  HPS_RETURN_IF_ERROR(optimizer_->step(
      opt, shards, mean_scale(), [&](size_t b) { return reduced_[b]->wait_on(opt); },
      [&](size_t b) -> Status {
        // The updated shards back to every rank, in place; the next forward of the unit
        // waits on it.
        const FlatBuffer& buf = plan_.buffers()[b];
        HPS_ASSIGN_OR_RETURN(
            gathered_[b], sharding_->all_gather(own_parameters(b).get(),
                                                storage_->get(StorageRole::kParams, b).get(),
                                                buf.shard_numel, buf.dtype, &opt, bucket_tag(b)));
        reduced_[b].reset();
        return Status::Ok();
      }));
  HPS_RETURN_IF_ERROR(stepped());
  ++steps_;
  buckets_.stepped();
  // The step ends every unit's use (a framework may leave release() out: it moves nothing).
  std::fill(in_use_.begin(), in_use_.end(), 0);
  return Status::Ok();
}

Status Stage2Engine::synchronize() {
  if (!sealed_) return Status::Ok();
  // Everything is waited for even after a failure (the destructor frees the memory the
  // rest may still use); the first failure is returned. Reductions started by grad_ready()
  // may still read the gradients: they are waited for too.
  FirstError first;
  for (auto& work : reduced_) {
    if (work) first.keep(work->wait());
  }
  first.keep(sharding_->stream().synchronize());
  first.keep(optimizer_stream().synchronize());
  for (auto& work : gathered_) {
    if (work) first.keep(work->wait());
  }
  first.keep(compute().synchronize());
  return first.status();
}

void Stage2Engine::drop_stage_work() {
  reduced_.clear();
  gathered_.clear();
  widened_.reset();
}

Status Stage2Engine::end_state_load() {
  HPS_RETURN_IF_ERROR(check_sealed("a state load"));
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    HPS_ASSIGN_OR_RETURN(
        gathered_[b],
        sharding_->all_gather(own_parameters(b).get(), storage_->get(StorageRole::kParams, b).get(),
                              buf.shard_numel, buf.dtype, &optimizer_stream(), bucket_tag(b)));
    HPS_RETURN_IF_ERROR(gathered_[b]->wait());
  }
  return settle_loaded_scaling();
}

}  // namespace hps
