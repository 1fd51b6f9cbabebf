#include "core/sharding/stage3_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/device/host_sync.h"
#include "core/kernels/cast.h"
#include "core/kernels/norm.h"
#include "core/trace/trace.h"

namespace hps {

Stage3Engine::Stage3Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
                           EngineOptions options)
    : sharding_(std::move(sharding)),
      dp_(std::move(dp)),
      options_(options),
      optimizer_stream_(std::make_unique<cpu::CpuStream>()) {}

Stage3Engine::~Stage3Engine() { (void)synchronize(); }

StatusOr<std::unique_ptr<Stage3Engine>> Stage3Engine::create(std::shared_ptr<Communicator> sharding,
                                                             std::shared_ptr<Communicator> dp,
                                                             const EngineOptions& options) {
  HPS_RETURN_IF_ERROR(check_engine_arguments(sharding, dp, options));
  return std::unique_ptr<Stage3Engine>(
      new Stage3Engine(std::move(sharding), std::move(dp), options));
}

StatusOr<size_t> Stage3Engine::add_param(ParamSpec spec) {
  return add_engine_param(plan_, std::move(spec));
}

Status Stage3Engine::seal() {
  HPS_RETURN_IF_ERROR(seal_plan(plan_, sealed_, *sharding_, dp_.get(), options_.alignment_bytes));
  const size_t n = plan_.buffers().size();
  init_.resize(n);
  wire_shards_.resize(n);
  wire_reduced_.resize(n);
  param_shards_.resize(n);
  grad_shards_.resize(n);
  incoming_.resize(n);
  state_a_.resize(n);
  state_b_.resize(n);
  buffers_.resize(n);
  updated_.clear();
  for (size_t b = 0; b < n; ++b) updated_.push_back(std::make_unique<cpu::CpuEvent>());
  schedule_.init(plan_, options_.accumulation_steps, options_.prefetch_window);
  const bool adamw = options_.optimizer == OptimizerKind::kAdamW;
  const bool momentum = options_.optimizer == OptimizerKind::kSgd && options_.sgd.momentum != 0.0f;
  for (size_t b = 0; b < n; ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    const size_t element = dtype_size(buf.dtype);
    init_[b].assign(buf.numel * element, 0);
    param_shards_[b].assign(buf.shard_numel, 0.0f);
    if (buf.dtype != DType::kFloat32) {
      wire_shards_[b].assign(buf.shard_numel * element, 0);
      if (buf.trainable) wire_reduced_[b].assign(buf.shard_numel * element, 0);
    }
    if (buf.trainable) {
      grad_shards_[b].assign(buf.shard_numel, 0.0f);
      // Micro-batches after the first are reduced into a scratch shard and added.
      if (options_.accumulation_steps > 1) incoming_[b].assign(buf.shard_numel, 0.0f);
      if (adamw || momentum) state_a_[b].assign(buf.shard_numel, 0.0f);
      if (adamw) state_b_[b].assign(buf.shard_numel, 0.0f);
    }
  }
  HPS_ASSIGN_OR_RETURN(clip_,
                       make_shard_clip(sharding_, options_, plan_, shard_pointers(grad_shards_)));
  step_state_.loss_scale = options_.dynamic_loss_scaling ? options_.initial_loss_scale : 1.0f;
  sealed_ = true;
  return Status::Ok();
}

Status Stage3Engine::broadcast_parameters() {
  if (!sealed_) return failed_precondition("engine: broadcast_parameters() before seal()");
  if (initialised_) return failed_precondition("engine: parameters were broadcast already");
  const int32_t rank = sharding_->rank();
  for (size_t b = 0; b < init_.size(); ++b) {
    auto& full = init_[b];
    const FlatBuffer& fb = plan_.buffers()[b];
    HPS_ASSIGN_OR_RETURN(auto w, sharding_->broadcast(full.data(), fb.numel, fb.dtype, 0));
    HPS_RETURN_IF_ERROR(w->wait());
    if (dp_) {
      HPS_ASSIGN_OR_RETURN(auto d, dp_->broadcast(full.data(), fb.numel, fb.dtype, 0));
      HPS_RETURN_IF_ERROR(d->wait());
    }
    const uint8_t* mine = full.data() + plan_.shard(b, rank).first * dtype_size(fb.dtype);
    cpu::cast(fb.dtype, mine, DType::kFloat32, param_shards_[b].data(), fb.shard_numel);
    if (!wire_shards_[b].empty()) std::memcpy(wire_shards_[b].data(), mine, wire_shards_[b].size());
    std::vector<uint8_t>().swap(full);  // from here on only the shard is resident
  }
  initialised_ = true;
  peak_resident_ = 0;
  note_resident();
  std::map<int32_t, uint64_t> unit_bytes;
  for (const FlatBuffer& fb : plan_.buffers()) {
    unit_bytes[fb.unit] += fb.numel * dtype_size(fb.dtype) * (fb.trainable ? 2 : 1);
  }
  uint64_t largest_unit = 0;
  for (const auto& [unit, bytes] : unit_bytes) largest_unit = std::max(largest_unit, bytes);
  memory_budget_ =
      resident_bytes() + static_cast<uint64_t>(options_.prefetch_window) * largest_unit;
  return Status::Ok();
}

Stage3Engine::Full Stage3Engine::take_full(size_t bytes) {
  ++taken_full_;
  std::unique_ptr<uint8_t[]> storage;
  size_t capacity = bytes;
  {
    std::lock_guard lock(pool_mutex_);
    // The same size only: a larger buffer would hold more than the request needs and let
    // the resident bytes creep above what the engine needs at once.
    auto it = pool_.find(bytes);
    if (it != pool_.end()) {
      capacity = it->first;
      storage = std::move(it->second);
      pool_.erase(it);
      pooled_bytes_ -= capacity;
    }
  }
  if (!storage) {
    // A fresh allocation: first drop pooled buffers (of other sizes) that would take the
    // resident bytes above the peak so far.
    std::vector<std::unique_ptr<uint8_t[]>> dropped;
    const uint64_t resident = resident_bytes();
    {
      std::lock_guard lock(pool_mutex_);
      const uint64_t live = resident - std::min(resident, pooled_bytes_);
      const uint64_t limit = std::max(peak_resident_, memory_budget_);
      while (!pool_.empty() && live + pooled_bytes_ + bytes > limit) {
        pooled_bytes_ -= pool_.begin()->first;
        dropped.push_back(std::move(pool_.begin()->second));
        pool_.erase(pool_.begin());
      }
    }
    storage.reset(new uint8_t[bytes]);
    ++fresh_full_;
  }
  return Full(new FullBuffer(std::move(storage), bytes, capacity), [this](FullBuffer* f) {
    {
      std::lock_guard lock(pool_mutex_);
      pooled_bytes_ += f->capacity();
      pool_.emplace(f->capacity(), std::move(f->bytes));
    }
    delete f;
  });
}

StatusOr<void*> Stage3Engine::param_data(size_t index) {
  if (!sealed_) return failed_precondition("engine: views exist after seal()");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const Placement& p = plan_.placement(index);
  const size_t offset = p.offset * dtype_size(plan_.buffers()[p.buffer].dtype);
  if (!initialised_) return static_cast<void*>(init_[p.buffer].data() + offset);
  const Buffer& buf = buffers_[p.buffer];
  if (!buf.in_use) {
    return not_gathered(plan_, index);
  }
  return static_cast<void*>(buf.params->data() + offset);
}

StatusOr<void*> Stage3Engine::grad_data(size_t index) {
  HPS_RETURN_IF_ERROR(param_data(index).status());
  if (!initialised_) {
    return failed_precondition("engine: gradients exist after broadcast_parameters()");
  }
  const Placement& pl = plan_.placement(index);
  const FlatBuffer& fb = plan_.buffers()[pl.buffer];
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable and has no gradient"));
  Buffer& buf = buffers_[pl.buffer];
  if (!buf.grads) {
    buf.grads = take_full(fb.numel * dtype_size(fb.dtype));
    std::memset(buf.grads->data(), 0, buf.grads->size());
    note_resident();
  }
  return static_cast<void*>(buf.grads->data() + pl.offset * dtype_size(fb.dtype));
}

StatusOr<float*> Stage3Engine::param(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* p, param_data(index));
  HPS_RETURN_IF_ERROR(check_float32_view(plan_, index));
  return static_cast<float*>(p);
}

StatusOr<float*> Stage3Engine::grad(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* g, grad_data(index));
  HPS_RETURN_IF_ERROR(check_float32_view(plan_, index));
  return static_cast<float*>(g);
}

Status Stage3Engine::start_gather(size_t b) {
  Buffer& buf = buffers_[b];
  if (buf.params) return Status::Ok();  // live or in flight already
  const FlatBuffer& fb = plan_.buffers()[b];
  const uint64_t begin = plan_.shard(b, sharding_->rank()).first;
  const size_t element = dtype_size(fb.dtype);
  buf.params = take_full(fb.numel * element);
  // Our shard goes in place first (on the optimizer stream, after the latest update), then
  // the all-gather fills in the others'. fp16/bf16 buffers send their rounded shard.
  uint8_t* own = buf.params->data() + begin * element;
  const void* shard = wire_shards_[b].empty() ? static_cast<const void*>(param_shards_[b].data())
                                              : static_cast<const void*>(wire_shards_[b].data());
  const size_t n = fb.shard_numel;
  // On the communicator's stream, after this buffer's latest update only (not the whole
  // optimizer step): the first units travel while later ones are still being updated.
  auto& comm_stream = static_cast<cpu::CpuStream&>(sharding_->stream());
  if (updated_[b]->recorded()) HPS_RETURN_IF_ERROR(comm_stream.wait(*updated_[b]));
  comm_stream.enqueue([own, shard, n, element] { std::memcpy(own, shard, n * element); });
  HPS_ASSIGN_OR_RETURN(buf.gathering,
                       sharding_->all_gather(own, buf.params->data(), n, fb.dtype, nullptr));
  note_resident();
  return Status::Ok();
}

Status Stage3Engine::gather(int32_t unit) {
  if (!sealed_) return failed_precondition("engine: gather() before seal()");
  HPS_RETURN_IF_ERROR(in_flight_.poll().status());
  if (!initialised_) {
    return failed_precondition(
        "engine: call broadcast_parameters() after writing the initial "
        "values, before the first gather() (stage 3)");
  }
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* unit_buffers, schedule_.unit_buffers(unit));
  for (size_t b : *unit_buffers) {
    if (buffers_[b].params) ++found_in_flight_;
    HPS_RETURN_IF_ERROR(start_gather(b));
  }
  // Later steps start the next units' all-gathers ahead, in the recorded order.
  for (size_t b : schedule_.on_gather(unit, [this](size_t k) { return !!buffers_[k].params; })) {
    ++prefetched_;
    HPS_RETURN_IF_ERROR(start_gather(b));
  }
  for (size_t b : *unit_buffers) {
    Buffer& buf = buffers_[b];
    HPS_ASSIGN_OR_RETURN(bool done, buf.gathering->test());
    if (!done) {
      const auto start = std::chrono::steady_clock::now();
      HPS_RETURN_IF_ERROR(buf.gathering->done_event().synchronize_uncounted());
      count_dependency_wait(
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - start)
                                    .count()));
      HPS_RETURN_IF_ERROR(buf.gathering->status());
    }
    buf.in_use = true;
  }
  return Status::Ok();
}

Status Stage3Engine::release(int32_t unit) {
  if (!sealed_) return failed_precondition("engine: release() before seal()");
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* unit_buffers, schedule_.unit_buffers(unit));
  for (size_t b : *unit_buffers) {
    Buffer& buf = buffers_[b];
    if (buf.grads) {  // taken this micro-batch, and the unit's reduction not yet started
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
    Buffer& buf = buffers_[b];
    buf.in_use = false;
    if (gathered_next) continue;
    buf.params.reset();  // nothing in flight reads it: the gather completed before use
    buf.gathering.reset();
  }
  return Status::Ok();
}

Status Stage3Engine::grad_ready(size_t index, Stream* ready) {
  if (!sealed_ || !initialised_) return failed_precondition("engine: grad_ready() before training");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const size_t b = plan_.placement(index).buffer;
  const FlatBuffer& fb = plan_.buffers()[b];
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable"));
  Buffer& buf = buffers_[b];
  if (!buf.grads && schedule_.reduced_this_micro_batch(b)) {
    return failed_precondition("engine: the gradient of '" + plan_.params()[index].name +
                               "' checked in twice in one micro-batch");
  }
  if (!buf.grads) {
    return failed_precondition("engine: grad_ready for '" + plan_.params()[index].name +
                               "' without a gradient: take grad() while its unit is gathered");
  }
  HPS_ASSIGN_OR_RETURN(bool complete, schedule_.check_in(plan_, index));
  if (!complete) return Status::Ok();
  // The unit's full gradient is complete: reduce-scatter it into the shard, add it to the
  // shard's accumulated gradient, and let the full buffer go once the reduction is done.
  uint8_t* full = buf.grads->data();
  float* shard = grad_shards_[b].data();
  const size_t n = fb.shard_numel;
  auto& comm_stream = static_cast<cpu::CpuStream&>(sharding_->stream());
  HPS_RETURN_IF_ERROR(in_flight_.poll().status());
  std::shared_ptr<Work> work;
  const bool first = schedule_.first_micro_batch();
  if (fb.dtype == DType::kFloat32) {
    // The first micro-batch lands in the shard directly; later ones are added to it.
    float* out = first ? shard : incoming_[b].data();
    HPS_ASSIGN_OR_RETURN(
        work, sharding_->reduce_scatter(full, out, n, DType::kFloat32, ReduceOp::kSum, ready));
    if (!first) {
      comm_stream.enqueue([out, shard, n] {
        for (size_t i = 0; i < n; ++i) shard[i] += out[i];
      });
    }
  } else {
    // fp16/bf16: reduced in the dtype (the ring adds in fp32), then into the fp32 shard.
    uint8_t* reduced = wire_reduced_[b].data();
    const DType d = fb.dtype;
    HPS_ASSIGN_OR_RETURN(work,
                         sharding_->reduce_scatter(full, reduced, n, d, ReduceOp::kSum, ready));
    comm_stream.enqueue([reduced, shard, n, d, first] {
      if (first) {
        cpu::cast(d, reduced, DType::kFloat32, shard, n);
        return;
      }
      std::vector<float> widened(n);
      cpu::cast(d, reduced, DType::kFloat32, widened.data(), n);
      for (size_t i = 0; i < n; ++i) shard[i] += widened[i];
    });
  }
  // The full gradient buffer lives until its reduction has read it; poll() lets it go.
  const uint64_t bytes = buf.grads->capacity();
  in_flight_bytes_ += bytes;
  HPS_RETURN_IF_ERROR(in_flight_.add(
      {work, {buf.grads}, [this, bytes](const Status&) { in_flight_bytes_ -= bytes; }}));
  buf.grads.reset();
  if (schedule_.last_micro_batch() && dp_ && dp_->size() > 1) {
    HPS_ASSIGN_OR_RETURN(work, dp_->all_reduce(shard, shard, n, DType::kFloat32, ReduceOp::kSum,
                                               &sharding_->stream()));
  }
  buf.reduced = std::move(work);
  schedule_.buffer_reduced(plan_, b);
  return Status::Ok();
}

Status Stage3Engine::step() {
  trace::step_boundary(3, steps_);
  if (!sealed_ || !initialised_) return failed_precondition("engine: step() before training");
  HPS_RETURN_IF_ERROR(schedule_.check_step_due());
  cpu::CpuStream& opt = *optimizer_stream_;
  const float mean_scale = 1.0f / static_cast<float>(sharding_->size() * (dp_ ? dp_->size() : 1) *
                                                     options_.accumulation_steps);
  std::vector<ShardGradients> shards;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    HPS_RETURN_IF_ERROR(buffers_[b].reduced->wait_on(opt));
    shards.push_back(
        {nullptr, 0, grad_shards_[b].data(), grad_shards_[b].size(), nullptr, DType::kFloat32});
  }
  // The sharding stream adds later micro-batches into the shards after their reductions:
  // wait for everything on it so far.
  cpu::CpuEvent added;
  HPS_RETURN_IF_ERROR(added.record(sharding_->stream()));
  HPS_RETURN_IF_ERROR(opt.wait(added));
  HPS_RETURN_IF_ERROR(enqueue_unscale_and_check(opt, &step_state_, shards, mean_scale, options_,
                                                *sharding_, dp_.get()));
  if (clip_) HPS_RETURN_IF_ERROR(clip_->run(opt, nullptr, /*scale=*/false));
  const float* coefficient = clip_ ? clip_->coefficient() : nullptr;
  // Before the updates (and so before any all-gather that follows them): the skip verdict,
  // the step count and the loss scale.
  enqueue_step_update(opt, &step_state_, options_);
  ++steps_;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    enqueue_optimizer(opt, &step_state_, options_, param_shards_[b].data(), grad_shards_[b].data(),
                      state_a_[b].empty() ? nullptr : state_a_[b].data(),
                      state_b_[b].empty() ? nullptr : state_b_[b].data(), param_shards_[b].size(),
                      coefficient);
    buffers_[b].reduced.reset();
    if (!wire_shards_[b].empty()) {
      // The updated fp32 masters, rounded once into what the next gathers send.
      const float* master = param_shards_[b].data();
      uint8_t* wire = wire_shards_[b].data();
      const DType d = plan_.buffers()[b].dtype;
      const size_t count = param_shards_[b].size();
      opt.enqueue([master, wire, d, count] { cpu::cast(DType::kFloat32, master, d, wire, count); });
    }
    // What the buffer's next all-gather waits for.
    HPS_RETURN_IF_ERROR(updated_[b]->record(opt));
  }
  schedule_.stepped();
  return Status::Ok();
}

Status Stage3Engine::synchronize() {
  if (!sealed_) return Status::Ok();
  HPS_RETURN_IF_ERROR(in_flight_.drain());
  for (auto& buf : buffers_) {
    if (buf.reduced) HPS_RETURN_IF_ERROR(buf.reduced->wait());
  }
  HPS_RETURN_IF_ERROR(sharding_->stream().synchronize());
  HPS_RETURN_IF_ERROR(optimizer_stream_->synchronize());
  for (auto& buf : buffers_) {
    if (buf.gathering) HPS_RETURN_IF_ERROR(buf.gathering->wait());
  }
  return Status::Ok();
}

// The fp32 masters of every parameter (for fp16/bf16 parameters more precise than what
// the views hold).
StatusOr<std::vector<std::vector<float>>> Stage3Engine::gather_all() {
  if (!sealed_ || !initialised_) return failed_precondition("engine: gather_all() before training");
  HPS_RETURN_IF_ERROR(optimizer_stream_->synchronize());
  std::vector<std::vector<float>> out(plan_.params().size());
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const FlatBuffer& fb = plan_.buffers()[b];
    std::vector<float> full(fb.numel);
    HPS_ASSIGN_OR_RETURN(auto w, sharding_->all_gather(param_shards_[b].data(), full.data(),
                                                       fb.shard_numel, DType::kFloat32));
    HPS_RETURN_IF_ERROR(w->wait());
    split_buffer(plan_, b, full, out);
  }
  return out;
}

uint64_t Stage3Engine::resident_bytes() const {
  uint64_t n = 0;
  for (const auto* group : {&init_, &wire_shards_, &wire_reduced_}) {
    for (const auto& v : *group) n += v.size();
  }
  for (const auto* group : {&param_shards_, &grad_shards_, &incoming_, &state_a_, &state_b_}) {
    for (const auto& v : *group) n += v.size() * sizeof(float);
  }
  for (const auto& buf : buffers_) {
    if (buf.params) n += buf.params->capacity();
    if (buf.grads) n += buf.grads->capacity();
  }
  uint64_t pooled = 0;
  {
    std::lock_guard lock(pool_mutex_);
    pooled = pooled_bytes_;
  }
  return n + in_flight_bytes_ + pooled;
}

void Stage3Engine::note_resident() { peak_resident_ = std::max(peak_resident_, resident_bytes()); }

}  // namespace hps
