#include "core/checkpoint/format.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL  // header-only: libhpshard gains no shared-library dependency
#include <xxhash.h>

#include "core/common/env.h"

namespace hps::ckpt {
namespace {

constexpr char kMagic[8] = {'H', 'P', 'S', 'C', 'K', 'P', 'T', '\0'};

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

std::string data_file_name(int32_t rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", static_cast<int>(rank));
  return name;
}

Status check_checkpoint_name(std::string_view name) {
  if (name.empty() || name.size() > 200) {
    return invalid_argument("checkpoint name must have 1 to 200 characters");
  }
  if (name.front() == '.') {
    return invalid_argument("checkpoint name '" + shown_value(name) + "' starts with '.'");
  }
  if (name == kLatestFile ||
      name.substr(0, kLatestTemporaryPrefix.size()) == kLatestTemporaryPrefix) {
    return invalid_argument("'" + std::string(name) + "' names the latest pointer's file");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return invalid_argument("checkpoint name '" + shown_value(name) +
                              "' has a character outside [A-Za-z0-9._-]");
    }
  }
  return Status::Ok();
}

std::string new_checkpoint_id() {
  std::random_device device;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    char part[16];
    std::snprintf(part, sizeof part, "%08x", static_cast<unsigned>(device()));
    id += part;
  }
  return id;
}

bool is_checkpoint_id(std::string_view text) {
  if (text.size() != 32) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

uint64_t checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

namespace {

// `bytes` from `src` to `dst`; stores that bypass the cache where `dst` allows.
void copy_streaming(uint8_t* dst, const uint8_t* src, size_t bytes) {
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  size_t at = head;
  for (; at + 64 <= bytes; at += 64) {
    const auto* s = reinterpret_cast<const __m128i*>(src + at);
    auto* d = reinterpret_cast<__m128i*>(dst + at);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  std::memcpy(dst + at, src + at, bytes - at);
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace

uint64_t copy_with_checksum(void* dst, const void* src, size_t bytes) {
  // Each block is copied into a buffer that stays in cache, hashed there, then stored from
  // there: the sum is of the bytes stored even where `src` changes meanwhile (a host write
  // racing the snapshot makes a checkpoint of either value, never one failing its
  // checksum), and memory still sees one read of `src` and one write of `dst`.
  constexpr size_t kBlock = size_t{16} << 10;
  alignas(64) static thread_local uint8_t bounce[kBlock];
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t at = 0; at < bytes; at += kBlock) {
    const size_t n = std::min(kBlock, bytes - at);
    std::memcpy(bounce, s + at, n);
    XXH3_64bits_update(&state, bounce, n);
    copy_streaming(d + at, bounce, n);
  }
#if defined(__SSE2__)
  _mm_sfence();  // the streaming stores are visible before whatever follows the copy
#endif
  return XXH3_64bits_digest(&state);
}

std::string hex64(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::optional<uint64_t> parse_hex64(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : text) {
    uint64_t digit = 0;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return std::nullopt;
    }
    v = (v << 4) | digit;
  }
  return v;
}

std::string data_file_header(std::string_view id, int32_t rank) {
  std::string header(kDataHeaderBytes, '\0');
  auto* p = reinterpret_cast<uint8_t*>(header.data());
  std::memcpy(p, kMagic, sizeof kMagic);
  put_u32(p + 8, kFormatVersion);
  put_u32(p + 12, static_cast<uint32_t>(rank));
  std::memcpy(p + 16, id.data(), std::min<size_t>(id.size(), 32));
  return header;
}

Status check_data_file_header(const uint8_t* header, std::string_view id, int32_t rank,
                              const std::string& path) {
  if (std::memcmp(header, kMagic, sizeof kMagic) != 0) {
    return invalid_argument("file '" + path + "' is not an hpshard checkpoint data file");
  }
  const uint32_t version = get_u32(header + 8);
  if (version != kFormatVersion) {
    return invalid_argument("file '" + path + "' has format version " + std::to_string(version) +
                            "; this hpshard reads version " + std::to_string(kFormatVersion));
  }
  const std::string file_id(reinterpret_cast<const char*>(header + 16), 32);
  if (file_id != id) {
    return invalid_argument("file '" + path + "' belongs to checkpoint " +
                            (is_checkpoint_id(file_id) ? file_id : std::string("(garbled)")) +
                            ", but the manifest is that of checkpoint " + std::string(id) +
                            " (a manifest from another checkpoint?)");
  }
  const uint32_t file_rank = get_u32(header + 12);
  if (file_rank != static_cast<uint32_t>(rank)) {
    return invalid_argument("file '" + path + "' was written by rank " + std::to_string(file_rank) +
                            ", the manifest says rank " + std::to_string(rank));
  }
  return Status::Ok();
}

std::vector<std::pair<uint64_t, uint64_t>> cut_into_chunks(uint64_t begin, uint64_t end,
                                                           uint64_t chunk_elements) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (chunk_elements == 0) chunk_elements = 1;
  uint64_t at = begin;
  while (at < end) {
    const uint64_t boundary = (at / chunk_elements + 1) * chunk_elements;
    const uint64_t stop = std::min(end, boundary);
    out.emplace_back(at, stop);
    at = stop;
  }
  return out;
}

std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return std::nullopt;
  return a * b;
}

std::optional<uint64_t> checked_add(uint64_t a, uint64_t b) {
  if (b > std::numeric_limits<uint64_t>::max() - a) return std::nullopt;
  return a + b;
}

uint64_t round_up(uint64_t value, uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace hps::ckpt
