// Sharded training engine handles.
#include <cstring>
#include <utility>

#include "capi/src/dlpack.h"
#include "capi/src/error.h"
#include "capi/src/extensible.h"
#include "capi/src/handles.h"
#include "core/device/host_sync.h"
#include "core/sharding/sharded_engine.h"

using hps::capi::guard;
using hps::capi::raw_enum;

namespace {

// guard() for a call on `engine` that runs or waits for its work: an error it returns (the
// work's failure, or a refusal) is counted for hps_engine_failures_returned.
template <typename Body>
hps_status_t engine_guard(hps_engine_t* engine, const char* function, Body&& body) noexcept {
  const hps_status_t s = guard(function, std::forward<Body>(body));
  if (s != HPS_STATUS_OK) engine->failures_returned.fetch_add(1, std::memory_order_relaxed);
  return s;
}

// The defaults hps_engine_options_init sets.
hps_engine_options_t default_options() {
  const hps::EngineOptions d;
  auto o = hps::capi::zeroed<hps_engine_options_t>();
  o.stage = 2;
  o.optimizer = HPS_OPTIMIZER_SGD;
  o.learning_rate = d.sgd.learning_rate;
  o.momentum = d.sgd.momentum;
  o.weight_decay = d.sgd.weight_decay;
  o.nesterov = 0;
  o.beta1 = d.adamw.beta1;
  o.beta2 = d.adamw.beta2;
  o.epsilon = d.adamw.epsilon;
  o.clip_max_norm = 0;
  o.deterministic_clip = 0;
  o.accumulation_steps = 1;
  o.alignment_bytes = d.alignment_bytes;
  o.prefetch_window = d.prefetch_window;
  o.dynamic_loss_scaling = d.dynamic_loss_scaling ? 1 : 0;
  o.initial_loss_scale = d.initial_loss_scale;
  o.growth_factor = d.growth_factor;
  o.backoff_factor = d.backoff_factor;
  o.growth_interval = d.growth_interval;
  o.compute_stream = nullptr;
  o.bucket_bytes = d.bucket_bytes;
  return o;
}

// A view of engine memory, keeping the engine's state alive.
DLManagedTensor* engine_view(const hps_engine& engine, void* data, hps::DType dtype,
                             const std::vector<int64_t>& shape) {
  return hps::capi::make_view(engine.use->state, data, dtype, shape, engine.device);
}

// The dtype and shape of registered parameter `index`.
hps::StatusOr<const hps::ParamSpec*> param_spec(const hps_engine& engine, size_t index) {
  const auto& params = engine.impl->plan().params();
  if (index >= params.size()) return hps::out_of_range("no parameter " + std::to_string(index));
  return &params[index];
}
constexpr uint32_t kKnownFlags = HPS_PARAM_FROZEN | HPS_PARAM_DISTRIBUTED | HPS_PARAM_NO_CLIP |
                                 HPS_PARAM_SHARED_NOT_FIRST | HPS_PARAM_NO_WEIGHT_DECAY;

// The loss scale, skipped-step count and the clip's norm live in the optimizer's state,
// made by seal(): `what` is named when asked for before it.
hps::Status check_sealed(const hps_engine& engine, const char* what) {
  if (engine.impl->loss_scale() != nullptr) return hps::Status::Ok();
  return hps::failed_precondition(std::string("engine: ") + what + " before seal()");
}

// The norm is in the clip's state, which only an engine that clips has.
hps::StatusOr<const float*> grad_norm_of(const hps_engine& engine) {
  HPS_RETURN_IF_ERROR(check_sealed(engine, "the gradient norm"));
  const float* norm = engine.impl->grad_norm();
  if (norm == nullptr) {
    return hps::failed_precondition(
        "engine: no gradient norm without clipping (clip_max_norm is 0; the engine computes "
        "the norm only to clip)");
  }
  return norm;
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_engine_options_init(hps_engine_options_t* options, size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__,
               [&] { return hps::capi::init_struct(options, struct_size, default_options()); });
}

HPS_API hps_status_t hps_engine_create(hps_comm_t* sharding, hps_comm_t* dp,
                                       const hps_engine_options_t* options,
                                       hps_engine_t** out_engine) {
  HPS_CHECK_ARG(sharding);
  HPS_CHECK_ARG(out_engine);
  HPS_CHECK_OPTIONAL_ARG(dp);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(const hps_engine_options_t given,
                         options != nullptr
                             ? hps::capi::read_struct(options, default_options(), "options")
                             : hps::StatusOr<hps_engine_options_t>(default_options()));
    hps::EngineOptions o;
    const int32_t optimizer = raw_enum(given.optimizer);
    if (optimizer != HPS_OPTIMIZER_SGD && optimizer != HPS_OPTIMIZER_ADAMW) {
      return hps::invalid_argument("unknown optimizer " + std::to_string(optimizer));
    }
    o.optimizer = static_cast<hps::OptimizerKind>(optimizer);
    o.sgd = {given.learning_rate, given.momentum, given.weight_decay, given.nesterov != 0};
    o.adamw = {given.learning_rate, given.beta1, given.beta2, given.epsilon, given.weight_decay};
    o.clip_max_norm = given.clip_max_norm;
    o.deterministic_clip = given.deterministic_clip != 0;
    o.accumulation_steps = given.accumulation_steps;
    o.alignment_bytes = given.alignment_bytes;
    o.bucket_bytes = given.bucket_bytes;
    o.prefetch_window = given.prefetch_window;
    o.dynamic_loss_scaling = given.dynamic_loss_scaling != 0;
    o.initial_loss_scale = given.initial_loss_scale;
    o.growth_factor = given.growth_factor;
    o.backoff_factor = given.backoff_factor;
    o.growth_interval = given.growth_interval;
    auto state = std::make_shared<hps::capi::EngineState>();
    const hps::Device device = sharding->impl->device();
    if (given.compute_stream != nullptr) {
      if (hps::capi::made_before_fork(given.compute_stream)) {
        return hps::capi::forked_error("options->compute_stream");
      }
      state->compute_stream = given.compute_stream->impl;
      if (!(state->compute_stream->device() == device)) {
        return hps::invalid_argument("options->compute_stream is on " +
                                     state->compute_stream->device().to_string() +
                                     " but the engine works on " + device.to_string() +
                                     " (the sharding communicator's device)");
      }
      o.compute_stream = state->compute_stream.get();
    }
    HPS_ASSIGN_OR_RETURN(state->engine, hps::create_sharded_engine(given.stage, sharding->impl,
                                                                   dp ? dp->impl : nullptr, o));
    hps::ShardedEngine* impl = state->engine.get();
    *out_engine =
        new hps_engine{std::make_shared<hps::capi::EngineUse>(std::move(state)), impl, device};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_destroy(hps_engine_t* engine) {
  if (hps::capi::left_to_parent(engine)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    if (engine == nullptr) return hps::Status::Ok();
    std::shared_ptr<hps::capi::EngineUse> use = std::move(engine->use);
    delete engine;
    // Checkpoint handles keep the whole engine; views keep only its memory. Either way
    // what it has in flight finishes now, as documented.
    hps::Status finished = hps::Status::Ok();
    if (use.use_count() > 1) {
      finished = use->state->engine->synchronize();
      use->state->engine->release_gathered_units();  // nobody is left to release them
    } else if (use->state.use_count() > 1) {
      finished = use->drop_groups_if_viewed();
    } else {
      finished = use->state->engine->synchronize();  // what the work in flight ended with
    }
    use.reset();
    return finished;
  });
}

HPS_API hps_status_t hps_engine_failures_returned(hps_engine_t* engine, uint64_t* out_count) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_count);
  *out_count = engine->failures_returned.load(std::memory_order_relaxed);
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_engine_add_param(hps_engine_t* engine, const char* name,
                                          const int64_t* shape, size_t ndim, hps_dtype_t dtype,
                                          uint32_t flags, int32_t unit, size_t* out_index) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(name);
  HPS_CHECK_ARG(out_index);
  if (shape == nullptr && ndim > 0) return hps::capi::fail_null(__func__, "shape");
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, hps::dtype_from_int(raw_enum(dtype)));
    if ((flags & ~kKnownFlags) != 0) {
      return hps::invalid_argument("unknown parameter flag bits " +
                                   std::to_string(flags & ~kKnownFlags));
    }
    if (ndim > 16) return hps::invalid_argument("more than 16 dimensions");
    hps::ParamSpec spec;
    spec.name = name;
    spec.shape.assign(shape, shape + ndim);
    spec.dtype = d;
    spec.trainable = (flags & HPS_PARAM_FROZEN) == 0;
    spec.is_distributed = (flags & HPS_PARAM_DISTRIBUTED) != 0;
    spec.need_clip = (flags & HPS_PARAM_NO_CLIP) == 0;
    spec.shared_not_first = (flags & HPS_PARAM_SHARED_NOT_FIRST) != 0;
    spec.weight_decay = (flags & HPS_PARAM_NO_WEIGHT_DECAY) == 0;
    spec.unit = unit;
    HPS_ASSIGN_OR_RETURN(*out_index, engine->impl->add_param(std::move(spec)));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_set_model_parallel_groups(hps_engine_t* engine, hps_comm_t* mp,
                                                          hps_comm_t* pp) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_OPTIONAL_ARG(mp);
  HPS_CHECK_OPTIONAL_ARG(pp);
  return guard(__func__, [&] {
    return engine->impl->set_model_parallel_groups(mp ? mp->impl : nullptr,
                                                   pp ? pp->impl : nullptr);
  });
}

HPS_API hps_status_t hps_engine_seal(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return engine_guard(engine, __func__, [&] { return engine->impl->seal(); });
}

HPS_API hps_status_t hps_engine_broadcast_parameters(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return engine_guard(engine, __func__, [&] { return engine->impl->broadcast_parameters(); });
}

HPS_API hps_status_t hps_engine_param(hps_engine_t* engine, size_t index, void** out_data) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_data);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(void* p, engine->impl->param_data(index));
    *out_data = p;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_grad(hps_engine_t* engine, size_t index, void** out_data) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_data);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(void* g, engine->impl->grad_data(index));
    *out_data = g;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_wait_parameters(hps_engine_t* engine, int32_t unit) {
  HPS_CHECK_ARG(engine);
  return engine_guard(engine, __func__, [&] { return engine->impl->gather(unit); });
}

HPS_API hps_status_t hps_engine_release_parameters(hps_engine_t* engine, int32_t unit) {
  HPS_CHECK_ARG(engine);
  return engine_guard(engine, __func__, [&] { return engine->impl->release(unit); });
}

HPS_API hps_status_t hps_engine_grad_ready(hps_engine_t* engine, size_t index,
                                           hps_stream_t* ready) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return engine_guard(engine, __func__, [&] {
    return engine->impl->grad_ready(index, ready ? ready->impl.get() : nullptr);
  });
}

HPS_API hps_status_t hps_engine_step(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return engine_guard(engine, __func__, [&] { return engine->impl->step(); });
}

HPS_API hps_status_t hps_engine_synchronize(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return engine_guard(engine, __func__, [&] { return engine->impl->synchronize(); });
}

HPS_API hps_status_t hps_engine_gather_parameter(hps_engine_t* engine, size_t index, float* out,
                                                 uint64_t count) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out);
  return engine_guard(engine, __func__, [&]() -> hps::Status {
    const auto& plan = engine->impl->plan();
    if (!plan.sealed()) return hps::failed_precondition("the engine is not sealed");
    if (index >= plan.params().size()) {
      return hps::out_of_range("no parameter " + std::to_string(index));
    }
    const uint64_t numel = plan.params()[index].numel();
    if (count < numel) {
      return hps::out_of_range("parameter " + std::to_string(index) + " has " +
                               std::to_string(numel) + " elements; out holds " +
                               std::to_string(count));
    }
    HPS_ASSIGN_OR_RETURN(auto all, engine->impl->gather_all());
    if (numel != 0) std::memcpy(out, all[index].data(), numel * sizeof(float));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_device(hps_engine_t* engine, hps_device_type_t* out_type,
                                       int32_t* out_index) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_type);
  HPS_CHECK_ARG(out_index);
  *out_type = static_cast<hps_device_type_t>(engine->device.type);
  *out_index = engine->device.index;
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_engine_resident_bytes(hps_engine_t* engine, uint64_t* out_bytes) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_bytes);
  *out_bytes = engine->impl->resident_bytes();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_engine_shard_range(hps_engine_t* engine, size_t index, uint64_t* out_begin,
                                            uint64_t* out_end) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_begin);
  HPS_CHECK_ARG(out_end);
  return guard(__func__, [&]() -> hps::Status {
    const auto& plan = engine->impl->plan();
    if (!plan.sealed()) return hps::failed_precondition("the engine is not sealed");
    if (index >= plan.params().size()) {
      return hps::out_of_range("no parameter " + std::to_string(index));
    }
    const auto [b, e] = plan.local_part(index, engine->impl->shard_rank());
    *out_begin = b;
    *out_end = e;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_param_bucket(hps_engine_t* engine, size_t index,
                                             size_t* out_bucket) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_bucket);
  return guard(__func__, [&]() -> hps::Status {
    const auto& plan = engine->impl->plan();
    if (!plan.sealed()) return hps::failed_precondition("the engine is not sealed");
    if (index >= plan.params().size()) {
      return hps::out_of_range("no parameter " + std::to_string(index));
    }
    *out_bucket = plan.placement(index).buffer;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_loss_scale(hps_engine_t* engine, const float** out_scale,
                                           const int64_t** out_skipped_steps) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_scale);
  HPS_CHECK_ARG(out_skipped_steps);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(check_sealed(*engine, "the loss scale"));
    *out_scale = engine->impl->loss_scale();
    *out_skipped_steps = engine->impl->skipped_steps();
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_grad_norm(hps_engine_t* engine, const float** out_norm) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_norm);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(const float* norm, grad_norm_of(*engine));
    *out_norm = norm;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_set_learning_rate(hps_engine_t* engine, float learning_rate) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] { return engine->impl->set_learning_rate(learning_rate); });
}

HPS_API hps_status_t hps_engine_param_dlpack(hps_engine_t* engine, size_t index,
                                             DLManagedTensor** out_tensor) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_tensor);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(void* data, engine->impl->param_data(index));
    HPS_ASSIGN_OR_RETURN(const hps::ParamSpec* spec, param_spec(*engine, index));
    *out_tensor = engine_view(*engine, data, spec->dtype, spec->shape);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_grad_dlpack(hps_engine_t* engine, size_t index,
                                            DLManagedTensor** out_tensor) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_tensor);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(void* data, engine->impl->grad_data(index));
    HPS_ASSIGN_OR_RETURN(const hps::ParamSpec* spec, param_spec(*engine, index));
    *out_tensor = engine_view(*engine, data, spec->dtype, spec->shape);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_loss_scale_dlpack(hps_engine_t* engine, DLManagedTensor** out_scale,
                                                  DLManagedTensor** out_skipped_steps) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_scale);
  HPS_CHECK_ARG(out_skipped_steps);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(check_sealed(*engine, "the loss scale"));
    // The engine only reads these; a view is writable memory by DLPack's contract, and
    // a caller that writes them owns the consequences, as with hps_engine_loss_scale.
    std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> scale(
        engine_view(*engine, const_cast<float*>(engine->impl->loss_scale()), hps::DType::kFloat32,
                    {1}),
        [](DLManagedTensor* t) { t->deleter(t); });
    DLManagedTensor* skipped = engine_view(
        *engine, const_cast<int64_t*>(engine->impl->skipped_steps()), hps::DType::kInt64, {1});
    *out_skipped_steps = skipped;
    *out_scale = scale.release();
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_grad_norm_dlpack(hps_engine_t* engine, DLManagedTensor** out_norm) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_norm);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(const float* norm, grad_norm_of(*engine));
    // Writable by DLPack's contract; the engine overwrites it at each step.
    *out_norm = engine_view(*engine, const_cast<float*>(norm), hps::DType::kFloat32, {1});
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_dependency_wait_stats(uint64_t* out_count, uint64_t* out_nanoseconds) {
  HPS_CHECK_ARG(out_count);
  HPS_CHECK_ARG(out_nanoseconds);
  *out_count = hps::dependency_wait_count();
  *out_nanoseconds = hps::dependency_wait_nanoseconds();
  return HPS_STATUS_OK;
}

}  // extern "C"
