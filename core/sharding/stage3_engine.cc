#include "core/sharding/stage3_engine.h"

#include <algorithm>
#include <map>

#include "core/common/first_error.h"
#include "core/trace/trace.h"

namespace hps {

Stage3Engine::Stage3Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
                           EngineOptions options, bool checked_views)
    : EngineBase(std::move(sharding), std::move(dp), options),
      pool_(std::make_unique<FullBufferPool>(device_, checked_views)) {}

StatusOr<std::unique_ptr<Stage3Engine>> Stage3Engine::create(std::shared_ptr<Communicator> sharding,
                                                             std::shared_ptr<Communicator> dp,
                                                             const EngineOptions& options) {
  HPS_RETURN_IF_ERROR(check_engine_arguments(sharding, dp, options));
  HPS_ASSIGN_OR_RETURN(bool checked, debug_views_from_env());
  std::unique_ptr<Stage3Engine> e(
      new Stage3Engine(std::move(sharding), std::move(dp), options, checked));
  HPS_RETURN_IF_ERROR(e->init_device());
  return e;
}

Stage3Engine::~Stage3Engine() {
  (void)synchronize();
  // Lent buffers go back before the pool goes (every user is done after synchronize).
  for (Unit& u : buffers_) {
    u.params.reset();
    u.grads.reset();
  }
}

Status Stage3Engine::seal() {
  auto all = [](const FlatBuffer&) { return true; };
  auto trainable = [](const FlatBuffer& b) { return b.trainable; };
  auto is_16 = [](const FlatBuffer& b) { return b.dtype != DType::kFloat32; };
  auto master = [](const FlatBuffer& b) { return b.dtype == DType::kFloat32 || b.trainable; };
  auto trainable_16 = [](const FlatBuffer& b) { return b.trainable && b.dtype != DType::kFloat32; };
  const bool accumulates = options_.accumulation_steps > 1;
  auto incoming = [accumulates](const FlatBuffer& b) {
    return accumulates && b.trainable && b.dtype == DType::kFloat32;
  };
  // The full parameters exist only until broadcast_parameters(). The fp32 masters are the
  // parameter shards (fp32 buffers send theirs; fp16/bf16 ones send the rounded shard in
  // their dtype); gradients reduce into the fp32 shard (fp16/bf16 ones in their dtype
  // first, then widened; later micro-batches into scratch, then added).
  return seal_storage({{StorageRole::kParams, true, true, all},
                       {StorageRole::kMasters, false, false, master},
                       {StorageRole::kWireShard, false, true, is_16},
                       {StorageRole::kGradShard, false, false, trainable},
                       {StorageRole::kReducedShard, false, true, trainable_16},
                       {StorageRole::kIncoming, false, false, incoming}},
                      [&]() -> Status {
                        const size_t n = plan_.buffers().size();
                        buffers_.clear();
                        buffers_.resize(n);
                        updated_.clear();
                        for (size_t b = 0; b < n; ++b) {
                          HPS_ASSIGN_OR_RETURN(auto event, create_event(device_));
                          updated_.push_back(std::move(event));
                        }
                        updated_recorded_.assign(n, false);
                        HPS_ASSIGN_OR_RETURN(accumulated_, create_event(device_));
                        HPS_ASSIGN_OR_RETURN(read_, create_event(device_));
                        schedule_.init(plan_, options_.prefetch_window);
                        return Status::Ok();
                      });
}

std::pair<DevicePtr<const void>, DType> Stage3Engine::parameter_shard(size_t b) const {
  if (storage_->holds(StorageRole::kMasters, b)) {
    return {storage_->get(StorageRole::kMasters, b), DType::kFloat32};
  }
  return {storage_->get(StorageRole::kWireShard, b), plan_.buffers()[b].dtype};
}

Status Stage3Engine::broadcast_parameters() {
  HPS_RETURN_IF_ERROR(check_sealed("broadcast_parameters()"));
  if (initialised_) return failed_precondition("engine: parameters were broadcast already");
  HPS_RETURN_IF_ERROR(
      broadcast_full([this](size_t b) { return storage_->get(StorageRole::kParams, b); }));
  const int32_t rank = sharding_->rank();
  Stream& opt = optimizer_stream();
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    DevicePtr<const void> mine =
        storage_->get(StorageRole::kParams, b)
            .byte_offset(plan_.shard(b, rank).first * dtype_size(buf.dtype));
    if (storage_->holds(StorageRole::kMasters, b)) {
      HPS_RETURN_IF_ERROR(kernels_->cast(opt, buf.dtype, mine, DType::kFloat32,
                                         storage_->get(StorageRole::kMasters, b), buf.shard_numel));
    }
    if (storage_->holds(StorageRole::kWireShard, b)) {
      HPS_RETURN_IF_ERROR(kernels_->cast(opt, buf.dtype, mine, buf.dtype,
                                         storage_->get(StorageRole::kWireShard, b),
                                         buf.shard_numel));
    }
  }
  HPS_RETURN_IF_ERROR(opt.synchronize());  // set-up: the full buffers go now
  storage_->release(StorageRole::kParams);
  initialised_ = true;
  // The pool's budget: the shards plus the window's units of full parameters and
  // gradients.
  std::map<int32_t, uint64_t> unit_bytes;
  for (const FlatBuffer& fb : plan_.buffers()) {
    unit_bytes[fb.unit] += fb.numel * dtype_size(fb.dtype) * (fb.trainable ? 2 : 1);
  }
  uint64_t largest_unit = 0;
  for (const auto& [unit, bytes] : unit_bytes) largest_unit = std::max(largest_unit, bytes);
  pool_->set_budget(static_cast<uint64_t>(options_.prefetch_window) * largest_unit);
  peak_resident_ = 0;
  peak_live_units_ = 0;
  note_resident();
  return Status::Ok();
}

uint64_t Stage3Engine::transient_bytes() const {
  return pool_->lent_bytes() + pool_->pooled_bytes();
}

void Stage3Engine::note_resident() {
  peak_resident_ = std::max(peak_resident_, resident_bytes());
  peak_live_units_ = std::max(peak_live_units_, live_units());
}

StatusOr<void*> Stage3Engine::param_data(size_t index) {
  HPS_RETURN_IF_ERROR(check_sealed("a parameter view"));
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const Placement& p = plan_.placement(index);
  const size_t offset = p.offset * dtype_size(plan_.buffers()[p.buffer].dtype);
  if (!initialised_) return storage_->get(StorageRole::kParams, p.buffer).byte_offset(offset).get();
  const Unit& u = buffers_[p.buffer];
  if (!u.in_use) {
    return failed_precondition("engine: parameter '" + plan_.params()[index].name + "' of unit " +
                               std::to_string(plan_.buffers()[p.buffer].unit) +
                               " is not gathered: call gather(unit) first (stage 3)");
  }
  return u.params->data().byte_offset(offset).get();
}

StatusOr<void*> Stage3Engine::grad_data(size_t index) {
  HPS_RETURN_IF_ERROR(param_data(index).status());
  if (!initialised_) {
    return failed_precondition("engine: gradients exist after broadcast_parameters()");
  }
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable and has no gradient"));
  const Placement& p = plan_.placement(index);
  const FlatBuffer& fb = plan_.buffers()[p.buffer];
  Unit& u = buffers_[p.buffer];
  if (!u.grads && buckets_.step_due()) {
    // A micro-batch past the step's last: its gradients could never check in, and the view
    // would carry them into the next step's first micro-batch.
    return failed_precondition("engine: the gradient of '" + plan_.params()[index].name +
                               "' asked for after the last micro-batch of the step (" +
                               std::to_string(options_.accumulation_steps) +
                               " per step): call step()");
  }
  if (!u.grads) {
    // Zeroed on the compute stream, before the backward that adds into it.
    const size_t bytes = fb.numel * dtype_size(fb.dtype);
    HPS_ASSIGN_OR_RETURN(u.grads, pool_->take(bytes, compute()));
    HPS_RETURN_IF_ERROR(compute().memset_async(u.grads->data().get(), 0, bytes));
    note_resident();
  }
  return u.grads->data().byte_offset(p.offset * dtype_size(fb.dtype)).get();
}

Status Stage3Engine::start_gather(size_t b) {
  Unit& u = buffers_[b];
  if (u.params) return Status::Ok();  // live or in flight already
  const FlatBuffer& fb = plan_.buffers()[b];
  const size_t element = dtype_size(fb.dtype);
  Stream& comm = sharding_->stream();
  // On the communicator's stream, after this buffer's latest update only (not the whole
  // optimizer step): the first units travel while later ones are still being updated.
  if (updated_recorded_[b]) HPS_RETURN_IF_ERROR(comm.wait(*updated_[b]));
  HPS_ASSIGN_OR_RETURN(u.params, pool_->take(fb.numel * element, comm));
  HPS_RETURN_IF_ERROR(fill(b));
  note_resident();
  return Status::Ok();
}

Status Stage3Engine::fill(size_t b) {
  Unit& u = buffers_[b];
  const FlatBuffer& fb = plan_.buffers()[b];
  const size_t element = dtype_size(fb.dtype);
  Stream& comm = sharding_->stream();
  // Our shard goes in place first, then the all-gather fills in the others'. fp16/bf16
  // buffers send their rounded shard.
  const auto [shard, dtype] = parameter_shard(b);
  const DevicePtr<const void> wire =
      dtype == fb.dtype ? shard : storage_->get(StorageRole::kWireShard, b);
  DevicePtr<void> own =
      u.params->data().byte_offset(plan_.shard(b, sharding_->rank()).first * element);
  HPS_RETURN_IF_ERROR(comm.memcpy_async(own.get(), wire.get(), fb.shard_numel * element));
  HPS_ASSIGN_OR_RETURN(u.gathering,
                       sharding_->all_gather(own.get(), u.params->data().get(), fb.shard_numel,
                                             fb.dtype, nullptr, bucket_tag(b)));
  u.used = false;
  return Status::Ok();
}

Status Stage3Engine::drop_parameters(Unit& u) {
  // Back to the pool after its last reader: the compute stream's forward or backward, or,
  // for a prefetched unit never used, the all-gather itself.
  HPS_RETURN_IF_ERROR(
      pool_->give_back(std::move(u.params), u.used ? compute() : sharding_->stream()));
  u.gathering.reset();
  u.used = false;
  return Status::Ok();
}

int32_t Stage3Engine::live_units() const {
  return schedule_.live_units([this](size_t b) { return !!buffers_[b].params; });
}

Status Stage3Engine::keep_window(int32_t unit) {
  // A unit gathered out of the recorded order (a step whose order changed) would come on top
  // of the units prefetched or kept live for that order: those not in use make room, so at
  // most the window's units are live (units in use at once are never dropped).
  auto live = [this](size_t b) { return !!buffers_[b].params; };
  auto busy = [this](size_t b) { return buffers_[b].in_use; };
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* mine, schedule_.unit_buffers(unit));
  const bool here = std::any_of(mine->begin(), mine->end(), live);
  int32_t count = schedule_.live_units(live) + (here ? 0 : 1);
  while (count > schedule_.prefetch_window()) {
    const int32_t victim = schedule_.unit_to_drop(unit, live, busy);
    if (victim < 0) break;
    HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* dropped, schedule_.unit_buffers(victim));
    for (size_t b : *dropped) {
      if (buffers_[b].params) HPS_RETURN_IF_ERROR(drop_parameters(buffers_[b]));
    }
    ++dropped_;
    --count;
  }
  return Status::Ok();
}

Status Stage3Engine::gather(int32_t unit) {
  HPS_RETURN_IF_ERROR(check_sealed("gather()"));
  if (!initialised_) {
    return failed_precondition(
        "engine: call broadcast_parameters() after writing the initial "
        "values, before the first gather() (stage 3)");
  }
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* unit_buffers, schedule_.unit_buffers(unit));
  HPS_RETURN_IF_ERROR(keep_window(unit));
  for (size_t b : *unit_buffers) {
    if (buffers_[b].params) ++found_in_flight_;
    HPS_RETURN_IF_ERROR(start_gather(b));
  }
  // Later steps start the next units' all-gathers ahead, in the recorded order.
  for (size_t b : schedule_.on_gather(unit, [this](size_t k) { return !!buffers_[k].params; })) {
    ++prefetched_;
    HPS_RETURN_IF_ERROR(start_gather(b));
  }
  // The compute stream waits for the unit's all-gathers (device-side; on the CPU calling
  // thread a dependency wait).
  bool updated = false;
  for (size_t b : *unit_buffers) {
    Unit& u = buffers_[b];
    HPS_RETURN_IF_ERROR(wait_for(compute(), *u.gathering));
    u.in_use = true;
    u.used = true;
    updated |= plan_.buffers()[b].trainable;
  }
  return wait_stepped(updated);
}

Status Stage3Engine::release(int32_t unit) {
  HPS_RETURN_IF_ERROR(check_sealed("release()"));
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* unit_buffers, schedule_.unit_buffers(unit));
  for (size_t b : *unit_buffers) {
    if (buffers_[b].grads && !buckets_.checked_in(b)) {  // taken, and not all checked in
      return failed_precondition("engine: release(" + std::to_string(unit) +
                                 ") while some of its gradients have not checked in");
    }
  }
  // The unit the recorded order gathers next (the last layer of a forward, gathered again
  // at once for its backward) stays live: no second all-gather of the same values. It
  // counts against the window like any live unit.
  const bool gathered_next = schedule_.gathered_next(unit);
  if (gathered_next) ++kept_live_;
  for (size_t b : *unit_buffers) {
    Unit& u = buffers_[b];
    u.in_use = false;
    if (gathered_next || !u.params) continue;
    HPS_RETURN_IF_ERROR(drop_parameters(u));
  }
  return Status::Ok();
}

Status Stage3Engine::grad_ready(size_t index, Stream* ready) {
  if (!sealed_ || !initialised_) return failed_precondition("engine: grad_ready() before training");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable"));
  if (ready != nullptr && !(ready->device() == device_)) {
    return invalid_argument("engine: grad_ready's stream is on " + ready->device().to_string() +
                            ", the engine on " + device_.to_string());
  }
  const size_t b = plan_.placement(index).buffer;
  Unit& u = buffers_[b];
  if (!u.grads && !buckets_.complete(b)) {
    return failed_precondition("engine: grad_ready for '" + plan_.params()[index].name +
                               "' without a gradient: take grad() while its unit is gathered");
  }
  return reduce_in_order(index, ready, true,
                         [this](size_t next, Stream* after) { return launch_reduce(next, after); });
}

Status Stage3Engine::launch_reduce(size_t b, Stream* ready) {
  // The bucket's full gradient is complete: reduce-scatter it into the shard (the first
  // micro-batch) or into scratch and add (later ones); the full buffer goes back to the
  // pool after the reduction has read it.
  Unit& u = buffers_[b];
  const FlatBuffer& fb = plan_.buffers()[b];
  const size_t n = fb.shard_numel;
  Stream& comm = sharding_->stream();
  const bool first = buckets_.first_micro_batch();
  DevicePtr<float> shard = storage_->get<float>(StorageRole::kGradShard, b);
  DevicePtr<void> out = fb.dtype != DType::kFloat32 ? storage_->get(StorageRole::kReducedShard, b)
                        : first                     ? DevicePtr<void>(shard)
                                                    : storage_->get(StorageRole::kIncoming, b);
  HPS_ASSIGN_OR_RETURN(auto work,
                       sharding_->reduce_scatter(u.grads->data().get(), out.get(), n, fb.dtype,
                                                 ReduceOp::kSum, ready, bucket_tag(b)));
  HPS_RETURN_IF_ERROR(pool_->give_back(std::move(u.grads), comm));
  if (fb.dtype != DType::kFloat32 && first) {
    HPS_RETURN_IF_ERROR(kernels_->cast(comm, fb.dtype, out, DType::kFloat32, shard, n));
  } else if (!first) {
    HPS_RETURN_IF_ERROR(kernels_->accumulate(comm, shard, fb.dtype, out, n));
  }
  if (buckets_.last_micro_batch() && dp_ && dp_->size() > 1) {
    HPS_ASSIGN_OR_RETURN(work, dp_->all_reduce(shard.get(), shard.get(), n, DType::kFloat32,
                                               ReduceOp::kSum, &comm, bucket_tag(b)));
  }
  u.reduced = std::move(work);
  if (buckets_.last_micro_batch() && optimizer_->unscales_early()) {
    // With a clip or loss scaling, the shard is unscaled (and its partial sums taken) as
    // soon as its last micro-batch is reduced and added, beside the rest of the backward.
    Stream& opt = optimizer_stream();
    auto wait_reduced = [&]() -> Status {
      HPS_RETURN_IF_ERROR(accumulated_->record(comm));
      HPS_RETURN_IF_ERROR(opt.wait(*accumulated_));
      return u.reduced->wait_on(opt);
    };
    HPS_RETURN_IF_ERROR(optimizer_->reduced(opt, shard_step(b), mean_scale(), wait_reduced));
  }
  return Status::Ok();
}

Status Stage3Engine::step() {
  if (!sealed_ || !initialised_) return failed_precondition("engine: step() before training");
  HPS_RETURN_IF_ERROR(buckets_.check_step_due());
  trace::step_boundary(3, steps_);  // a step refused above is none
  Stream& opt = optimizer_stream();
  // The sharding stream widens and adds micro-batches into the shards after their
  // reductions: the step follows everything on it so far.
  HPS_RETURN_IF_ERROR(accumulated_->record(sharding_->stream()));
  HPS_RETURN_IF_ERROR(opt.wait(*accumulated_));
  std::vector<ShardStep> shards;
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    ShardStep s = shard_step(b);
    s.master = storage_->get<float>(StorageRole::kMasters, b);
    if (storage_->holds(StorageRole::kWireShard, b)) {  // what the next gathers send
      s.rounded = storage_->get(StorageRole::kWireShard, b);
      s.rounded_dtype = plan_.buffers()[b].dtype;
    }
    shards.push_back(std::move(s));
  }
  HPS_RETURN_IF_ERROR(optimizer_->step(
      opt, shards, mean_scale(), [&](size_t b) { return buffers_[b].reduced->wait_on(opt); },
      [&](size_t b) -> Status {
        buffers_[b].reduced.reset();
        updated_recorded_[b] = true;
        return updated_[b]->record(opt);  // what the buffer's next all-gather waits for
      }));
  HPS_RETURN_IF_ERROR(stepped());
  // A unit still live and not in use holds the parameters from before this update: kept
  // live across a release because the recorded order gathers it next (a step whose pattern
  // differs from the first one's), or prefetched and never used. It goes after its last
  // reader, so the next gather brings the updated values (on_step below starts that).
  for (size_t b = 0; b < buffers_.size(); ++b) {
    Unit& u = buffers_[b];
    if (!u.params || u.in_use || !plan_.buffers()[b].trainable) continue;
    HPS_RETURN_IF_ERROR(drop_parameters(u));
  }
  // A unit in use across the step (gathered and not released, as after a forward whose
  // backward never came) holds the parameters from before this update too: it is gathered
  // again in place, after the compute stream's reads so far and its buffer's update, and
  // the next gather() of it waits for that.
  bool reads_waited = false;  // the compute stream's reads, once for every such unit
  for (size_t b = 0; b < buffers_.size(); ++b) {
    Unit& u = buffers_[b];
    if (!u.params || !u.in_use || !plan_.buffers()[b].trainable) continue;
    Stream& comm = sharding_->stream();
    if (!reads_waited) {
      HPS_RETURN_IF_ERROR(read_->record(compute()));
      HPS_RETURN_IF_ERROR(comm.wait(*read_));
      reads_waited = true;
    }
    HPS_RETURN_IF_ERROR(comm.wait(*updated_[b]));
    HPS_RETURN_IF_ERROR(fill(b));
    ++regathered_in_use_;
  }
  ++steps_;
  buckets_.stepped();
  schedule_.stepped();
  // The next step's first units start gathering now: each all-gather waits (on the
  // communicator's stream) for its own buffer's update only, so it runs beside the later
  // updates instead of after the framework's first gather() of the next step.
  for (size_t b : schedule_.on_step([this](size_t k) { return !!buffers_[k].params; })) {
    ++prefetched_;
    HPS_RETURN_IF_ERROR(start_gather(b));
  }
  return Status::Ok();
}

Status Stage3Engine::synchronize() {
  if (!sealed_) return Status::Ok();
  // Everything is waited for even after a failure (the destructor frees the memory the
  // rest may still use); the first failure is returned.
  FirstError first;
  for (auto& u : buffers_) {
    if (u.reduced) first.keep(u.reduced->wait());
  }
  first.keep(sharding_->stream().synchronize());
  first.keep(optimizer_stream().synchronize());
  for (auto& u : buffers_) {
    if (u.gathering) first.keep(u.gathering->wait());
  }
  first.keep(compute().synchronize());
  return first.status();
}

void Stage3Engine::release_gathered_units() {
  for (Unit& u : buffers_) u.in_use = false;
}

void Stage3Engine::drop_stage_work() {
  for (Unit& u : buffers_) {
    u.gathering.reset();
    u.reduced.reset();
  }
  updated_.clear();
  updated_recorded_.clear();
  accumulated_.reset();
}

DevicePtr<void> Stage3Engine::model_parameter_shard(size_t b) const {
  // fp32 buffers send their masters; fp16 / bf16 ones their rounded shard.
  return storage_->holds(StorageRole::kWireShard, b) ? storage_->get(StorageRole::kWireShard, b)
                                                     : storage_->get(StorageRole::kMasters, b);
}

Status Stage3Engine::check_has_state() const {
  if (initialised_) return Status::Ok();
  return failed_precondition("engine: stage 3 has state after broadcast_parameters()");
}

Status Stage3Engine::check_loadable() const {
  HPS_RETURN_IF_ERROR(check_has_state());
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].in_use || buffers_[b].grads) {
      return failed_precondition("engine: unit " + std::to_string(plan_.buffers()[b].unit) +
                                 " is gathered: release it before loading state");
    }
  }
  return Status::Ok();
}

Status Stage3Engine::end_state_load() {
  HPS_RETURN_IF_ERROR(check_loadable());
  for (Unit& u : buffers_) {
    if (!u.params) continue;
    // Prefetched or kept live before the load: stale. Every user is done (the load waited).
    HPS_RETURN_IF_ERROR(pool_->give_back(std::move(u.params), sharding_->stream()));
    u.gathering.reset();
    u.used = false;
  }
  return settle_loaded_scaling();
}

}  // namespace hps
