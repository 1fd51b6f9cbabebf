#include "core/checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

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

namespace {

using json = nlohmann::json;

// A member of a header's object as read (a tensor's entry, or __metadata__): what its checks
// look at, and nothing else of it.
struct RawEntry {
  std::string name;
  bool object = false;        // its value is an object
  bool dtype_string = false;  // it has "dtype", a string
  std::string dtype;
  bool shape_array = false;  // it has "shape", an array
  uint64_t dimensions = 0;
  std::pair<bool, uint64_t> shape[kMaxDimensions];  // the first ones: unsigned?, value
  bool offsets_array = false;                       // it has "data_offsets", an array
  uint64_t offsets = 0;
  std::pair<bool, uint64_t> offset[2];    // the first two: unsigned?, value
  std::optional<std::string> not_string;  // __metadata__'s least key whose value is no string
};

// The checks of one member alone, in the order (and with the messages) they have always run;
// a tensor's fills `t`.
Status check_entry(const RawEntry& e, uint64_t data_bytes, const std::string& origin,
                   StoredTensor* out) {
  if (e.name == "__metadata__") {
    if (!e.object) return invalid_argument(origin + ": __metadata__ is not an object");
    if (e.not_string) {
      return invalid_argument(origin + ": __metadata__ '" + shown_value(*e.not_string) +
                              "' is not a string");
    }
    return Status::Ok();
  }
  const std::string where = origin + ": tensor '" + shown_value(e.name) + "'";
  if (e.name.empty() || e.name.size() > kMaxNameBytes)
    return invalid_argument(where + ": bad name length");
  if (has_control_bytes(e.name))
    return invalid_argument(where + ": its name has control characters");
  if (!e.object) return invalid_argument(where + " is not an object");
  if (!e.dtype_string || !e.shape_array || !e.offsets_array || e.offsets != 2 ||
      !e.offset[0].first || !e.offset[1].first) {
    return invalid_argument(
        where + ": needs dtype (string), shape (array) and data_offsets ([begin, end])");
  }
  StoredTensor& t = *out;
  t.name = e.name;
  auto d = dtype_from_safetensors(e.dtype);
  if (!d.ok()) return invalid_argument(where + ": " + d.status().message());
  t.dtype = *d;
  if (e.dimensions > kMaxDimensions) return invalid_argument(where + ": more than 16 dimensions");
  uint64_t numel = 1;
  for (uint64_t i = 0; i < e.dimensions; ++i) {
    const auto& [is_unsigned, n] = e.shape[i];
    if (!is_unsigned) return invalid_argument(where + ": a dimension is not an unsigned integer");
    auto product = checked_mul(numel, n);
    if (n > kMaxElements || !product || *product > kMaxElements) {
      return invalid_argument(where + ": more than 2^48 elements");
    }
    numel = *product;
    t.shape.push_back(static_cast<int64_t>(n));
  }
  t.numel = numel;
  const uint64_t begin = e.offset[0].second, end = e.offset[1].second;
  auto bytes = checked_mul(numel, dtype_size(t.dtype));
  if (begin > end || end > data_bytes || !bytes || end - begin != *bytes) {
    return invalid_argument(where + ": data_offsets [" + std::to_string(begin) + ", " +
                            std::to_string(end) + ") do not hold " + std::to_string(numel) +
                            " elements of " + e.dtype + " inside the " +
                            std::to_string(data_bytes) + " data bytes");
  }
  if (numel > 0) t.chunks.push_back({0, 0, numel, begin, std::nullopt});
  return Status::Ok();
}

// One pass of nlohmann's SAX parser over a header: makes JsonChecks' checks (json_input.h)
// and checks each member of the header's object when it ends. The checks ran (and still
// report) in the order of the names, bytewise, as nlohmann's document held them: the first
// member in that order that fails is the header's error, so only the least failing one is
// kept, and once one has failed the tensors and metadata sound so far are let go. No document
// is built: a header costs its text, the keys of the objects open, the tensors and metadata
// it holds, and the member being read.
class HeaderSax final : public json::json_sax_t {
 public:
  HeaderSax(uint64_t data_bytes, const std::string& origin)
      : data_bytes_(data_bytes), origin_(origin) {}

  JsonChecks checks{kMaxJsonDepth};
  bool object = false;                                   // the header is an object
  std::optional<std::pair<std::string, Status>> failed;  // the least member that failed
  std::deque<StoredTensor> tensors;  // sound, in the order read (not copied as it grows)
  std::string metadata;              // __metadata__'s entries when sound: sizes, key, value, ...

  bool null() override { return scalar(Kind::kOther); }
  bool boolean(bool) override { return scalar(Kind::kOther); }
  bool number_integer(number_integer_t) override { return scalar(Kind::kOther); }
  bool number_unsigned(number_unsigned_t v) override { return scalar(Kind::kUnsigned, v); }
  bool number_float(number_float_t, const string_t&) override { return scalar(Kind::kOther); }
  bool binary(binary_t&) override { return false; }  // no JSON text has one
  bool string(string_t& v) override {
    if (roles_.empty()) return scalar(Kind::kOther);
    switch (roles_.back()) {
      case Role::kEntry:
        if (field_ == Field::kDtype) {
          entry_.dtype_string = true;
          entry_.dtype = std::move(v);
        }
        return true;
      case Role::kMetadata:
        if (!failed) {
          const uint32_t sizes[2] = {static_cast<uint32_t>(metadata_key_.size()),
                                     static_cast<uint32_t>(v.size())};
          metadata.append(reinterpret_cast<const char*>(sizes), sizeof sizes);
          metadata += metadata_key_;
          metadata += v;
        }
        return true;
      default: return scalar(Kind::kOther);
    }
  }

  bool start_object(std::size_t) override {
    if (!checks.open(true)) return false;
    roles_.push_back(place(Kind::kObject));
    return true;
  }
  bool start_array(std::size_t) override {
    if (!checks.open(false)) return false;
    roles_.push_back(place(Kind::kArray));
    return true;
  }
  bool key(string_t& key) override {
    if (!checks.key(key)) return false;
    switch (roles_.back()) {
      case Role::kRoot:
        entry_ = RawEntry{};
        entry_.name = std::move(key);
        break;
      case Role::kEntry:
        field_ = key == "dtype"          ? Field::kDtype
                 : key == "shape"        ? Field::kShape
                 : key == "data_offsets" ? Field::kOffsets
                                         : Field::kOther;
        break;
      case Role::kMetadata: metadata_key_ = std::move(key); break;
      default: break;
    }
    return true;
  }
  bool end_object() override {
    checks.close();
    const Role role = roles_.back();
    roles_.pop_back();
    if (role == Role::kEntry || role == Role::kMetadata) end_entry();
    return true;
  }
  bool end_array() override {
    checks.close();
    roles_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    checks.problem = CheckedJson::Problem::kInvalid;
    return false;
  }

 private:
  enum class Role : uint8_t { kSkip, kRoot, kEntry, kShape, kOffsets, kMetadata };
  enum class Field : uint8_t { kOther, kDtype, kShape, kOffsets };
  enum class Kind : uint8_t { kUnsigned, kOther, kArray, kObject };

  bool scalar(Kind kind, uint64_t value = 0) {
    place(kind, value);
    return true;
  }
  // Where a value goes, and (an array or object) the role of what it holds.
  Role place(Kind kind, uint64_t value = 0) {
    if (roles_.empty()) {
      object = kind == Kind::kObject;
      return object ? Role::kRoot : Role::kSkip;
    }
    switch (roles_.back()) {
      case Role::kSkip: return Role::kSkip;
      case Role::kRoot:
        entry_.object = kind == Kind::kObject;
        if (entry_.object) return entry_.name == "__metadata__" ? Role::kMetadata : Role::kEntry;
        end_entry();
        return Role::kSkip;
      case Role::kEntry:
        if (kind != Kind::kArray) return Role::kSkip;
        if (field_ == Field::kShape) {
          entry_.shape_array = true;
          return Role::kShape;
        }
        if (field_ == Field::kOffsets) {
          entry_.offsets_array = true;
          return Role::kOffsets;
        }
        return Role::kSkip;
      case Role::kShape:
        if (entry_.dimensions < kMaxDimensions) {
          entry_.shape[entry_.dimensions] = {kind == Kind::kUnsigned, value};
        }
        ++entry_.dimensions;
        return Role::kSkip;
      case Role::kOffsets:
        if (entry_.offsets < 2) entry_.offset[entry_.offsets] = {kind == Kind::kUnsigned, value};
        ++entry_.offsets;
        return Role::kSkip;
      case Role::kMetadata:
        if (!entry_.not_string || metadata_key_ < *entry_.not_string) {
          entry_.not_string = metadata_key_;
        }
        return Role::kSkip;
    }
    return Role::kSkip;
  }
  void end_entry() {
    if (failed && !(entry_.name < failed->first)) return;
    StoredTensor t;
    Status s = check_entry(entry_, data_bytes_, origin_, &t);
    if (!s.ok()) {
      failed.emplace(std::move(entry_.name), std::move(s));
      std::deque<StoredTensor>().swap(tensors);
      std::string().swap(metadata);
    } else if (!failed && entry_.name != "__metadata__") {
      tensors.push_back(std::move(t));
    }
  }

  uint64_t data_bytes_;
  const std::string& origin_;
  std::vector<Role> roles_;  // of the open arrays and objects
  RawEntry entry_;           // the member being read
  Field field_ = Field::kOther;
  std::string metadata_key_;
};

}  // namespace

StatusOr<SafetensorsHeader> parse_safetensors_header(std::string_view header, uint64_t data_bytes,
                                                     const std::string& origin) {
  // The format's rule (and the reference reader's check): the header starts with '{', so a
  // byte-order mark or leading whitespace, which a JSON parser would skip, is refused.
  if (header.empty() || header.front() != '{') {
    return invalid_argument(origin + ": the header does not start with '{'");
  }
  try {
    HeaderSax sax(data_bytes, origin);
    const bool parsed = !json_has_nul(header) && json::sax_parse(header, &sax);
    switch (sax.checks.finish(parsed)) {
      case CheckedJson::Problem::kNone: break;
      case CheckedJson::Problem::kTooDeep:
        return invalid_argument(origin + ": header nested too deep");
      case CheckedJson::Problem::kRepeatedKey:
        return invalid_argument(origin + ": key '" + shown_value(sax.checks.repeated) +
                                "' repeated");
      case CheckedJson::Problem::kInvalid:
        return invalid_argument(origin + ": the header is not a JSON object");
    }
    if (!sax.object) return invalid_argument(origin + ": the header is not a JSON object");
    if (sax.failed) return std::move(sax.failed->second);
    SafetensorsHeader out;
    std::sort(sax.tensors.begin(), sax.tensors.end(),
              [](const StoredTensor& a, const StoredTensor& b) { return a.name < b.name; });
    out.tensors.reserve(sax.tensors.size());
    while (!sax.tensors.empty()) {
      out.tensors.push_back(std::move(sax.tensors.front()));
      sax.tensors.pop_front();
    }
    // The format's data is the tensors back to back: no overlap, no hole, nothing after.
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const StoredTensor& t : out.tensors) {
      if (!t.chunks.empty()) {
        const StoredChunk& c = t.chunks[0];
        spans.emplace_back(c.offset, c.offset + t.numel * dtype_size(t.dtype));
      }
    }
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
    size_t entries = 0;
    for (size_t i = 0; i < sax.metadata.size(); ++entries) {
      uint32_t sizes[2];
      std::memcpy(sizes, sax.metadata.data() + i, sizeof sizes);
      i += sizeof sizes + sizes[0] + sizes[1];
    }
    // An export adds a few keys of its own to a checkpoint's metadata.
    constexpr size_t kMaxEntries = kMaxMetadataEntries + 16;
    if (entries > kMaxEntries) {
      return invalid_argument(origin + ": __metadata__ has " + std::to_string(entries) +
                              " entries, more than the " + std::to_string(kMaxEntries) +
                              " allowed");
    }
    for (size_t i = 0; i < sax.metadata.size();) {
      uint32_t sizes[2];
      std::memcpy(sizes, sax.metadata.data() + i, sizeof sizes);
      i += sizeof sizes;
      std::string key = sax.metadata.substr(i, sizes[0]);
      i += sizes[0];
      out.metadata.emplace(std::move(key), sax.metadata.substr(i, sizes[1]));
      i += sizes[1];
    }
    return out;
  } catch (const std::bad_alloc&) {
    return out_of_memory(origin + ": the header (" + std::to_string(header.size()) +
                         " bytes) takes more memory to read than there is");
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
  // The data is read from the file whose header this is, whatever the path names by then.
  s.identity = "safetensors header xxh3 " + hex64(checksum(header.data(), header.size())) + ", " +
               std::to_string(size) + " bytes";
  HPS_ASSIGN_OR_RETURN(s.identity_on_host, file.identity());
  s.opened.push_back(std::make_shared<const File>(std::move(file)));
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
    if (e.name == "__metadata__") {
      return invalid_argument(
          "safetensors: no tensor can be named '__metadata__' (the format's key for its "
          "metadata)");
    }
    if (j.contains(e.name)) {
      return invalid_argument("safetensors: tensor name '" + e.name + "' is repeated");
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
