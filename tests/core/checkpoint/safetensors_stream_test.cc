// A safetensors header is read in one SAX pass that builds no document: it gives what the
// reader that built nlohmann's document of the header gave (kept here as the reference), the
// same tensors and metadata or the same error, for many random headers, sound and broken in
// every way the checks refuse; and a hostile header costs a small multiple of its size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/checkpoint/format.h"
#include "core/checkpoint/safetensors.h"
#include "core/common/env.h"
#include "tests/core/checkpoint/hostile_text.h"
#include "tests/support/seeds.h"

namespace hps::ckpt {
namespace {

using json = nlohmann::json;

// The reference: parse_safetensors_header as it was when it built the document (its checks
// of the JSON were parse_checked_json's then: a set of the keys of each open object).
struct ReferenceJson {
  enum class Problem { kNone, kInvalid, kTooDeep, kRepeatedKey };
  Problem problem = Problem::kNone;
  std::string key;
  json value;
};

class ReferenceChecker final : public nlohmann::json_sax<json> {
 public:
  explicit ReferenceChecker(size_t max_depth) : max_depth_(max_depth) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return open();
  }
  bool key(string_t& key) override {
    if (keys_.back().insert(key).second) return true;
    problem = ReferenceJson::Problem::kRepeatedKey;
    repeated = key;
    return false;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    problem = ReferenceJson::Problem::kInvalid;
    return false;
  }

  ReferenceJson::Problem problem = ReferenceJson::Problem::kNone;
  std::string repeated;

 private:
  bool open() {
    if (++depth_ <= max_depth_) return true;
    problem = ReferenceJson::Problem::kTooDeep;
    return false;
  }
  size_t max_depth_;
  size_t depth_ = 0;
  std::vector<std::set<std::string>> keys_;
};

ReferenceJson reference_checked_json(std::string_view text, size_t max_depth) {
  ReferenceJson out;
  if (text.find('\0') != std::string_view::npos) {
    out.problem = ReferenceJson::Problem::kInvalid;
    return out;
  }
  ReferenceChecker checker(max_depth);
  const bool ok = json::sax_parse(text, &checker);
  if (!ok || checker.problem != ReferenceJson::Problem::kNone) {
    out.problem = checker.problem == ReferenceJson::Problem::kNone
                      ? ReferenceJson::Problem::kInvalid
                      : checker.problem;
    out.key = std::move(checker.repeated);
    return out;
  }
  out.value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out.value.is_discarded()) out.problem = ReferenceJson::Problem::kInvalid;
  return out;
}

StatusOr<SafetensorsHeader> reference_parse(std::string_view header, uint64_t data_bytes,
                                            const std::string& origin) {
  // The format: the header's first byte is '{'.
  if (header.substr(0, 1) != "{") {
    return invalid_argument(origin + ": the header does not start with '{'");
  }
  try {
    ReferenceJson parsed = reference_checked_json(header, kMaxJsonDepth);
    if (parsed.problem == ReferenceJson::Problem::kTooDeep) {
      return invalid_argument(origin + ": header nested too deep");
    }
    if (parsed.problem == ReferenceJson::Problem::kRepeatedKey) {
      return invalid_argument(origin + ": key '" + shown_value(parsed.key) + "' repeated");
    }
    const json& j = parsed.value;
    if (parsed.problem != ReferenceJson::Problem::kNone || !j.is_object()) {
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

// Random headers: JSON text written member by member, so that keys can repeat, come in any
// order, and values be anything.
class Headers {
 public:
  explicit Headers(uint64_t seed) : rng_(seed) {}

  size_t pick(size_t n) { return rng_() % n; }
  bool chance(size_t one_in) { return pick(one_in) == 0; }

  static std::string quoted(const std::string& s) {
    return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  // Members written in the order given, with spaces here and there.
  std::string object(const std::vector<std::pair<std::string, std::string>>& members) {
    std::string out = "{";
    for (size_t i = 0; i < members.size(); ++i) {
      if (i > 0) out += ',';
      if (chance(5)) out += chance(2) ? " " : "\n  ";
      out += members[i].first;
      out += chance(6) ? " : " : ":";
      out += members[i].second;
    }
    return out + "}";
  }
  std::string array(const std::vector<std::string>& elements) {
    std::string out = "[";
    for (size_t i = 0; i < elements.size(); ++i) {
      if (i > 0) out += chance(4) ? ", " : ",";
      out += elements[i];
    }
    return out + "]";
  }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    std::shuffle(v.begin(), v.end(), rng_);
  }

  std::string key() {
    static const char* const kKeys[] = {
        "a", "b", "B", "_", "dtype", "shape", "data_offsets", "\xc3\xa9", "x\ty", "k"};
    return kKeys[pick(std::size(kKeys))];
  }
  std::string number() {
    static const char* const kNumbers[] = {"0",
                                           "1",
                                           "7",
                                           "-1",
                                           "-0",
                                           "1.5",
                                           "2e3",
                                           "1e400",
                                           "18446744073709551615",
                                           "18446744073709551616",
                                           "4",
                                           "12",
                                           "3"};
    return kNumbers[pick(std::size(kNumbers))];
  }
  // A random value, at most `depth` arrays and objects deep; its objects' keys may repeat.
  std::string value(int depth) {
    switch (depth > 0 ? pick(8) : pick(4)) {
      case 0: return number();
      case 1: return quoted(chance(3) ? "F32" : key());
      case 2: return chance(2) ? "true" : "null";
      case 3: return number();
      case 4:
      case 5: {
        std::vector<std::string> e(pick(4));
        for (auto& v : e) v = value(depth - 1);
        return array(e);
      }
      default: {
        std::vector<std::pair<std::string, std::string>> m(pick(4));
        for (auto& [k, v] : m) {
          k = quoted(key());
          v = value(depth - 1);
        }
        return object(m);
      }
    }
  }
  // Arrays `levels` deep.
  static std::string nested(size_t levels) {
    return std::string(levels, '[') + std::string(levels, ']');
  }

  std::string name() {
    static const char* const kNames[] = {"w",   "b",  "W", "_a",  "layer.0.w",   "\xc3\xa9",
                                         "emb", "Z9", "~", "a b", "__metadata_", "__metadatb__"};
    switch (pick(12)) {
      case 0: return std::string(1 + pick(5), static_cast<char>('a' + pick(26)));
      case 1: return "t" + std::to_string(pick(1000));
      default: return kNames[pick(std::size(kNames))];
    }
  }
  std::string bad_name() {
    switch (pick(4)) {
      case 0: return "";
      case 1: return std::string(kMaxNameBytes + 1 - pick(2), 'n');
      case 2: return std::string("x\x01y");
      default: return std::string("a\0b", 3);
    }
  }

  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

struct Header {
  std::string text;
  uint64_t data_bytes = 0;
};

// A header, sound or broken in one or more ways.
Header random_header(Headers& h) {
  struct Tensor {
    std::string name;
    std::string dtype;
    std::vector<uint64_t> shape;
    uint64_t bytes = 0;
  };
  static const std::pair<const char*, uint64_t> kTypes[] = {
      {"F32", 4}, {"F64", 8}, {"F16", 2}, {"BF16", 2}, {"I32", 4}, {"I64", 8}, {"U8", 1}};
  std::vector<Tensor> tensors(h.pick(6));
  std::set<std::string> names;
  for (Tensor& t : tensors) {
    do {
      t.name = h.name();
    } while (!names.insert(t.name).second);
    const auto& [dtype, size] = kTypes[h.pick(std::size(kTypes))];
    t.dtype = dtype;
    t.shape.resize(h.pick(4));
    uint64_t numel = 1;
    for (uint64_t& d : t.shape) {
      d = h.pick(5);
      numel *= d;
    }
    t.bytes = numel * size;
  }
  // Data in another order than the names'.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  h.shuffle(order);
  std::vector<std::pair<uint64_t, uint64_t>> offsets(tensors.size());
  uint64_t at = 0;
  for (size_t i : order) {
    offsets[i] = {at, at + tensors[i].bytes};
    at += tensors[i].bytes;
  }
  Header out;
  out.data_bytes = at;
  const size_t broken = h.chance(4) ? 0 : 1 + h.pick(3);  // how many things to break
  auto breaks = [&](size_t one_in) { return broken > 0 && h.chance(one_in); };

  std::vector<std::pair<std::string, std::string>> members;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (breaks(10)) continue;  // its bytes held by no tensor
    std::vector<std::string> dims;
    for (uint64_t d : t.shape) dims.push_back(std::to_string(d));
    std::string dtype = Headers::quoted(t.dtype);
    std::string shape;
    std::string begin = std::to_string(offsets[i].first), end = std::to_string(offsets[i].second);
    std::vector<std::string> offset_values = {begin, end};
    std::vector<std::pair<std::string, std::string>> fields;
    if (breaks(8)) {
      static const char* const kDtypes[] = {"\"F8_E4M3\"", "\"f32\"",   "4",
                                            "null",        "[\"F32\"]", "\"\""};
      dtype = h.chance(5) ? Headers::quoted(std::string(100, 'D')) : kDtypes[h.pick(6)];
    }
    if (breaks(8)) {
      switch (h.pick(7)) {
        case 0: dims.push_back("-1"); break;
        case 1: dims.push_back("1.5"); break;
        case 2: dims.assign(17 + h.pick(3), "1"); break;
        case 3: dims = {"16777216", "16777217"}; break;
        case 4: dims = {"18446744073709551615"}; break;
        case 5: dims.push_back(h.value(2)); break;
        default: dims.assign(16, h.chance(2) ? "1" : "2"); break;
      }
    }
    shape = h.array(dims);
    if (breaks(10)) shape = h.value(1);
    if (breaks(8)) {
      switch (h.pick(7)) {
        case 0: offset_values.pop_back(); break;
        case 1: offset_values.push_back("0"); break;
        case 2: offset_values[h.pick(2)] = "-1"; break;
        case 3: offset_values[h.pick(2)] = std::to_string(offsets[i].second + 1 + h.pick(3)); break;
        case 4: std::swap(offset_values[0], offset_values[1]); break;
        case 5: {  // a hole or an overlap
          const uint64_t by = 1 + h.pick(4);
          const bool down = offsets[i].first >= by && h.chance(2);
          offset_values = {std::to_string(down ? offsets[i].first - by : offsets[i].first + by),
                           std::to_string(down ? offsets[i].second - by : offsets[i].second + by)};
          break;
        }
        default: offset_values[h.pick(2)] = h.value(1); break;
      }
    }
    std::string data_offsets = h.array(offset_values);
    if (breaks(12)) data_offsets = h.value(1);
    if (!breaks(12)) fields.emplace_back("\"dtype\"", dtype);
    if (!breaks(12)) fields.emplace_back("\"shape\"", shape);
    if (!breaks(12)) fields.emplace_back("\"data_offsets\"", data_offsets);
    // Unknown fields, anything under them.
    while (h.chance(3)) fields.emplace_back(Headers::quoted("u" + h.key()), h.value(3));
    if (breaks(10)) {
      fields.emplace_back(Headers::quoted("x"), Headers::nested(28 + h.pick(4)));  // at 3
    }
    if (breaks(12) && !fields.empty()) fields.push_back(fields[h.pick(fields.size())]);
    h.shuffle(fields);
    std::string value = h.object(fields);
    if (breaks(12)) value = h.value(2);
    std::string name = t.name;
    if (breaks(12)) name = h.bad_name();
    members.emplace_back(Headers::quoted(name), value);
  }
  if (h.chance(2) || breaks(4)) {
    std::vector<std::pair<std::string, std::string>> metadata;
    std::set<std::string> keys;
    for (size_t n = h.pick(5); n > 0; --n) {
      std::string k = h.chance(6) ? std::string("k\x01") : h.name();
      if (!keys.insert(k).second) continue;
      std::string v = Headers::quoted(h.chance(4) ? std::string("caf\xc3\xa9\n") : h.key());
      if (breaks(8)) v = h.value(2);
      metadata.emplace_back(Headers::quoted(k), v);
    }
    if (breaks(12) && !metadata.empty()) metadata.push_back(metadata[h.pick(metadata.size())]);
    h.shuffle(metadata);
    std::string value = h.object(metadata);
    if (breaks(10)) value = h.value(2);
    members.emplace_back("\"__metadata__\"", value);
  }
  while (breaks(6)) members.emplace_back(Headers::quoted(h.name()), h.value(2));
  if (breaks(10) && !members.empty()) members.push_back(members[h.pick(members.size())]);
  if (breaks(12)) members.emplace_back("\"deep\"", Headers::nested(30 + h.pick(4)));  // at 2
  // In the names' order (as hpshard writes), or shuffled.
  if (h.chance(2)) {
    h.shuffle(members);
  } else {
    std::stable_sort(members.begin(), members.end(),
                     [](const std::pair<std::string, std::string>& a,
                        const std::pair<std::string, std::string>& b) {
                       return json::parse(a.first).get<std::string>() <
                              json::parse(b.first).get<std::string>();
                     });
  }
  out.text = h.object(members);
  if (breaks(10)) out.text = h.value(3);
  if (breaks(12)) {
    switch (h.pick(5)) {
      case 0: out.text.resize(h.pick(out.text.size() + 1)); break;
      case 1: out.text.insert(h.pick(out.text.size() + 1), 1, '\0'); break;
      case 2: out.text += h.chance(2) ? " x" : "{}"; break;
      case 3: out.text.insert(h.pick(out.text.size() + 1), 1, '\xff'); break;
      default: out.text += "   "; break;
    }
  }
  if (breaks(8)) out.data_bytes += h.chance(2) ? 4 : -1;
  // Last, so the draws above stay as they were: a BOM or a space before the '{'.
  if (breaks(20)) out.text.insert(0, h.chance(2) ? "\xEF\xBB\xBF" : " ");
  return out;
}

bool same_tensor(const StoredTensor& a, const StoredTensor& b) {
  if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.numel != b.numel ||
      a.chunks.size() != b.chunks.size()) {
    return false;
  }
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    const StoredChunk& x = a.chunks[i];
    const StoredChunk& y = b.chunks[i];
    if (x.file != y.file || x.begin != y.begin || x.end != y.end || x.offset != y.offset ||
        x.xxh3 != y.xxh3) {
      return false;
    }
  }
  return true;
}

TEST(SafetensorsStream, RandomHeadersReadAsTheDocumentReadThem) {
  // Every check's error.
  static const char* const kKinds[] = {"the header is not a JSON object",
                                       "does not start with '{'",
                                       "header nested too deep",
                                       "' repeated",
                                       "__metadata__ is not an object",
                                       "' is not a string",
                                       "bad name length",
                                       "its name has control characters",
                                       "' is not an object",
                                       "needs dtype (string)",
                                       "is not one hpshard holds",
                                       "more than 16 dimensions",
                                       "a dimension is not an unsigned integer",
                                       "more than 2^48 elements",
                                       ") do not hold ",
                                       "tensors' data overlap",
                                       "no tensor holds data bytes",
                                       "data bytes after the last tensor's"};
  size_t sound = 0, refused = 0;
  std::set<std::string> seen;  // of kKinds
  for (uint64_t seed : testing_util::seeds_from_env("HPS_SAFETENSORS", 10000)) {
    Headers h(seed);
    const Header header = random_header(h);
    auto expected = reference_parse(header.text, header.data_bytes, "m.safetensors");
    auto got = parse_safetensors_header(header.text, header.data_bytes, "m.safetensors");
    const std::string shown =
        "seed " + std::to_string(seed) + " (HPS_SAFETENSORS_SEED), " +
        std::to_string(header.data_bytes) + " data bytes: " +
        (std::getenv("HPS_SHOW") ? header.text : shown_value(header.text.substr(0, 2000)));
    ASSERT_EQ(got.ok(), expected.ok()) << shown << "\n got: " << got.status().to_string()
                                       << "\n expected: " << expected.status().to_string();
    if (!expected.ok()) {
      ++refused;
      EXPECT_EQ(got.status().code(), expected.status().code()) << shown;
      EXPECT_EQ(got.status().message(), expected.status().message()) << shown;
      for (const char* kind : kKinds) {
        if (expected.status().message().find(kind) != std::string::npos) seen.insert(kind);
      }
      continue;
    }
    ++sound;
    EXPECT_EQ(got->metadata, expected->metadata) << shown;
    ASSERT_EQ(got->tensors.size(), expected->tensors.size()) << shown;
    for (size_t i = 0; i < got->tensors.size(); ++i) {
      EXPECT_TRUE(same_tensor(got->tensors[i], expected->tensors[i]))
          << shown << "\n tensor " << i << ": " << got->tensors[i].name << " / "
          << expected->tensors[i].name;
    }
  }
  // Both came up often, and every kind of refusal.
  EXPECT_GT(sound, 1000u);
  EXPECT_GT(refused, 3000u);
  for (const char* kind : kKinds) EXPECT_EQ(seen.count(kind), 1u) << kind;
  std::printf("%zu sound, %zu refused\n", sound, refused);
}

// Hostile headers of 64 MiB, each read in a child whose address space may grow by 5 times
// the text at most: each gives the result it should (no allocation refused), none aborts.
TEST(SafetensorsStream, HostileHeadersStayWithinAFewTimesTheirSize) {
#ifdef HPS_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator reserves address space of its own";
#else
  constexpr size_t kBytes = size_t{64} << 20;
  const std::string tensor = R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4])";
  struct Case {
    const char* what;
    std::string text;
    const char* result;  // a part of the message ("": the header is sound)
  };
  const Case cases[] = {
      {"tiny entries", testing_util::repeated("{", R"("k%09d":0)", "}", kBytes),
       "tensor 'k000000000' is not an object"},
      {"tiny entries in reverse order",
       testing_util::repeated("{", R"("k%09d":0)", "}", kBytes, true), "is not an object"},
      {"tiny entries, one repeated at the end",
       testing_util::repeated("{", R"("k%09d":0)", R"(,"k999999999":1})", kBytes, true),
       "key 'k999999999' repeated"},
      {"zeros under an unknown key",
       testing_util::repeated("{" + tensor + R"(,"x":[)", "0", "]}}", kBytes), ""},
      {"a huge shape",
       testing_util::repeated(R"({"w":{"dtype":"F32","data_offsets":[0,4],"shape":[)", "0", "]}}",
                              kBytes),
       "more than 16 dimensions"},
      {"deep nesting just under the limit",
       testing_util::repeated("{" + tensor + R"(,"x":[)", Headers::nested(29), "]}}", kBytes), ""},
      {"tiny metadata entries",
       testing_util::repeated(R"({"__metadata__":{)", R"("k%09d":"")", R"(},"~":0})", kBytes),
       "tensor '~' is not an object"},
      {"tiny metadata entries of a sound header",
       testing_util::repeated(R"({"__metadata__":{)", R"("k%09d":"")", "}," + tensor + "}}",
                              kBytes),
       "more than the 65552 allowed"},
      {"tiny sound tensors",
       testing_util::repeated("{" + tensor + "},",
                              R"("k%09d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})", "}",
                              kBytes),
       ""},
      {"empty objects under an unknown key",
       testing_util::repeated("{" + tensor + R"(,"x":[)", "{}", "]}}", kBytes), ""},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(testing_util::read_within(c.what, c.text.size(), 5, [&c](std::string& shown) {
      auto h = parse_safetensors_header(c.text, 4, "hostile.safetensors");
      shown = h.status().to_string();
      return *c.result == '\0' ? h.ok()
                               : !h.ok() && h.status().code() == StatusCode::kInvalidArgument &&
                                     h.status().message().find(c.result) != std::string::npos;
    }));
  }
#endif
}

}  // namespace
}  // namespace hps::ckpt
