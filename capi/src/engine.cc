// Sharded training engine handles.
#include <cstring>

#include "capi/src/error.h"
#include "capi/src/handles.h"
#include "core/device/host_sync.h"
#include "core/sharding/sharded_engine.h"

using hps::capi::guard;
using hps::capi::raw_enum;

namespace {

constexpr size_t kOptionsMinSize = sizeof(hps_engine_options_t);
constexpr uint32_t kKnownFlags =
    HPS_PARAM_FROZEN | HPS_PARAM_DISTRIBUTED | HPS_PARAM_NO_CLIP | HPS_PARAM_SHARED_NOT_FIRST;

}  // namespace

extern "C" {

HPS_API hps_status_t hps_engine_options_init(hps_engine_options_t* options, size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__, [&]() -> hps::Status {
    if (struct_size < kOptionsMinSize) {
      return hps::invalid_argument("struct_size " + std::to_string(struct_size) +
                                   " is smaller than the first hps_engine_options_t (" +
                                   std::to_string(kOptionsMinSize) + ")");
    }
    const hps::EngineOptions d;
    std::memset(options, 0, sizeof(hps_engine_options_t));
    options->struct_size = struct_size;
    options->stage = 2;
    options->optimizer = HPS_OPTIMIZER_SGD;
    options->learning_rate = d.sgd.learning_rate;
    options->momentum = d.sgd.momentum;
    options->weight_decay = d.sgd.weight_decay;
    options->nesterov = 0;
    options->beta1 = d.adamw.beta1;
    options->beta2 = d.adamw.beta2;
    options->epsilon = d.adamw.epsilon;
    options->clip_max_norm = 0;
    options->deterministic_clip = 0;
    options->accumulation_steps = 1;
    options->alignment_bytes = d.alignment_bytes;
    options->prefetch_window = d.prefetch_window;
    options->dynamic_loss_scaling = d.dynamic_loss_scaling ? 1 : 0;
    options->initial_loss_scale = d.initial_loss_scale;
    options->growth_factor = d.growth_factor;
    options->backoff_factor = d.backoff_factor;
    options->growth_interval = d.growth_interval;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_create(hps_comm_t* sharding, hps_comm_t* dp,
                                       const hps_engine_options_t* options,
                                       hps_engine_t** out_engine) {
  HPS_CHECK_ARG(sharding);
  HPS_CHECK_ARG(out_engine);
  return guard(__func__, [&]() -> hps::Status {
    hps::EngineOptions o;
    int32_t stage = 2;
    if (options != nullptr) {
      if (options->struct_size < kOptionsMinSize) {
        return hps::invalid_argument(
            "options->struct_size is not set: call hps_engine_options_init first");
      }
      stage = options->stage;
      const int32_t optimizer = raw_enum(options->optimizer);
      if (optimizer != HPS_OPTIMIZER_SGD && optimizer != HPS_OPTIMIZER_ADAMW) {
        return hps::invalid_argument("unknown optimizer " + std::to_string(optimizer));
      }
      o.optimizer = static_cast<hps::OptimizerKind>(optimizer);
      o.sgd = {options->learning_rate, options->momentum, options->weight_decay,
               options->nesterov != 0};
      o.adamw = {options->learning_rate, options->beta1, options->beta2, options->epsilon,
                 options->weight_decay};
      o.clip_max_norm = options->clip_max_norm;
      o.deterministic_clip = options->deterministic_clip != 0;
      o.accumulation_steps = options->accumulation_steps;
      o.alignment_bytes = options->alignment_bytes;
      o.prefetch_window = options->prefetch_window;
      o.dynamic_loss_scaling = options->dynamic_loss_scaling != 0;
      o.initial_loss_scale = options->initial_loss_scale;
      o.growth_factor = options->growth_factor;
      o.backoff_factor = options->backoff_factor;
      o.growth_interval = options->growth_interval;
    }
    HPS_ASSIGN_OR_RETURN(
        auto engine, hps::create_sharded_engine(stage, sharding->impl, dp ? dp->impl : nullptr, o));
    *out_engine = new hps_engine{std::move(engine), sharding->impl->device()};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_destroy(hps_engine_t* engine) {
  return guard(__func__, [&]() -> hps::Status {
    delete engine;
    return hps::Status::Ok();
  });
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
    spec.unit = unit;
    HPS_ASSIGN_OR_RETURN(*out_index, engine->impl->add_param(std::move(spec)));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_engine_seal(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] { return engine->impl->seal(); });
}

HPS_API hps_status_t hps_engine_broadcast_parameters(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] { return engine->impl->broadcast_parameters(); });
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
  return guard(__func__, [&] { return engine->impl->gather(unit); });
}

HPS_API hps_status_t hps_engine_release_parameters(hps_engine_t* engine, int32_t unit) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] { return engine->impl->release(unit); });
}

HPS_API hps_status_t hps_engine_grad_ready(hps_engine_t* engine, size_t index,
                                           hps_stream_t* ready) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] {
    return engine->impl->grad_ready(index, ready ? ready->impl.get() : nullptr);
  });
}

HPS_API hps_status_t hps_engine_step(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] { return engine->impl->step(); });
}

HPS_API hps_status_t hps_engine_synchronize(hps_engine_t* engine) {
  HPS_CHECK_ARG(engine);
  return guard(__func__, [&] { return engine->impl->synchronize(); });
}

HPS_API hps_status_t hps_engine_gather_parameter(hps_engine_t* engine, size_t index, float* out,
                                                 uint64_t count) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out);
  return guard(__func__, [&]() -> hps::Status {
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
    std::memcpy(out, all[index].data(), numel * sizeof(float));
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

HPS_API hps_status_t hps_engine_loss_scale(hps_engine_t* engine, const float** out_scale,
                                           const int64_t** out_skipped_steps) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(out_scale);
  HPS_CHECK_ARG(out_skipped_steps);
  *out_scale = engine->impl->loss_scale();
  *out_skipped_steps = engine->impl->skipped_steps();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_dependency_wait_stats(uint64_t* out_count, uint64_t* out_nanoseconds) {
  HPS_CHECK_ARG(out_count);
  HPS_CHECK_ARG(out_nanoseconds);
  *out_count = hps::dependency_wait_count();
  *out_nanoseconds = hps::dependency_wait_nanoseconds();
  return HPS_STATUS_OK;
}

}  // extern "C"
