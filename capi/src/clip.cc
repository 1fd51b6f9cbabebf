// Clip handles.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "capi/src/dlpack.h"
#include "capi/src/error.h"
#include "capi/src/extensible.h"
#include "capi/src/handles.h"
#include "core/clip/hybrid_clip.h"

using hps::capi::guard;
using hps::capi::raw_enum;

struct hps_clip {
  std::shared_ptr<hps::HybridClip> impl;  // shared with the coefficient's DLPack views
  // The communicators' device; none: the first run's stream picks it (HybridClip::run).
  std::optional<hps::Device> device;
  // Without communicators: the device of the DLPack gradients registered so far, which
  // every later one and the runs' streams must share.
  std::optional<hps::Device> tensors_device;
  hps::Device coefficient_device() const { return device.value_or(hps::Device::cpu()); }
  uint64_t born = hps::fork_generation();  // capi::made_before_fork
};

namespace {

constexpr uint32_t kKnownFlags =
    HPS_CLIP_DISTRIBUTED | HPS_CLIP_NO_CLIP | HPS_CLIP_SHARED_NOT_FIRST;

hps_clip_options_t default_options() {
  auto o = hps::capi::zeroed<hps_clip_options_t>();
  o.max_norm = 1.0;
  o.deterministic = 0;
  return o;
}

hps::Status check_flags(uint32_t flags) {
  if ((flags & ~kKnownFlags) == 0) return hps::Status::Ok();
  char hex[16];
  std::snprintf(hex, sizeof hex, "%x", flags & ~kKnownFlags);
  return hps::invalid_argument("unknown clip flag bits 0x" + std::string(hex));
}

hps::Status add(hps_clip& clip, void* data, uint64_t count, hps::DType dtype, uint32_t flags) {
  HPS_RETURN_IF_ERROR(check_flags(flags));
  return clip.impl->add_tensor({data, count, dtype, (flags & HPS_CLIP_DISTRIBUTED) != 0,
                                (flags & HPS_CLIP_NO_CLIP) == 0,
                                (flags & HPS_CLIP_SHARED_NOT_FIRST) != 0});
}

std::shared_ptr<hps::Communicator> shared(hps_comm_t* comm) { return comm ? comm->impl : nullptr; }

// The coefficient's address, once sealed (a clip without communicators holds it on the CPU
// until a first run on a CUDA stream moves it there).
hps::StatusOr<float*> placed_coefficient(const hps_clip& clip) {
  const float* c = clip.impl->coefficient();
  if (!clip.impl->sealed() || c == nullptr) {
    return hps::failed_precondition("the clip is not sealed (hps_clip_seal comes first)");
  }
  return const_cast<float*>(c);
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_clip_options_init(hps_clip_options_t* options, size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__,
               [&] { return hps::capi::init_struct(options, struct_size, default_options()); });
}

HPS_API hps_status_t hps_clip_create(hps_comm_t* sharding, hps_comm_t* mp, hps_comm_t* pp,
                                     const hps_clip_options_t* options, hps_clip_t** out_clip) {
  HPS_CHECK_ARG(out_clip);
  HPS_CHECK_OPTIONAL_ARG(sharding);
  HPS_CHECK_OPTIONAL_ARG(mp);
  HPS_CHECK_OPTIONAL_ARG(pp);
  return guard(__func__, [&]() -> hps::Status {
    hps::ClipOptions o;
    if (options != nullptr) {
      HPS_ASSIGN_OR_RETURN(const hps_clip_options_t given,
                           hps::capi::read_struct(options, default_options(), "options"));
      o.max_norm = given.max_norm;
      o.deterministic = given.deterministic != 0;
    }
    HPS_ASSIGN_OR_RETURN(std::shared_ptr<hps::HybridClip> clip,
                         hps::HybridClip::create(shared(sharding), shared(mp), shared(pp), o));
    // HybridClip::create refuses communicators on different devices: any one tells.
    std::optional<hps::Device> device;
    for (hps_comm_t* c : {sharding, mp, pp}) {
      if (c != nullptr) device = c->impl->device();
    }
    *out_clip = new hps_clip{std::move(clip), device, std::nullopt};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_destroy(hps_clip_t* clip) {
  if (hps::capi::left_to_parent(clip)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    // A coefficient view keeps the clip's memory: its last run still completes now, as
    // documented (the caller frees the gradients it registered once this returns), and its
    // communicators go with the handle.
    if (clip != nullptr && clip->impl.use_count() > 1) clip->impl->drop_groups();
    delete clip;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_add_tensor(hps_clip_t* clip, void* data, uint64_t count,
                                         hps_dtype_t dtype, uint32_t flags) {
  HPS_CHECK_ARG(clip);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, hps::dtype_from_int(raw_enum(dtype)));
    return add(*clip, data, count, d, flags);
  });
}

HPS_API hps_status_t hps_clip_add_tensor_dlpack(hps_clip_t* clip, const DLTensor* gradient,
                                                uint32_t flags) {
  HPS_CHECK_ARG(clip);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto g, hps::capi::tensor_arg(gradient, "gradient"));
    // Without communicators the first DLPack gradient places the clip's gradients: the
    // others and the runs' streams must be on its device.
    const std::optional<hps::Device> on = clip->device ? clip->device : clip->tensors_device;
    if (on) HPS_RETURN_IF_ERROR(hps::capi::check_device(g, "gradient", *on));
    // The clip is bound to the first one's device: one this process has (a CUDA gradient in a
    // CPU-only build left a clip no stream could run).
    if (!on) {
      if (hps::Status s = hps::check_device(g.device); !s.ok()) {
        return hps::Status(s.code(), "gradient: " + s.message());
      }
    }
    HPS_RETURN_IF_ERROR(add(*clip, g.data, g.count, g.dtype, flags));
    if (!clip->device && !clip->tensors_device) clip->tensors_device = g.device;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_seal(hps_clip_t* clip) {
  HPS_CHECK_ARG(clip);
  return guard(__func__, [&] { return clip->impl->seal(); });
}

HPS_API hps_status_t hps_clip_run(hps_clip_t* clip, hps_stream_t* stream, float* norm_out,
                                  int32_t scale) {
  HPS_CHECK_ARG(clip);
  HPS_CHECK_ARG(stream);
  return guard(__func__, [&]() -> hps::Status {
    const hps::Device on = stream->impl->device();
    if (!clip->device && clip->tensors_device && *clip->tensors_device != on) {
      return hps::invalid_argument("the stream is on " + on.to_string() +
                                   " but the clip's gradients are on " +
                                   clip->tensors_device->to_string());
    }
    HPS_RETURN_IF_ERROR(clip->impl->run(*stream->impl, norm_out, scale != 0));
    if (!clip->device) clip->device = stream->impl->device();  // the run placed the clip
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_coefficient(hps_clip_t* clip, const float** out_coefficient) {
  HPS_CHECK_ARG(clip);
  HPS_CHECK_ARG(out_coefficient);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(float* c, placed_coefficient(*clip));
    *out_coefficient = c;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_coefficient_dlpack(hps_clip_t* clip, DLManagedTensor** out_tensor) {
  HPS_CHECK_ARG(clip);
  HPS_CHECK_ARG(out_tensor);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(float* c, placed_coefficient(*clip));
    *out_tensor =
        hps::capi::make_view(clip->impl, c, hps::DType::kFloat32, {1}, clip->coefficient_device());
    return hps::Status::Ok();
  });
}

}  // extern "C"
