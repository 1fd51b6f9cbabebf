// ABI-extensible structs of the C API (options and info structs): the first field is
// `size_t struct_size`, fields are only ever appended. One set of rules for all of them:
//
//  - Each struct's size as first released is frozen (kFirstSize): a caller compiled against
//    that header passes at least it; anything smaller is refused.
//  - A struct_size ending strictly inside a field this library knows (one appended after the
//    first release) is no header's sizeof: refused by every function here, nothing written.
//    Sizes at a field's end or in padding are taken.
//  - *_init writes the defaults into min(struct_size, sizeof) bytes and records struct_size;
//    the bytes of a larger (newer) caller's struct beyond that are its own.
//  - Reading a caller's struct: fields past its struct_size keep their defaults (an older
//    caller does not have them); bytes past the last field this library knows, its tail
//    padding included, must be zero (a newer caller set a field this library cannot honour:
//    refused, naming the bytes).
//  - Filling an output struct writes only the caller's struct_size bytes.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <string>

#include "capi/src/error.h"

namespace hps::capi {

// A field of an extensible struct: bytes [offset, offset + size).
struct KnownField {
  const char* name;
  size_t offset;
  size_t size;
  constexpr size_t end() const { return offset + size; }
};

// Per struct: its name, its _init and the fields from the last one of the first release on
// (kFields): the first release ends with the first of them (kFirstSize), this library knows
// up to the last (kKnownEnd). Specialised with HPS_EXTENSIBLE_STRUCT below.
template <typename T>
struct Extensible;

// A struct_size above this is no struct but a wild value: refused before any byte is read.
inline constexpr size_t kMaxStructSize = 64 * 1024;

// A field of the struct, in the arguments of HPS_EXTENSIBLE_STRUCT.
#define HPS_FIELD(FIELD) \
  ::hps::capi::KnownField { #FIELD, offsetof(Type, FIELD), sizeof(Type::FIELD) }
#define HPS_EXTENSIBLE_STRUCT(T, INIT, ...)                               \
  template <>                                                             \
  struct Extensible<T> {                                                  \
    using Type = T;                                                       \
    static constexpr const char* kName = #T;                              \
    static constexpr const char* kInit = #INIT;                           \
    static constexpr std::array kFields{__VA_ARGS__};                     \
    static constexpr size_t kFirstSize = kFields.front().end();           \
    static constexpr size_t kKnownEnd = kFields.back().end();             \
    static_assert(fields_in_order(kFields, sizeof(T), alignof(T)),        \
                  #T ": list its fields in order, ending with its last"); \
  }

// The fields listed one after the other, and the last one the struct's (its sizeof is the
// last one's end rounded up to its alignment).
template <size_t N>
constexpr bool fields_in_order(const std::array<KnownField, N>& fields, size_t size, size_t align) {
  for (size_t i = 1; i < N; ++i) {
    if (fields[i].offset < fields[i - 1].end()) return false;
  }
  return (fields[N - 1].end() + align - 1) / align * align == size;
}

// 0.1.0 released each struct ending with the first field listed; the fields appended since
// follow it. Append a field to a struct: append it here.
HPS_EXTENSIBLE_STRUCT(hps_device_properties_t, hps_device_properties_init,
                      HPS_FIELD(multiprocessor_count));
HPS_EXTENSIBLE_STRUCT(hps_rendezvous_info_t, hps_rendezvous_info_init, HPS_FIELD(source));
HPS_EXTENSIBLE_STRUCT(hps_comm_options_t, hps_comm_options_init, HPS_FIELD(name));
HPS_EXTENSIBLE_STRUCT(hps_clip_options_t, hps_clip_options_init, HPS_FIELD(deterministic));
HPS_EXTENSIBLE_STRUCT(hps_engine_options_t, hps_engine_options_init, HPS_FIELD(growth_interval),
                      HPS_FIELD(compute_stream),  // 0.2.0
                      HPS_FIELD(bucket_bytes));   // 0.3.0
// First released in 0.3.0.
HPS_EXTENSIBLE_STRUCT(hps_checkpoint_options_t, hps_checkpoint_options_init, HPS_FIELD(timeout_ms));
HPS_EXTENSIBLE_STRUCT(hps_checkpoint_load_options_t, hps_checkpoint_load_options_init,
                      HPS_FIELD(allow_partial));
HPS_EXTENSIBLE_STRUCT(hps_checkpoint_info_t, hps_checkpoint_info_init, HPS_FIELD(name),
                      HPS_FIELD(mp), HPS_FIELD(mp_rank), HPS_FIELD(pp),
                      HPS_FIELD(pp_rank));  // 0.4.0

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

// A struct_size that ends strictly inside a field this library knows: no header's sizeof
// (a caller's struct holds whole fields), refused. `subject` names the struct in the message.
template <typename T>
Status check_field_ends(size_t struct_size, const std::string& subject, const std::string& advice) {
  for (const KnownField& f : Extensible<T>::kFields) {
    if (f.offset < struct_size && struct_size < f.end()) {
      return invalid_argument(subject + " ends inside its field " + f.name + " (bytes " +
                              std::to_string(f.offset) + "-" + std::to_string(f.end() - 1) +
                              "): pass sizeof the struct as compiled" + advice);
    }
  }
  return Status::Ok();
}

// The caller's struct_size, refused when below the first release, implausibly large or
// ending inside a field.
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
  HPS_RETURN_IF_ERROR(check_field_ends<T>(
      size,
      std::string(argument) + " (" + E::kName + " of struct_size " + std::to_string(size) + ")",
      std::string(" to ") + E::kInit));
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
  HPS_RETURN_IF_ERROR(check_field_ends<T>(
      struct_size, std::string(E::kName) + " of struct_size " + std::to_string(struct_size), ""));
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
