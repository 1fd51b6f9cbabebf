#include "core/sharding/cuda_stage3_engine.h"

#if HPS_HAVE_CUDA

#include <algorithm>
#include <cstring>

#include "core/device/cuda/error.h"
#include "core/device/cuda/stream.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"
#include "core/trace/trace.h"

namespace hps {
namespace {

using cuda::cuda_status;

cudaStream_t native(Stream& stream) { return static_cast<cuda::CudaStream&>(stream).native(); }

// The done event of a Work on a CUDA communicator.
StatusOr<cudaEvent_t> done_event(Work& work) {
  auto* event = dynamic_cast<cuda::CudaEvent*>(&work.done_event());
  if (event == nullptr)
    return internal_error("engine: a CUDA communicator's work has no CUDA event");
  return event->native();
}

// `waiter` waits (device-side) for everything queued on `signaller` so far.
Status order_after(cudaStream_t waiter, cudaStream_t signaller) {
  if (waiter == signaller) return Status::Ok();
  cudaEvent_t event = nullptr;
  HPS_RETURN_IF_ERROR(
      cuda_status(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  Status s = cuda_status(cudaEventRecord(event, signaller), "cudaEventRecord");
  if (s.ok()) s = cuda_status(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent");
  cudaEventDestroy(event);  // released once the record completes; the wait stays valid
  return s;
}

template <typename T>
Status device_alloc(T** out, size_t count, cudaStream_t stream) {
  *out = nullptr;
  if (count == 0) return Status::Ok();
  void* p = nullptr;
  HPS_RETURN_IF_ERROR(
      cuda_status(cudaMallocAsync(&p, count * sizeof(T), stream), "cudaMallocAsync"));
  *out = static_cast<T*>(p);
  return cuda_status(cudaMemsetAsync(p, 0, count * sizeof(T), stream), "cudaMemsetAsync");
}

}  // namespace

CudaStage3Engine::CudaStage3Engine(std::shared_ptr<Communicator> sharding,
                                   std::shared_ptr<Communicator> dp, EngineOptions options)
    : sharding_(std::move(sharding)),
      dp_(std::move(dp)),
      options_(options),
      device_index_(sharding_->device().index) {}

CudaStage3Engine::~CudaStage3Engine() {
  (void)synchronize();
  (void)free_device_memory();
}

StatusOr<std::unique_ptr<CudaStage3Engine>> CudaStage3Engine::create(
    std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options) {
  HPS_RETURN_IF_ERROR(check_engine_arguments(sharding, dp, options, DeviceType::kCuda));
  if (options.dynamic_loss_scaling) {
    return unimplemented(
        "engine: dynamic loss scaling on CUDA communicators is not implemented yet (its "
        "found-inf flag and step count would have to live on the device)");
  }
  if (options.compute_stream != nullptr &&
      !(options.compute_stream->device() == sharding->device())) {
    return invalid_argument("engine: the compute stream is on " +
                            options.compute_stream->device().to_string() +
                            ", the communicators on " + sharding->device().to_string());
  }
  std::unique_ptr<CudaStage3Engine> engine(
      new CudaStage3Engine(std::move(sharding), std::move(dp), options));
  HPS_RETURN_IF_ERROR(cuda::set_device(engine->device_index_));
  HPS_ASSIGN_OR_RETURN(engine->optimizer_stream_,
                       create_stream(Device::cuda(engine->device_index_)));
  return engine;
}

cudaStream_t CudaStage3Engine::compute() const {
  return options_.compute_stream ? native(*options_.compute_stream) : cudaStreamLegacy;
}
cudaStream_t CudaStage3Engine::comm_stream() const { return native(sharding_->stream()); }
cudaStream_t CudaStage3Engine::opt_stream() const { return native(*optimizer_stream_); }

StatusOr<size_t> CudaStage3Engine::add_param(ParamSpec spec) {
  if (spec.dtype != DType::kFloat32) {
    return unimplemented("engine: parameter '" + spec.name + "' is " +
                         std::string(dtype_name(spec.dtype)) +
                         "; the CUDA stage 3 engine takes float32 parameters only (fp16/bf16 "
                         "with fp32 masters run on CPU communicators)");
  }
  return add_engine_param(plan_, std::move(spec));
}

Status CudaStage3Engine::seal() {
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  HPS_RETURN_IF_ERROR(seal_plan(plan_, sealed_, *sharding_, dp_.get(), options_.alignment_bytes));
  const size_t n = plan_.buffers().size();
  for (auto* v : {&init_, &param_shards_, &grad_shards_, &incoming_, &state_a_, &state_b_}) {
    v->assign(n, nullptr);
  }
  buffers_.resize(n);
  updated_.assign(n, nullptr);
  schedule_.init(plan_, options_.accumulation_steps, options_.prefetch_window);
  const bool adamw = options_.optimizer == OptimizerKind::kAdamW;
  const bool momentum = options_.optimizer == OptimizerKind::kSgd && options_.sgd.momentum != 0.0f;
  const cudaStream_t s = opt_stream();
  for (size_t b = 0; b < n; ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    const size_t shard = buf.shard_numel;
    HPS_RETURN_IF_ERROR(device_alloc(&init_[b], buf.numel, s));
    HPS_RETURN_IF_ERROR(device_alloc(&param_shards_[b], shard, s));
    shard_bytes_ += shard * sizeof(float);
    if (buf.trainable) {
      HPS_RETURN_IF_ERROR(device_alloc(&grad_shards_[b], shard, s));
      shard_bytes_ += shard * sizeof(float);
      if (options_.accumulation_steps > 1) {
        HPS_RETURN_IF_ERROR(device_alloc(&incoming_[b], shard, s));
        shard_bytes_ += shard * sizeof(float);
      }
      if (adamw || momentum) {
        HPS_RETURN_IF_ERROR(device_alloc(&state_a_[b], shard, s));
        shard_bytes_ += shard * sizeof(float);
      }
      if (adamw) {
        HPS_RETURN_IF_ERROR(device_alloc(&state_b_[b], shard, s));
        shard_bytes_ += shard * sizeof(float);
      }
    }
  }
  // Constants the kernels read from device memory, written once here (set-up, not a step).
  HPS_RETURN_IF_ERROR(device_alloc(&device_mean_scale_, 1, s));
  HPS_RETURN_IF_ERROR(device_alloc(&device_loss_scale_, 1, s));
  HPS_RETURN_IF_ERROR(device_alloc(&device_skipped_, 1, s));
  const float mean = 1.0f / static_cast<float>(sharding_->size() * (dp_ ? dp_->size() : 1) *
                                               options_.accumulation_steps);
  const float one = 1.0f;
  HPS_RETURN_IF_ERROR(cuda_status(
      cudaMemcpyAsync(device_mean_scale_, &mean, sizeof mean, cudaMemcpyHostToDevice, s),
      "cudaMemcpyAsync"));
  HPS_RETURN_IF_ERROR(
      cuda_status(cudaMemcpyAsync(device_loss_scale_, &one, sizeof one, cudaMemcpyHostToDevice, s),
                  "cudaMemcpyAsync"));
  HPS_RETURN_IF_ERROR(optimizer_stream_->synchronize());  // the host values above go out of scope
  HPS_ASSIGN_OR_RETURN(clip_, make_shard_clip(sharding_, options_, plan_, grad_shards_));
  sealed_ = true;
  return Status::Ok();
}

Status CudaStage3Engine::broadcast_parameters() {
  if (!sealed_) return failed_precondition("engine: broadcast_parameters() before seal()");
  if (initialised_) return failed_precondition("engine: parameters were broadcast already");
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  const int32_t rank = sharding_->rank();
  // The framework wrote the initial values on its compute stream.
  HPS_RETURN_IF_ERROR(order_after(comm_stream(), compute()));
  for (size_t b = 0; b < init_.size(); ++b) {
    const FlatBuffer& fb = plan_.buffers()[b];
    HPS_ASSIGN_OR_RETURN(auto w, sharding_->broadcast(init_[b], fb.numel, fb.dtype, 0));
    HPS_RETURN_IF_ERROR(w->wait());
    if (dp_) {
      HPS_RETURN_IF_ERROR(order_after(native(dp_->stream()), comm_stream()));
      HPS_ASSIGN_OR_RETURN(auto d, dp_->broadcast(init_[b], fb.numel, fb.dtype, 0));
      HPS_RETURN_IF_ERROR(d->wait());
    }
    const float* mine = init_[b] + plan_.shard(b, rank).first;
    HPS_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(param_shards_[b], mine, fb.shard_numel * sizeof(float),
                                    cudaMemcpyDeviceToDevice, opt_stream()),
                    "cudaMemcpyAsync"));
    HPS_RETURN_IF_ERROR(cuda_status(cudaFreeAsync(init_[b], opt_stream()), "cudaFreeAsync"));
    init_[b] = nullptr;
  }
  HPS_RETURN_IF_ERROR(optimizer_stream_->synchronize());
  initialised_ = true;
  peak_resident_ = 0;
  note_resident();
  return Status::Ok();
}

StatusOr<void*> CudaStage3Engine::param_data(size_t index) {
  if (!sealed_) return failed_precondition("engine: views exist after seal()");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  const Placement& p = plan_.placement(index);
  if (!initialised_) return static_cast<void*>(init_[p.buffer] + p.offset);
  const Buffer& buf = buffers_[p.buffer];
  if (!buf.in_use) {
    return not_gathered(plan_, index);
  }
  return static_cast<void*>(buf.params + p.offset);
}

StatusOr<void*> CudaStage3Engine::grad_data(size_t index) {
  HPS_RETURN_IF_ERROR(param_data(index).status());
  if (!initialised_) {
    return failed_precondition("engine: gradients exist after broadcast_parameters()");
  }
  const Placement& pl = plan_.placement(index);
  const FlatBuffer& fb = plan_.buffers()[pl.buffer];
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable and has no gradient"));
  Buffer& buf = buffers_[pl.buffer];
  if (buf.grads == nullptr) {
    // Zeroed on the compute stream, before the backward that adds into it.
    HPS_RETURN_IF_ERROR(device_alloc(&buf.grads, fb.numel, compute()));
    live_bytes_ += fb.numel * sizeof(float);
    note_resident();
  }
  return static_cast<void*>(buf.grads + pl.offset);
}

StatusOr<float*> CudaStage3Engine::param(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* p, param_data(index));
  return static_cast<float*>(p);
}

StatusOr<float*> CudaStage3Engine::grad(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* g, grad_data(index));
  return static_cast<float*>(g);
}

Status CudaStage3Engine::start_gather(size_t b) {
  Buffer& buf = buffers_[b];
  if (buf.params != nullptr) return Status::Ok();
  const FlatBuffer& fb = plan_.buffers()[b];
  const uint64_t begin = plan_.shard(b, sharding_->rank()).first;
  const size_t n = fb.shard_numel;
  // On the communicator stream, after this buffer's latest update only (not the whole
  // optimizer step): allocated, our shard copied in, the others' all-gathered around it.
  const cudaStream_t cs = comm_stream();
  if (updated_[b] != nullptr) {
    HPS_RETURN_IF_ERROR(
        cuda_status(cudaStreamWaitEvent(cs, updated_[b], 0), "cudaStreamWaitEvent"));
  }
  void* p = nullptr;
  HPS_RETURN_IF_ERROR(
      cuda_status(cudaMallocAsync(&p, fb.numel * sizeof(float), cs), "cudaMallocAsync"));
  buf.params = static_cast<float*>(p);
  live_bytes_ += fb.numel * sizeof(float);
  float* own = buf.params + begin;
  HPS_RETURN_IF_ERROR(cuda_status(
      cudaMemcpyAsync(own, param_shards_[b], n * sizeof(float), cudaMemcpyDeviceToDevice, cs),
      "cudaMemcpyAsync"));
  HPS_ASSIGN_OR_RETURN(buf.gathering,
                       sharding_->all_gather(own, buf.params, n, DType::kFloat32, nullptr));
  note_resident();
  return Status::Ok();
}

Status CudaStage3Engine::gather(int32_t unit) {
  if (!sealed_) return failed_precondition("engine: gather() before seal()");
  if (!initialised_) {
    return failed_precondition(
        "engine: call broadcast_parameters() after writing the initial values, before the "
        "first gather() (stage 3)");
  }
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* unit_buffers, schedule_.unit_buffers(unit));
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  for (size_t b : *unit_buffers) HPS_RETURN_IF_ERROR(start_gather(b));
  for (size_t b :
       schedule_.on_gather(unit, [this](size_t k) { return buffers_[k].params != nullptr; })) {
    ++prefetched_;
    HPS_RETURN_IF_ERROR(start_gather(b));
  }
  // The compute stream waits for the unit's all-gathers on the device; the host goes on.
  for (size_t b : *unit_buffers) {
    Buffer& buf = buffers_[b];
    HPS_ASSIGN_OR_RETURN(cudaEvent_t gathered, done_event(*buf.gathering));
    HPS_RETURN_IF_ERROR(
        cuda_status(cudaStreamWaitEvent(compute(), gathered, 0), "cudaStreamWaitEvent"));
    buf.in_use = true;
  }
  return Status::Ok();
}

Status CudaStage3Engine::release(int32_t unit) {
  if (!sealed_) return failed_precondition("engine: release() before seal()");
  HPS_ASSIGN_OR_RETURN(const std::vector<size_t>* unit_buffers, schedule_.unit_buffers(unit));
  for (size_t b : *unit_buffers) {
    if (buffers_[b].grads != nullptr) {
      return failed_precondition("engine: release(" + std::to_string(unit) +
                                 ") while some of its gradients have not checked in");
    }
  }
  // The unit the recorded order gathers next stays live (see Stage3Engine::release).
  const bool gathered_next = schedule_.gathered_next(unit);
  for (size_t b : *unit_buffers) {
    Buffer& buf = buffers_[b];
    if (buf.params == nullptr) continue;
    if (gathered_next) {
      buf.in_use = false;
      continue;
    }
    if (!buf.in_use) {
      // Prefetched but never used: the compute stream has not waited for its all-gather.
      HPS_ASSIGN_OR_RETURN(cudaEvent_t gathered, done_event(*buf.gathering));
      HPS_RETURN_IF_ERROR(
          cuda_status(cudaStreamWaitEvent(compute(), gathered, 0), "cudaStreamWaitEvent"));
    }
    // Freed in the compute stream's order: after the forward or backward that read it.
    HPS_RETURN_IF_ERROR(cuda_status(cudaFreeAsync(buf.params, compute()), "cudaFreeAsync"));
    live_bytes_ -= plan_.buffers()[b].numel * sizeof(float);
    buf.params = nullptr;
    buf.gathering.reset();
    buf.in_use = false;
  }
  return Status::Ok();
}

Status CudaStage3Engine::grad_ready(size_t index, Stream* ready) {
  if (!sealed_ || !initialised_) return failed_precondition("engine: grad_ready() before training");
  HPS_RETURN_IF_ERROR(check_param_index(plan_, index));
  if (ready != nullptr && !(ready->device() == sharding_->device())) {
    return invalid_argument("engine: grad_ready's stream is on " + ready->device().to_string());
  }
  const size_t b = plan_.placement(index).buffer;
  const FlatBuffer& fb = plan_.buffers()[b];
  HPS_RETURN_IF_ERROR(check_trainable(plan_, index, "is not trainable"));
  Buffer& buf = buffers_[b];
  if (buf.grads == nullptr) {
    return failed_precondition(
        schedule_.reduced_this_micro_batch(b)
            ? "engine: the gradient of '" + plan_.params()[index].name +
                  "' checked in twice in one micro-batch"
            : "engine: grad_ready for '" + plan_.params()[index].name +
                  "' without a gradient: take grad() while its unit is gathered");
  }
  HPS_ASSIGN_OR_RETURN(bool complete, schedule_.check_in(plan_, index));
  if (!complete) return Status::Ok();
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  // The unit's full gradient is complete: reduce-scatter it (after the stream that wrote
  // it) into the shard, or into scratch and add for later micro-batches; then free it in
  // the communicator stream's order.
  const cudaStream_t cs = comm_stream();
  HPS_RETURN_IF_ERROR(order_after(cs, ready ? native(*ready) : compute()));
  const size_t n = fb.shard_numel;
  const bool first = schedule_.first_micro_batch();
  float* out = first ? grad_shards_[b] : incoming_[b];
  HPS_ASSIGN_OR_RETURN(auto work, sharding_->reduce_scatter(buf.grads, out, n, DType::kFloat32,
                                                            ReduceOp::kSum, nullptr));
  if (!first) HPS_RETURN_IF_ERROR(cuda::accumulate(grad_shards_[b], out, n, cs));
  HPS_RETURN_IF_ERROR(cuda_status(cudaFreeAsync(buf.grads, cs), "cudaFreeAsync"));
  live_bytes_ -= fb.numel * sizeof(float);
  buf.grads = nullptr;
  if (schedule_.last_micro_batch() && dp_ && dp_->size() > 1) {
    HPS_ASSIGN_OR_RETURN(work, dp_->all_reduce(grad_shards_[b], grad_shards_[b], n, DType::kFloat32,
                                               ReduceOp::kSum, &sharding_->stream()));
  }
  // step() orders the optimizer after the whole communicator stream (the accumulation
  // included); the work is kept for its status and for synchronize().
  buf.reduced = std::move(work);
  schedule_.buffer_reduced(plan_, b);
  return Status::Ok();
}

Status CudaStage3Engine::step() {
  trace::step_boundary(3, steps_);
  if (!sealed_ || !initialised_) return failed_precondition("engine: step() before training");
  HPS_RETURN_IF_ERROR(schedule_.check_step_due());
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  const cudaStream_t opt = opt_stream();
  // Everything the communicator streams did for this step, then the mean (one pass), the
  // clip, and the optimizer on each shard — all on the optimizer stream.
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    HPS_RETURN_IF_ERROR(buffers_[b].reduced->wait_on(*optimizer_stream_));
  }
  HPS_RETURN_IF_ERROR(order_after(opt, comm_stream()));
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    HPS_RETURN_IF_ERROR(cuda::scale(DType::kFloat32, grad_shards_[b],
                                    plan_.buffers()[b].shard_numel, device_mean_scale_, opt));
  }
  if (clip_) HPS_RETURN_IF_ERROR(clip_->run(*optimizer_stream_, nullptr, /*scale=*/false));
  const float* coefficient = clip_ ? clip_->coefficient() : nullptr;
  ++steps_;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (!plan_.buffers()[b].trainable) continue;
    const size_t n = plan_.buffers()[b].shard_numel;
    if (options_.optimizer == OptimizerKind::kAdamW) {
      HPS_RETURN_IF_ERROR(cuda::adamw(param_shards_[b], grad_shards_[b], state_a_[b], state_b_[b],
                                      n, options_.adamw, static_cast<long>(steps_), coefficient,
                                      1.0f, opt));
    } else {
      HPS_RETURN_IF_ERROR(cuda::sgd(param_shards_[b], grad_shards_[b], state_a_[b], n, options_.sgd,
                                    coefficient, 1.0f, steps_ == 1, opt));
    }
    buffers_[b].reduced.reset();
    // What the buffer's next all-gather waits for.
    if (updated_[b] == nullptr) {
      HPS_RETURN_IF_ERROR(cuda_status(
          cudaEventCreateWithFlags(&updated_[b], cudaEventDisableTiming), "cudaEventCreate"));
    }
    HPS_RETURN_IF_ERROR(cuda_status(cudaEventRecord(updated_[b], opt), "cudaEventRecord"));
  }
  schedule_.stepped();
  return Status::Ok();
}

Status CudaStage3Engine::synchronize() {
  if (!sealed_) return Status::Ok();
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  for (auto& buf : buffers_) {
    if (buf.reduced) HPS_RETURN_IF_ERROR(buf.reduced->wait());
  }
  HPS_RETURN_IF_ERROR(sharding_->stream().synchronize());
  if (dp_) HPS_RETURN_IF_ERROR(dp_->stream().synchronize());
  HPS_RETURN_IF_ERROR(optimizer_stream_->synchronize());
  return cuda_status(cudaStreamSynchronize(compute()), "cudaStreamSynchronize");
}

StatusOr<std::vector<std::vector<float>>> CudaStage3Engine::gather_all() {
  if (!sealed_ || !initialised_) return failed_precondition("engine: gather_all() before training");
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  std::vector<std::vector<float>> out(plan_.params().size());
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const FlatBuffer& fb = plan_.buffers()[b];
    float* full = nullptr;
    HPS_RETURN_IF_ERROR(device_alloc(&full, fb.numel, opt_stream()));
    auto work = sharding_->all_gather(param_shards_[b], full, fb.shard_numel, DType::kFloat32,
                                      optimizer_stream_.get());
    Status s = work.ok() ? (*work)->wait() : work.status();
    std::vector<float> host(fb.numel);
    if (s.ok()) {
      s = cuda_status(
          cudaMemcpy(host.data(), full, fb.numel * sizeof(float), cudaMemcpyDeviceToHost),
          "cudaMemcpy");
    }
    cudaFree(full);
    HPS_RETURN_IF_ERROR(s);
    split_buffer(plan_, b, host, out);
  }
  return out;
}

uint64_t CudaStage3Engine::resident_bytes() const {
  uint64_t init = 0;
  for (size_t b = 0; b < init_.size(); ++b) {
    if (init_[b]) init += plan_.buffers()[b].numel * sizeof(float);
  }
  return shard_bytes_ + init + live_bytes_;
}

void CudaStage3Engine::note_resident() {
  peak_resident_ = std::max(peak_resident_, resident_bytes());
}

Status CudaStage3Engine::free_device_memory() {
  if (cuda::set_device(device_index_).ok()) {
    for (auto* v : {&init_, &param_shards_, &grad_shards_, &incoming_, &state_a_, &state_b_}) {
      for (float*& p : *v) {
        if (p) cudaFree(p);
        p = nullptr;
      }
    }
    for (auto& buf : buffers_) {
      if (buf.params) cudaFree(buf.params);
      if (buf.grads) cudaFree(buf.grads);
      buf.params = buf.grads = nullptr;
    }
    for (cudaEvent_t& e : updated_) {
      if (e) cudaEventDestroy(e);
      e = nullptr;
    }
    for (void* p : {static_cast<void*>(device_mean_scale_), static_cast<void*>(device_loss_scale_),
                    static_cast<void*>(device_skipped_)}) {
      if (p) cudaFree(p);
    }
  }
  return Status::Ok();
}

}  // namespace hps

#endif  // HPS_HAVE_CUDA
