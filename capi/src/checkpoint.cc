// Checkpoint handles (core/checkpoint).
#include <algorithm>
#include <cstring>
#include <map>

#include "capi/src/error.h"
#include "capi/src/extensible.h"
#include "capi/src/handles.h"
#include "core/checkpoint/checkpointer.h"

using hps::capi::guard;

struct hps_checkpoint {
  // The engine lives whole as long as a checkpoint of it does (hps_engine_destroy drops only
  // the engine handle's use). Members go in reverse order: the checkpointer first.
  std::shared_ptr<hps::capi::EngineUse> engine;
  std::unique_ptr<hps::Checkpointer> impl;
  std::map<std::string, std::string> metadata;  // of the last load or import
  uint64_t born = hps::fork_generation();       // capi::made_before_fork
};

namespace {

hps_checkpoint_options_t default_options() {
  const hps::CheckpointOptions d;
  auto o = hps::capi::zeroed<hps_checkpoint_options_t>();
  o.struct_size = sizeof o;
  o.keep_last = d.keep_last;
  o.chunk_bytes = d.chunk_bytes;
  o.timeout_ms = d.timeout.count();
  return o;
}

hps_checkpoint_load_options_t default_load_options() {
  auto o = hps::capi::zeroed<hps_checkpoint_load_options_t>();
  o.struct_size = sizeof o;
  return o;
}

// A caller's struct under the extensible-struct rules (capi/src/extensible.h); NULL: the
// defaults.
template <typename T>
hps::StatusOr<T> read_or_default(const T* in, T defaults, const char* argument) {
  if (in == nullptr) return defaults;
  return hps::capi::read_struct(in, defaults, argument);
}

hps::StatusOr<hps::CheckpointLoadOptions> load_options(const hps_checkpoint_load_options_t* in) {
  HPS_ASSIGN_OR_RETURN(auto o, read_or_default(in, default_load_options(), "options"));
  return hps::CheckpointLoadOptions{o.allow_partial != 0};
}

hps::StatusOr<hps::ckpt::Manifest> manifest_at(const char* path) {
  HPS_ASSIGN_OR_RETURN(std::string directory, hps::resolve_checkpoint(path));
  return hps::ckpt::read_manifest(directory);
}

void copy_text(char* out, size_t capacity, const std::string& text) {
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_checkpoint_options_init(hps_checkpoint_options_t* options,
                                                 size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__,
               [&] { return hps::capi::init_struct(options, struct_size, default_options()); });
}

HPS_API hps_status_t hps_checkpoint_load_options_init(hps_checkpoint_load_options_t* options,
                                                      size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__, [&] {
    return hps::capi::init_struct(options, struct_size, default_load_options());
  });
}

HPS_API hps_status_t hps_checkpoint_create(hps_engine_t* engine, hps_comm_t* group,
                                           const char* root,
                                           const hps_checkpoint_options_t* options,
                                           hps_checkpoint_t** out_checkpoint) {
  HPS_CHECK_ARG(engine);
  HPS_CHECK_ARG(group);
  HPS_CHECK_ARG(root);
  HPS_CHECK_ARG(out_checkpoint);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto o, read_or_default(options, default_options(), "options"));
    auto* state = dynamic_cast<hps::Checkpointable*>(engine->impl);
    if (state == nullptr) {
      return hps::unimplemented("the stage " + std::to_string(engine->impl->stage()) +
                                " engine on " + engine->device.to_string() +
                                " does not support checkpoints");
    }
    if (o.timeout_ms <= 0) return hps::invalid_argument("timeout_ms must be > 0");
    hps::CheckpointOptions c;
    c.keep_last = o.keep_last;
    c.chunk_bytes = o.chunk_bytes;
    c.timeout = hps::Milliseconds(o.timeout_ms);
    HPS_ASSIGN_OR_RETURN(auto checkpointer,
                         hps::Checkpointer::create(*state, group->impl, root, c));
    *out_checkpoint = new hps_checkpoint{engine->use, std::move(checkpointer), {}};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_checkpoint_destroy(hps_checkpoint_t* checkpoint) {
  if (hps::capi::left_to_parent(checkpoint)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete checkpoint;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_checkpoint_save(hps_checkpoint_t* checkpoint, const char* name,
                                         const char* const* keys, const char* const* values,
                                         size_t count, hps_work_t** out_work) {
  HPS_CHECK_ARG(checkpoint);
  HPS_CHECK_ARG(name);
  HPS_CHECK_ARG(out_work);
  if (count > 0 && keys == nullptr) return hps::capi::fail_null(__func__, "keys");
  if (count > 0 && values == nullptr) return hps::capi::fail_null(__func__, "values");
  return guard(__func__, [&]() -> hps::Status {
    std::map<std::string, std::string> metadata;
    for (size_t i = 0; i < count; ++i) {
      if (keys[i] == nullptr || values[i] == nullptr) {
        return hps::invalid_argument("metadata entry " + std::to_string(i) + " is NULL");
      }
      if (!metadata.emplace(keys[i], values[i]).second) {
        return hps::invalid_argument(std::string("metadata key '") + keys[i] + "' is repeated");
      }
    }
    HPS_ASSIGN_OR_RETURN(auto work, checkpoint->impl->save(name, std::move(metadata)));
    *out_work = new hps_work{std::move(work)};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_checkpoint_load(hps_checkpoint_t* checkpoint, const char* name,
                                         const hps_checkpoint_load_options_t* options) {
  HPS_CHECK_ARG(checkpoint);
  return guard(__func__, [&]() -> hps::Status {
    if (name != nullptr && name[0] == '\0') {
      return hps::invalid_argument("the checkpoint name is empty (NULL loads the latest)");
    }
    HPS_ASSIGN_OR_RETURN(auto o, load_options(options));
    HPS_ASSIGN_OR_RETURN(auto report, checkpoint->impl->load(name ? name : "", o));
    checkpoint->metadata = std::move(report.metadata);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_checkpoint_import_safetensors(
    hps_checkpoint_t* checkpoint, const char* path, const hps_checkpoint_load_options_t* options) {
  HPS_CHECK_ARG(checkpoint);
  HPS_CHECK_ARG(path);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto o, load_options(options));
    HPS_ASSIGN_OR_RETURN(auto report, checkpoint->impl->import_safetensors(path, o));
    checkpoint->metadata = std::move(report.metadata);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_checkpoint_metadata(hps_checkpoint_t* checkpoint, const char* key,
                                             char* buffer, size_t capacity, size_t* out_length) {
  HPS_CHECK_ARG(checkpoint);
  HPS_CHECK_ARG(key);
  HPS_CHECK_ARG(out_length);
  if (buffer == nullptr && capacity != 0) {
    return hps::capi::fail(
        hps::invalid_argument(std::string(__func__) + ": buffer is NULL but capacity is " +
                              std::to_string(capacity) + " (NULL asks for the length: 0)"));
  }
  return guard(__func__, [&]() -> hps::Status {
    auto it = checkpoint->metadata.find(key);
    if (it == checkpoint->metadata.end()) {
      return hps::not_found(std::string("no metadata '") + key + "' in the last load");
    }
    const std::string& value = it->second;
    if (buffer != nullptr) {
      if (capacity <= value.size()) {
        return hps::out_of_range("metadata '" + std::string(key) + "' needs " +
                                 std::to_string(value.size() + 1) + " bytes; the buffer has " +
                                 std::to_string(capacity));
      }
      std::memcpy(buffer, value.c_str(), value.size() + 1);
    }
    *out_length = value.size();
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_checkpoint_info_init(hps_checkpoint_info_t* info, size_t struct_size) {
  HPS_CHECK_ARG(info);
  return guard(__func__, [&] {
    return hps::capi::init_struct(info, struct_size, hps::capi::zeroed<hps_checkpoint_info_t>());
  });
}

HPS_API hps_status_t hps_checkpoint_inspect(const char* path, hps_checkpoint_info_t* info) {
  HPS_CHECK_ARG(path);
  HPS_CHECK_ARG(info);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::capi::caller_struct_size(info, "info").status());
    HPS_ASSIGN_OR_RETURN(hps::ckpt::Manifest m, manifest_at(path));
    auto out = hps::capi::zeroed<hps_checkpoint_info_t>();
    out.format_version = static_cast<int32_t>(m.format_version);
    out.stage = m.topology.stage;
    out.sharding = m.topology.sharding;
    out.dp = m.topology.dp;
    out.world = m.world;
    out.files = static_cast<int32_t>(m.files.size());
    out.tensors = m.tensors.size();
    for (const auto& t : m.tensors) out.bytes += t.numel * hps::dtype_size(t.dtype);
    out.created_unix_ns = m.created_unix_ns;
    copy_text(out.id, sizeof out.id, m.id);
    copy_text(out.name, sizeof out.name, m.name);
    out.mp = m.topology.mp;
    out.mp_rank = m.topology.mp_rank;
    out.pp = m.topology.pp;
    out.pp_rank = m.topology.pp_rank;
    return hps::capi::write_struct(info, out, "info");
  });
}

HPS_API hps_status_t hps_checkpoint_verify(const char* path) {
  HPS_CHECK_ARG(path);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(std::string directory, hps::resolve_checkpoint(path));
    return hps::verify_checkpoint(directory).status();
  });
}

HPS_API hps_status_t hps_checkpoint_read_engine_options(const char* path,
                                                        hps_engine_options_t* options) {
  HPS_CHECK_ARG(path);
  HPS_CHECK_ARG(options);
  return guard(__func__, [&]() -> hps::Status {
    // The caller's fields as they are (compute_stream and bucket_bytes are not the saved
    // state's: they stay as set); only its struct_size bytes are written back.
    HPS_ASSIGN_OR_RETURN(const size_t size, hps::capi::caller_struct_size(options, "options"));
    auto o = hps::capi::zeroed<hps_engine_options_t>();
    std::memcpy(static_cast<void*>(&o), options, std::min(size, sizeof o));
    HPS_ASSIGN_OR_RETURN(hps::ckpt::Manifest m, manifest_at(path));
    if (!m.engine)
      return hps::not_found(std::string("checkpoint '") + path + "' records no engine options");
    const hps::EngineOptions& e = *m.engine;
    const bool adamw = e.optimizer == hps::OptimizerKind::kAdamW;
    o.stage = m.topology.stage;
    o.optimizer = adamw ? HPS_OPTIMIZER_ADAMW : HPS_OPTIMIZER_SGD;
    o.learning_rate = adamw ? e.adamw.learning_rate : e.sgd.learning_rate;
    o.weight_decay = adamw ? e.adamw.weight_decay : e.sgd.weight_decay;
    o.momentum = e.sgd.momentum;
    o.nesterov = e.sgd.nesterov ? 1 : 0;
    o.beta1 = e.adamw.beta1;
    o.beta2 = e.adamw.beta2;
    o.epsilon = e.adamw.epsilon;
    o.clip_max_norm = e.clip_max_norm;
    o.deterministic_clip = e.deterministic_clip ? 1 : 0;
    o.accumulation_steps = e.accumulation_steps;
    o.alignment_bytes = e.alignment_bytes;
    o.prefetch_window = e.prefetch_window;
    o.dynamic_loss_scaling = e.dynamic_loss_scaling ? 1 : 0;
    o.initial_loss_scale = e.initial_loss_scale;
    o.growth_factor = e.growth_factor;
    o.backoff_factor = e.backoff_factor;
    o.growth_interval = e.growth_interval;
    return hps::capi::write_struct(options, o, "options");
  });
}

HPS_API hps_status_t hps_checkpoint_export_safetensors(const char* path, const char* out,
                                                       int32_t fp32) {
  HPS_CHECK_ARG(path);
  HPS_CHECK_ARG(out);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(std::string directory, hps::resolve_checkpoint(path));
    return hps::export_safetensors(directory, out, fp32 != 0);
  });
}

}  // extern "C"
