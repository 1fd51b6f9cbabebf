// JSON read from outside (a checkpoint's manifest, a safetensors header, a trace file): checked
// in one pass of nlohmann-json's SAX parser, which is iterative and builds nothing, for what
// JSON leaves open and hpshard refuses: a text nested deeper than a bound, a key repeated
// within an object, a NUL byte. JsonChecks makes those checks for a SAX handler that reads
// such a text in one pass and keeps what it needs (core/checkpoint/manifest.cc,
// core/checkpoint/safetensors.cc); parse_checked_json makes them and then has nlohmann build
// the document, which is shallow. Header-only: the tools that link no hpshard library use it
// too.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hps {

struct CheckedJson {
  enum class Problem { kNone, kInvalid, kTooDeep, kRepeatedKey };
  Problem problem = Problem::kNone;
  std::string key;       // kRepeatedKey: the first key repeated
  nlohmann::json value;  // kNone: the document
};

// The checks of one pass over a JSON text: its handler calls open() at each array or object
// it starts, key() at each key, close() at each end, and finish() after the pass. A key is
// checked against those before it in its object without a set: while an object's keys come
// in order (as in every file hpshard writes) a repeat is the key just before; the keys of an
// object whose keys did not come in order are sorted at its end (or the pass's, when it
// stops inside). The first repeat in the text is the one named, as a check that stopped at
// it would: a pass that goes on past a repeat not yet found ends in that repeat all the same.
// The keys of the open objects are kept, each after 8 bytes (texts under 4 GiB).
class JsonChecks {
 public:
  explicit JsonChecks(size_t max_depth) : max_depth_(max_depth) {}

  CheckedJson::Problem problem = CheckedJson::Problem::kNone;
  std::string repeated;  // kRepeatedKey: the key (after finish())

  size_t depth() const { return frames_.size(); }
  // Whether the keys of the innermost open object so far came in order (bytewise).
  bool in_order() const { return frames_.back().sorted; }

  // False (kTooDeep) when the array or object opened is nested deeper than max_depth.
  bool open(bool object) {
    if (frames_.size() + 1 > max_depth_) {
      problem = CheckedJson::Problem::kTooDeep;
      return false;
    }
    frames_.push_back({object, true, keys_.size(), kNone});
    return true;
  }
  // False (kRepeatedKey) when `key` repeats the key just before it in its object.
  bool key(const std::string& key) {
    Frame& f = frames_.back();
    if (f.sorted && f.last != kNone) {
      const std::string_view last = key_at(f.last);
      if (key == last) {
        found(seq_, key);
        problem = CheckedJson::Problem::kRepeatedKey;
        return false;
      }
      if (std::string_view(key) < last) f.sorted = false;
    }
    f.last = keys_.size();
    const uint32_t head[2] = {static_cast<uint32_t>(key.size()), seq_++};
    keys_.append(reinterpret_cast<const char*>(head), sizeof head);
    keys_ += key;
    return true;
  }
  void close() {
    const Frame& f = frames_.back();
    if (!f.sorted) find_repeat(f, keys_.size());
    keys_.resize(f.start);
    frames_.pop_back();
    if (frames_.empty()) std::string().swap(keys_);
  }
  // After the pass (`parsed`: sax_parse's result): the problem of the text, the first
  // repeated key (in `repeated`) before any other.
  CheckedJson::Problem finish(bool parsed) {
    for (size_t i = 0; i < frames_.size(); ++i) {
      if (!frames_[i].sorted) {
        find_repeat(frames_[i], i + 1 < frames_.size() ? frames_[i + 1].start : keys_.size());
      }
    }
    if (first_) {
      problem = CheckedJson::Problem::kRepeatedKey;
      repeated = std::move(first_->second);
    } else if (!parsed && problem == CheckedJson::Problem::kNone) {
      problem = CheckedJson::Problem::kInvalid;
    }
    return problem;
  }

 private:
  static constexpr size_t kNone = SIZE_MAX;
  struct Frame {
    bool object;
    bool sorted;   // its keys so far came in order
    size_t start;  // where its keys start in keys_
    size_t last;   // where its last key is in keys_ (kNone: none yet)
  };

  uint32_t seq_at(size_t at) const {
    uint32_t head[2];
    std::memcpy(head, keys_.data() + at, sizeof head);
    return head[1];
  }
  std::string_view key_at(size_t at) const {
    uint32_t head[2];
    std::memcpy(head, keys_.data() + at, sizeof head);
    return std::string_view(keys_).substr(at + sizeof head, head[0]);
  }
  void found(uint32_t seq, std::string_view key) {
    if (!first_ || seq < first_->first) first_.emplace(seq, std::string(key));
  }
  // The first key of `f` (whose keys are keys_[f.start, end)) that repeats one before it.
  void find_repeat(const Frame& f, size_t end) {
    std::vector<size_t> at;
    for (size_t i = f.start; i < end; i += 8 + key_at(i).size()) at.push_back(i);
    // Equal keys in the order they came (their place in keys_).
    std::sort(at.begin(), at.end(), [&](size_t a, size_t b) {
      const int c = key_at(a).compare(key_at(b));
      return c != 0 ? c < 0 : a < b;
    });
    for (size_t i = 1; i < at.size(); ++i) {
      if (key_at(at[i]) == key_at(at[i - 1]) && (i < 2 || key_at(at[i - 2]) != key_at(at[i]))) {
        found(seq_at(at[i]), key_at(at[i]));
      }
    }
  }

  size_t max_depth_;
  std::vector<Frame> frames_;
  std::string keys_;  // the open objects' keys, each after its size and its place in the text
  uint32_t seq_ = 0;  // keys so far
  std::optional<std::pair<uint32_t, std::string>> first_;  // the first repeat found
};

// Whether `text` has a NUL byte, which is no JSON (inside a string it must be escaped) and
// which nlohmann's lexer takes for the input's end, leaving the bytes after it unread.
inline bool json_has_nul(std::string_view text) {
  return text.find('\0') != std::string_view::npos;
}

namespace json_input_detail {

// Makes JsonChecks' checks and keeps nothing else.
class Checker final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit Checker(size_t max_depth) : checks(max_depth) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return checks.open(true); }
  bool key(string_t& key) override { return checks.key(key); }
  bool end_object() override {
    checks.close();
    return true;
  }
  bool start_array(std::size_t) override { return checks.open(false); }
  bool end_array() override {
    checks.close();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    checks.problem = CheckedJson::Problem::kInvalid;
    return false;
  }

  JsonChecks checks;
};

}  // namespace json_input_detail

// `text` parsed, or why not: invalid JSON (a NUL byte anywhere included), nested deeper than
// `max_depth` arrays and objects, or a key repeated within one object (JSON leaves that open;
// nlohmann keeps the last, and no file hpshard reads has any).
inline CheckedJson parse_checked_json(std::string_view text, size_t max_depth) {
  CheckedJson out;
  if (json_has_nul(text)) {
    out.problem = CheckedJson::Problem::kInvalid;
    return out;
  }
  json_input_detail::Checker checker(max_depth);
  const bool ok = nlohmann::json::sax_parse(text, &checker);
  out.problem = checker.checks.finish(ok);
  if (out.problem != CheckedJson::Problem::kNone) {
    out.key = std::move(checker.checks.repeated);
    return out;
  }
  out.value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out.value.is_discarded()) out.problem = CheckedJson::Problem::kInvalid;
  return out;
}

}  // namespace hps
