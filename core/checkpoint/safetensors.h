// The safetensors format (the Hugging Face ecosystem's): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets":
// [begin, end]}, ..., "__metadata__": {"k": "v"}}, then the raw little-endian data, the
// offsets relative to its start. Reading checks the header as hostile input.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/checkpoint/manifest.h"

namespace hps::ckpt {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// "F32", "BF16", ...; INVALID_ARGUMENT for a type hpshard does not hold.
StatusOr<DType> dtype_from_safetensors(std::string_view name);
std::string_view safetensors_dtype(DType dtype);

struct SafetensorsHeader {
  std::vector<StoredTensor> tensors;  // one chunk each, offsets relative to the data start
  std::map<std::string, std::string> metadata;
};
// Parses the JSON header; `data_bytes` is the size of the data section after it.
StatusOr<SafetensorsHeader> parse_safetensors_header(std::string_view header, uint64_t data_bytes,
                                                     const std::string& origin);
// Reads `path`'s header: its tensors as a SourceIndex (one file, offsets absolute, no
// checksums), and the metadata into *metadata when not null.
StatusOr<SourceIndex> read_safetensors(const std::string& path,
                                       std::map<std::string, std::string>* metadata = nullptr);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
};
// The 8 length bytes and the JSON header (padded with spaces to a multiple of 8) of a file
// holding `entries` in this order, back to back; *data_bytes receives the data's size.
StatusOr<std::string> safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                         const std::map<std::string, std::string>& metadata,
                                         uint64_t* data_bytes);

}  // namespace hps::ckpt
