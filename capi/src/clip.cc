// Clip handles.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "capi/src/error.h"
#include "capi/src/handles.h"
#include "core/clip/hybrid_clip.h"

using hps::capi::guard;
using hps::capi::raw_enum;

struct hps_clip {
  std::unique_ptr<hps::HybridClip> impl;
};

namespace {

constexpr size_t kOptionsMinSize = sizeof(hps_clip_options_t);
constexpr uint32_t kKnownFlags =
    HPS_CLIP_DISTRIBUTED | HPS_CLIP_NO_CLIP | HPS_CLIP_SHARED_NOT_FIRST;

std::shared_ptr<hps::Communicator> shared(hps_comm_t* comm) { return comm ? comm->impl : nullptr; }

}  // namespace

extern "C" {

HPS_API hps_status_t hps_clip_options_init(hps_clip_options_t* options, size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__, [&]() -> hps::Status {
    if (struct_size < kOptionsMinSize) {
      return hps::invalid_argument("struct_size " + std::to_string(struct_size) +
                                   " is smaller than the first hps_clip_options_t (" +
                                   std::to_string(kOptionsMinSize) + ")");
    }
    std::memset(options, 0, sizeof(hps_clip_options_t));
    options->struct_size = struct_size;
    options->max_norm = 1.0;
    options->deterministic = 0;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_create(hps_comm_t* sharding, hps_comm_t* mp, hps_comm_t* pp,
                                     const hps_clip_options_t* options, hps_clip_t** out_clip) {
  HPS_CHECK_ARG(out_clip);
  return guard(__func__, [&]() -> hps::Status {
    hps::ClipOptions o;
    if (options != nullptr) {
      if (options->struct_size < kOptionsMinSize) {
        return hps::invalid_argument(
            "options->struct_size is not set: call hps_clip_options_init first");
      }
      o.max_norm = options->max_norm;
      o.deterministic = options->deterministic != 0;
    }
    HPS_ASSIGN_OR_RETURN(auto clip,
                         hps::HybridClip::create(shared(sharding), shared(mp), shared(pp), o));
    *out_clip = new hps_clip{std::move(clip)};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_destroy(hps_clip_t* clip) {
  return guard(__func__, [&]() -> hps::Status {
    delete clip;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_clip_add_tensor(hps_clip_t* clip, void* data, uint64_t count,
                                         hps_dtype_t dtype, uint32_t flags) {
  HPS_CHECK_ARG(clip);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, hps::dtype_from_int(raw_enum(dtype)));
    if ((flags & ~kKnownFlags) != 0) {
      return hps::invalid_argument("unknown clip flag bits 0x" + [&] {
        char hex[16];
        std::snprintf(hex, sizeof hex, "%x", flags & ~kKnownFlags);
        return std::string(hex);
      }());
    }
    return clip->impl->add_tensor({data, count, d, (flags & HPS_CLIP_DISTRIBUTED) != 0,
                                   (flags & HPS_CLIP_NO_CLIP) == 0,
                                   (flags & HPS_CLIP_SHARED_NOT_FIRST) != 0});
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
  return guard(__func__, [&] { return clip->impl->run(*stream->impl, norm_out, scale != 0); });
}

HPS_API hps_status_t hps_clip_coefficient(hps_clip_t* clip, const float** out_coefficient) {
  HPS_CHECK_ARG(clip);
  HPS_CHECK_ARG(out_coefficient);
  *out_coefficient = clip->impl->coefficient();
  return HPS_STATUS_OK;
}

}  // extern "C"
