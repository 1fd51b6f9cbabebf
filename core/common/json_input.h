// JSON read from outside (a safetensors header, a trace file; a checkpoint's manifest has a
// pass of its own, core/checkpoint/manifest.cc, making the same checks with no document):
// parsed by nlohmann-json after one pass of its SAX parser that refuses a text nested
// deeper than a bound or repeating a key within an object. The SAX pass is iterative and
// builds nothing, so a hostile text costs linear time and no stack; the document nlohmann
// then builds (and copies and dumps recursively) is shallow. Header-only: the tools that
// link no hpshard library use it too.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace hps {

struct CheckedJson {
  enum class Problem { kNone, kInvalid, kTooDeep, kRepeatedKey };
  Problem problem = Problem::kNone;
  std::string key;       // kRepeatedKey: the first key repeated
  nlohmann::json value;  // kNone: the document
};

namespace json_input_detail {

// Counts nesting and the keys of each open object; stops at the first problem.
class Checker final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit Checker(size_t max_depth) : max_depth_(max_depth) {}
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
    problem = CheckedJson::Problem::kRepeatedKey;
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
    problem = CheckedJson::Problem::kInvalid;
    return false;
  }

  CheckedJson::Problem problem = CheckedJson::Problem::kNone;
  std::string repeated;

 private:
  bool open() {
    if (++depth_ <= max_depth_) return true;
    problem = CheckedJson::Problem::kTooDeep;
    return false;
  }
  size_t max_depth_;
  size_t depth_ = 0;
  std::vector<std::set<std::string>> keys_;
};

}  // namespace json_input_detail

// `text` parsed, or why not: invalid JSON (a NUL byte anywhere included), nested deeper than
// `max_depth` arrays and objects, or a key repeated within one object (JSON leaves that open;
// nlohmann keeps the last, and no file hpshard reads has any).
inline CheckedJson parse_checked_json(std::string_view text, size_t max_depth) {
  CheckedJson out;
  // nlohmann's lexer ends the input at a NUL byte, so the bytes after one would go unread;
  // a NUL is no JSON (inside a string it must be escaped): refused.
  if (text.find('\0') != std::string_view::npos) {
    out.problem = CheckedJson::Problem::kInvalid;
    return out;
  }
  json_input_detail::Checker checker(max_depth);
  const bool ok = nlohmann::json::sax_parse(text, &checker);
  if (!ok || checker.problem != CheckedJson::Problem::kNone) {
    out.problem = checker.problem == CheckedJson::Problem::kNone ? CheckedJson::Problem::kInvalid
                                                                 : checker.problem;
    out.key = std::move(checker.repeated);
    return out;
  }
  out.value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out.value.is_discarded()) out.problem = CheckedJson::Problem::kInvalid;
  return out;
}

}  // namespace hps
