// ABI-extensible structs of the C API (options and info structs): the first field is
// `size_t struct_size`, fields are only ever appended. One set of rules for all of them:
//
//  - Each struct's size as first released is frozen (kFirstSize): a caller compiled against
//    that header passes at least it; anything smaller is refused.
//  - *_init writes the defaults into min(struct_size, sizeof) bytes and records struct_size;
//    the bytes of a larger (newer) caller's struct beyond that are its own.
//  - Reading a caller's struct: fields past its struct_size keep their defaults (an older
//    caller does not have them); bytes past the last field this library knows must be zero
//    (a newer caller set a field this library cannot honour: refused, naming the bytes).
//  - Filling an output struct writes only the caller's struct_size bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>

#include "capi/src/error.h"

namespace hps::capi {

// Per struct: its name, the frozen first-released size and the end of the last field this
// library knows. Specialised with HPS_EXTENSIBLE_STRUCT below.
template <typename T>
struct Extensible;

// A struct_size above this is no struct but a wild value: refused before any byte is read.
inline constexpr size_t kMaxStructSize = 64 * 1024;

#define HPS_FIELD_END(T, FIELD) (offsetof(T, FIELD) + sizeof(static_cast<T*>(nullptr)->FIELD))
#define HPS_EXTENSIBLE_STRUCT(T, INIT, FIRST_LAST_FIELD, LAST_FIELD)         \
  template <>                                                                \
  struct Extensible<T> {                                                     \
    static constexpr const char* kName = #T;                                 \
    static constexpr const char* kInit = #INIT;                              \
    static constexpr size_t kFirstSize = HPS_FIELD_END(T, FIRST_LAST_FIELD); \
    static constexpr size_t kKnownEnd = HPS_FIELD_END(T, LAST_FIELD);        \
  }

// 0.1.0 released each struct ending after the first field named; the second is the last
// field this library knows. Append a field: change only the second.
HPS_EXTENSIBLE_STRUCT(hps_device_properties_t, hps_device_properties_init, multiprocessor_count,
                      multiprocessor_count);
HPS_EXTENSIBLE_STRUCT(hps_rendezvous_info_t, hps_rendezvous_info_init, source, source);
HPS_EXTENSIBLE_STRUCT(hps_comm_options_t, hps_comm_options_init, name, name);
HPS_EXTENSIBLE_STRUCT(hps_clip_options_t, hps_clip_options_init, deterministic, deterministic);
HPS_EXTENSIBLE_STRUCT(hps_engine_options_t, hps_engine_options_init, growth_interval, bucket_bytes);
// First released in 0.3.0.
HPS_EXTENSIBLE_STRUCT(hps_checkpoint_options_t, hps_checkpoint_options_init, timeout_ms,
                      timeout_ms);
HPS_EXTENSIBLE_STRUCT(hps_checkpoint_load_options_t, hps_checkpoint_load_options_init,
                      allow_partial, allow_partial);
HPS_EXTENSIBLE_STRUCT(hps_checkpoint_info_t, hps_checkpoint_info_init, name, pp_rank);

// The first-released sizes are frozen: on LP64 they are these numbers forever.
static_assert(sizeof(void*) != 8 || Extensible<hps_device_properties_t>::kFirstSize == 292);
static_assert(sizeof(void*) != 8 || Extensible<hps_rendezvous_info_t>::kFirstSize == 660);
static_assert(sizeof(void*) != 8 || Extensible<hps_comm_options_t>::kFirstSize == 32);
static_assert(sizeof(void*) != 8 || Extensible<hps_clip_options_t>::kFirstSize == 20);
static_assert(sizeof(void*) != 8 || Extensible<hps_engine_options_t>::kFirstSize == 96);
static_assert(sizeof(void*) != 8 || Extensible<hps_checkpoint_options_t>::kFirstSize == 32);
static_assert(sizeof(void*) != 8 || Extensible<hps_checkpoint_load_options_t>::kFirstSize == 12);
static_assert(sizeof(void*) != 8 || Extensible<hps_checkpoint_info_t>::kFirstSize == 297);

template <typename T>
std::string struct_size_text(size_t struct_size) {
  using E = Extensible<T>;
  return std::string(E::kName) + " of struct_size " + std::to_string(struct_size) +
         " (the first released one has " + std::to_string(E::kFirstSize) + " bytes, this " +
         "library's " + std::to_string(sizeof(T)) + ")";
}

// The caller's struct_size, refused when below the first release or implausibly large.
template <typename T>
StatusOr<size_t> caller_struct_size(const T* s, const char* argument) {
  using E = Extensible<T>;
  const size_t size = s->struct_size;
  if (size < E::kFirstSize) {
    return invalid_argument(std::string(argument) + "->struct_size is " + std::to_string(size) +
                            ", smaller than the first released " + E::kName + " (" +
                            std::to_string(E::kFirstSize) + " bytes): call " + E::kInit + " first");
  }
  if (size > kMaxStructSize) {
    return invalid_argument(std::string(argument) + "->struct_size " + std::to_string(size) +
                            " is no " + E::kName + " size (more than " +
                            std::to_string(kMaxStructSize) + " bytes)");
  }
  return size;
}

// *_init: `defaults` (built on a zeroed struct, so its padding is zero) into
// min(struct_size, sizeof(T)) bytes of `out`, with struct_size recorded.
template <typename T>
Status init_struct(T* out, size_t struct_size, T defaults) {
  using E = Extensible<T>;
  if (struct_size < E::kFirstSize) {
    return invalid_argument("struct_size " + std::to_string(struct_size) +
                            " is smaller than the first released " + E::kName + " (" +
                            std::to_string(E::kFirstSize) + " bytes)");
  }
  if (struct_size > kMaxStructSize) {
    return invalid_argument("struct_size " + std::to_string(struct_size) + " is no " + E::kName +
                            " size (more than " + std::to_string(kMaxStructSize) + " bytes)");
  }
  defaults.struct_size = struct_size;
  std::memcpy(out, &defaults, std::min(struct_size, sizeof(T)));
  return Status::Ok();
}

// A caller's struct as this library's T: fields past its struct_size are `defaults`'; a
// byte set past the last field this library knows refuses it (nothing is changed).
template <typename T>
StatusOr<T> read_struct(const T* in, T defaults, const char* argument) {
  using E = Extensible<T>;
  HPS_ASSIGN_OR_RETURN(const size_t size, caller_struct_size(in, argument));
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = E::kKnownEnd; i < size; ++i) {
    if (bytes[i] != 0) {
      return invalid_argument(
          std::string(argument) + " (" + struct_size_text<T>(size) + ") has byte " +
          std::to_string(i) + " set, past the last field this library (hpshard " +
          HPS_VERSION_STRING + ") knows, which ends at byte " + std::to_string(E::kKnownEnd) +
          ": a field of a newer hpshard.h it cannot honour. Leave fields this library does "
          "not know zero (initialise the struct with = {0} before its _init)");
    }
  }
  std::memcpy(&defaults, in, std::min(size, sizeof(T)));
  return defaults;
}

// Fills an output struct (initialised by its _init): only the caller's struct_size bytes
// are written, and its struct_size is kept.
template <typename T>
Status write_struct(T* out, T value, const char* argument) {
  HPS_ASSIGN_OR_RETURN(const size_t size, caller_struct_size(out, argument));
  value.struct_size = size;
  std::memcpy(out, &value, std::min(size, sizeof(T)));
  return Status::Ok();
}

// A struct of zero bytes, padding included: the start of every default and output value.
template <typename T>
T zeroed() {
  T value;
  std::memset(&value, 0, sizeof value);
  return value;
}

}  // namespace hps::capi
