#include "core/checkpoint/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/checkpoint/file_io.h"
#include "core/common/env.h"
#include "core/common/json_input.h"

namespace hps::ckpt {
namespace {

struct DTypeName {
  std::string_view name;
  DType dtype;
};
constexpr DTypeName kNames[] = {
    {"F32", DType::kFloat32},   {"F64", DType::kFloat64}, {"F16", DType::kFloat16},
    {"BF16", DType::kBFloat16}, {"I32", DType::kInt32},   {"I64", DType::kInt64},
    {"U8", DType::kUInt8},
};

}  // namespace

StatusOr<DType> dtype_from_safetensors(std::string_view name) {
  for (const auto& n : kNames) {
    if (n.name == name) return n.dtype;
  }
  return invalid_argument("safetensors dtype '" + shown_value(name) +
                          "' is not one hpshard holds (F32, F64, F16, BF16, I32, I64, U8)");
}

std::string_view safetensors_dtype(DType dtype) {
  for (const auto& n : kNames) {
    if (n.dtype == dtype) return n.name;
  }
  return "?";
}

StatusOr<SafetensorsHeader> parse_safetensors_header(std::string_view header, uint64_t data_bytes,
                                                     const std::string& origin) {
  using json = nlohmann::json;

  try {
    CheckedJson parsed = parse_checked_json(header, kMaxJsonDepth);
    if (parsed.problem == CheckedJson::Problem::kTooDeep) {
      return invalid_argument(origin + ": header nested too deep");
    }
    if (parsed.problem == CheckedJson::Problem::kRepeatedKey) {
      return invalid_argument(origin + ": key '" + shown_value(parsed.key) + "' repeated");
    }
    const json& j = parsed.value;
    if (parsed.problem != CheckedJson::Problem::kNone || !j.is_object()) {
      return invalid_argument(origin + ": the header is not a JSON object");
    }
    SafetensorsHeader out;
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const auto& [name, entry] : j.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) return invalid_argument(origin + ": __metadata__ is not an object");
        for (const auto& [k, v] : entry.items()) {
          if (!v.is_string())
            return invalid_argument(origin + ": __metadata__ '" + shown_value(k) +
                                    "' is not a string");
          out.metadata[k] = v.get<std::string>();
        }
        continue;
      }
      const std::string where = origin + ": tensor '" + shown_value(name) + "'";
      if (name.empty() || name.size() > kMaxNameBytes)
        return invalid_argument(where + ": bad name length");
      if (has_control_bytes(name))
        return invalid_argument(where + ": its name has control characters");
      if (!entry.is_object()) return invalid_argument(where + " is not an object");
      auto dt = entry.find("dtype");
      auto shape = entry.find("shape");
      auto offsets = entry.find("data_offsets");
      if (dt == entry.end() || !dt->is_string() || shape == entry.end() || !shape->is_array() ||
          offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
          !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
        return invalid_argument(
            where + ": needs dtype (string), shape (array) and data_offsets ([begin, end])");
      }
      StoredTensor t;
      t.name = name;
      auto d = dtype_from_safetensors(dt->get<std::string>());
      if (!d.ok()) return invalid_argument(where + ": " + d.status().message());
      t.dtype = *d;
      if (shape->size() > kMaxDimensions)
        return invalid_argument(where + ": more than 16 dimensions");
      uint64_t numel = 1;
      for (const json& dim : *shape) {
        if (!dim.is_number_unsigned())
          return invalid_argument(where + ": a dimension is not an unsigned integer");
        const uint64_t n = dim.get<uint64_t>();
        auto product = checked_mul(numel, n);
        if (n > kMaxElements || !product || *product > kMaxElements) {
          return invalid_argument(where + ": more than 2^48 elements");
        }
        numel = *product;
        t.shape.push_back(static_cast<int64_t>(n));
      }
      t.numel = numel;
      const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
      auto bytes = checked_mul(numel, dtype_size(t.dtype));
      if (begin > end || end > data_bytes || !bytes || end - begin != *bytes) {
        return invalid_argument(where + ": data_offsets [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") do not hold " + std::to_string(numel) +
                                " elements of " + dt->get<std::string>() + " inside the " +
                                std::to_string(data_bytes) + " data bytes");
      }
      if (numel > 0) {
        t.chunks.push_back({0, 0, numel, begin, std::nullopt});
        spans.emplace_back(begin, end);
      }
      out.tensors.push_back(std::move(t));
    }
    // The format's data is the tensors back to back: no overlap, no hole, nothing after.
    std::sort(spans.begin(), spans.end());
    uint64_t at = 0;
    for (const auto& [begin, end] : spans) {
      if (begin < at) {
        return invalid_argument(origin + ": two tensors' data overlap at byte " +
                                std::to_string(begin));
      }
      if (begin > at) {
        return invalid_argument(origin + ": no tensor holds data bytes [" + std::to_string(at) +
                                ", " + std::to_string(begin) + ")");
      }
      at = end;
    }
    if (at != data_bytes) {
      return invalid_argument(origin + ": " + std::to_string(data_bytes - at) +
                              " data bytes after the last tensor's");
    }
    return out;
  } catch (const std::exception& e) {
    return invalid_argument(origin + ": " + e.what());
  }
}

StatusOr<SourceIndex> read_safetensors(const std::string& path,
                                       std::map<std::string, std::string>* metadata) {
  HPS_ASSIGN_OR_RETURN(File file, File::open_read(path));
  HPS_ASSIGN_OR_RETURN(uint64_t size, file.size());
  uint8_t length_bytes[8];
  if (size < 8) return invalid_argument("'" + path + "' is too short for a safetensors file");
  HPS_RETURN_IF_ERROR(file.pread_all(length_bytes, 8, 0));
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(length_bytes[i]) << (8 * i);
  if (length > kMaxSafetensorsHeaderBytes) {
    return invalid_argument("'" + path + "': header length " + std::to_string(length) +
                            " is more than the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                            " bytes allowed");
  }
  if (length > size - 8) {
    return invalid_argument("'" + path + "': header length " + std::to_string(length) +
                            " does not fit the file (" + std::to_string(size) + " bytes)");
  }
  std::string header(static_cast<size_t>(length), '\0');
  HPS_RETURN_IF_ERROR(file.pread_all(header.data(), header.size(), 8));
  HPS_ASSIGN_OR_RETURN(SafetensorsHeader parsed,
                       parse_safetensors_header(header, size - 8 - length, path));
  SourceIndex s;
  s.description = "safetensors file " + path;
  const std::filesystem::path p(path);
  s.directory = p.parent_path().string();
  s.files.push_back({p.filename().string(), -1, size});
  for (auto& t : parsed.tensors) {
    for (auto& c : t.chunks) c.offset += 8 + length;
    s.tensors.push_back(std::move(t));
  }
  if (metadata != nullptr) *metadata = std::move(parsed.metadata);
  return s;
}

StatusOr<std::string> safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                         const std::map<std::string, std::string>& metadata,
                                         uint64_t* data_bytes) {
  using ordered = nlohmann::ordered_json;
  ordered j = ordered::object();
  if (!metadata.empty()) {
    ordered m = ordered::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  uint64_t at = 0;
  for (const auto& e : entries) {
    if (e.name == "__metadata__" || j.contains(e.name)) {
      return invalid_argument("safetensors: tensor name '" + e.name + "' is reserved or repeated");
    }
    uint64_t numel = 1;
    for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t bytes = numel * dtype_size(e.dtype);
    j[e.name] = {{"dtype", std::string(safetensors_dtype(e.dtype))},
                 {"shape", e.shape},
                 {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = j.dump(-1, ' ', false, ordered::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  // What the reader (hpshard's, and Hugging Face's, which has the same limit) takes back.
  if (text.size() > kMaxSafetensorsHeaderBytes) {
    return invalid_argument("safetensors: the header would have " + std::to_string(text.size()) +
                            " bytes, more than the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                            " a reader takes (fewer or shorter metadata values)");
  }
  std::string out(8, '\0');
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(length >> (8 * i));
  *data_bytes = at;
  return out + text;
}

}  // namespace hps::ckpt
