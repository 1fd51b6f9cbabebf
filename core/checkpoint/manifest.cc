#include "core/checkpoint/manifest.h"

#define XXH_INLINE_ALL  // header-only, as format.cc
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <unordered_set>

#include "core/checkpoint/file_io.h"
#include "core/checkpoint/reshard.h"
#include "core/common/env.h"
#include "core/common/json_input.h"

namespace hps::ckpt {
namespace {

using json = nlohmann::json;

// A value read from a manifest, kept only as far as the checks need: its JSON kind, its
// number, a string's length and first kKeptStringBytes bytes (every string check but the
// metadata's, which keeps its values whole, looks no further).
enum class Kind : uint8_t {
  kNull,
  kBoolean,
  kInteger,
  kUnsigned,
  kFloat,
  kString,
  kArray,
  kObject
};
constexpr size_t kKeptStringBytes = std::max(kMaxNameBytes, kMaxStateNameBytes) + 1;

struct Field {
  Kind kind = Kind::kNull;
  bool boolean = false;
  int64_t integer = 0;
  uint64_t unsigned_value = 0;
  double number = 0;
  std::string text;  // kString: its first kKeptStringBytes bytes
  size_t text_bytes = 0;
};

// A JSON value where an object was expected: its kind, and (an object) the fields of it
// that a check reads. The keys are those of the fixed lists below.
struct RawObject {
  Kind kind = Kind::kObject;
  std::vector<std::pair<std::string_view, Field>> fields;

  const Field* find(std::string_view key) const {
    for (const auto& [k, v] : fields) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

// Typed access to an object's fields: every message says where in the manifest the problem
// is.
class Reader {
 public:
  Reader(const RawObject& object, std::string where) : object_(object), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

  StatusOr<const Field*> field(std::string_view key, bool required = true) const {
    if (object_.kind != Kind::kObject) return bad("is not a JSON object");
    const Field* v = object_.find(key);
    if (v == nullptr) {
      if (!required) return v;
      return bad("has no field '" + std::string(key) + "'");
    }
    return v;
  }
  StatusOr<uint64_t> uint(std::string_view key, uint64_t max = UINT64_MAX) const {
    HPS_ASSIGN_OR_RETURN(const Field* v, field(key));
    if (v->kind != Kind::kUnsigned)
      return bad("'" + std::string(key) + "' is not an unsigned integer");
    const uint64_t x = v->unsigned_value;
    if (x > max)
      return bad("'" + std::string(key) + "' is " + std::to_string(x) + ", above " +
                 std::to_string(max));
    return x;
  }
  StatusOr<int64_t> integer(std::string_view key) const {
    HPS_ASSIGN_OR_RETURN(const Field* v, field(key));
    if (v->kind == Kind::kUnsigned) {
      if (v->unsigned_value > static_cast<uint64_t>(INT64_MAX))
        return bad("'" + std::string(key) + "' is too large");
      return static_cast<int64_t>(v->unsigned_value);
    }
    if (v->kind != Kind::kInteger) return bad("'" + std::string(key) + "' is not an integer");
    return v->integer;
  }
  StatusOr<int32_t> int32(std::string_view key, int32_t min, int32_t max) const {
    HPS_ASSIGN_OR_RETURN(int64_t v, integer(key));
    if (v < min || v > max) {
      return bad("'" + std::string(key) + "' is " + std::to_string(v) + ", outside [" +
                 std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return static_cast<int32_t>(v);
  }
  StatusOr<double> number(std::string_view key) const {
    HPS_ASSIGN_OR_RETURN(const Field* v, field(key));
    switch (v->kind) {
      case Kind::kUnsigned: return static_cast<double>(v->unsigned_value);
      case Kind::kInteger: return static_cast<double>(v->integer);
      case Kind::kFloat: return v->number;
      default: return bad("'" + std::string(key) + "' is not a number");
    }
  }
  StatusOr<bool> boolean(std::string_view key) const {
    HPS_ASSIGN_OR_RETURN(const Field* v, field(key));
    if (v->kind != Kind::kBoolean) return bad("'" + std::string(key) + "' is not true or false");
    return v->boolean;
  }
  StatusOr<std::string> string(std::string_view key, size_t max_bytes = kMaxNameBytes) const {
    HPS_ASSIGN_OR_RETURN(const Field* v, field(key));
    if (v->kind != Kind::kString) return bad("'" + std::string(key) + "' is not a string");
    if (v->text_bytes > max_bytes)
      return bad("'" + std::string(key) + "' is longer than " + std::to_string(max_bytes) +
                 " bytes");
    return v->text;
  }
  // OK when `key` is there and an array (whose elements are kept apart).
  Status array(std::string_view key) const {
    HPS_ASSIGN_OR_RETURN(const Field* v, field(key));
    if (v->kind != Kind::kArray) return bad("'" + std::string(key) + "' is not an array");
    return Status::Ok();
  }
  Status bad(const std::string& what) const { return invalid_argument(where_ + ": " + what); }

 private:
  const RawObject& object_;
  std::string where_;
};

json options_to_json(const EngineOptions& o) {
  return {
      {"optimizer", o.optimizer == OptimizerKind::kAdamW ? "adamw" : "sgd"},
      {"learning_rate",
       o.optimizer == OptimizerKind::kAdamW ? o.adamw.learning_rate : o.sgd.learning_rate},
      {"momentum", o.sgd.momentum},
      {"nesterov", o.sgd.nesterov},
      {"weight_decay",
       o.optimizer == OptimizerKind::kAdamW ? o.adamw.weight_decay : o.sgd.weight_decay},
      {"beta1", o.adamw.beta1},
      {"beta2", o.adamw.beta2},
      {"epsilon", o.adamw.epsilon},
      {"clip_max_norm", o.clip_max_norm},
      {"deterministic_clip", o.deterministic_clip},
      {"alignment_bytes", o.alignment_bytes},
      {"accumulation_steps", o.accumulation_steps},
      {"prefetch_window", o.prefetch_window},
      {"dynamic_loss_scaling", o.dynamic_loss_scaling},
      {"initial_loss_scale", o.initial_loss_scale},
      {"growth_factor", o.growth_factor},
      {"backoff_factor", o.backoff_factor},
      {"growth_interval", o.growth_interval},
  };
}

StatusOr<EngineOptions> options_from_json(const Reader& r) {
  EngineOptions o;
  HPS_ASSIGN_OR_RETURN(std::string optimizer, r.string("optimizer"));
  if (optimizer == "adamw") {
    o.optimizer = OptimizerKind::kAdamW;
  } else if (optimizer == "sgd") {
    o.optimizer = OptimizerKind::kSgd;
  } else {
    return r.bad("unknown optimizer '" + optimizer + "'");
  }
  auto f = [&](const char* key) -> StatusOr<float> {
    HPS_ASSIGN_OR_RETURN(double v, r.number(key));
    // A float option was written as a float: anything beyond one's range is no engine's
    // (and converting it would be undefined).
    if (!(std::fabs(v) <= std::numeric_limits<float>::max())) {
      return r.bad(std::string("'") + key + "' is " + json(v).dump() + ", beyond a float");
    }
    return static_cast<float>(v);
  };
  HPS_ASSIGN_OR_RETURN(float lr, f("learning_rate"));
  HPS_ASSIGN_OR_RETURN(float wd, f("weight_decay"));
  o.sgd.learning_rate = o.adamw.learning_rate = lr;
  o.sgd.weight_decay = o.adamw.weight_decay = wd;
  HPS_ASSIGN_OR_RETURN(o.sgd.momentum, f("momentum"));
  HPS_ASSIGN_OR_RETURN(o.sgd.nesterov, r.boolean("nesterov"));
  HPS_ASSIGN_OR_RETURN(o.adamw.beta1, f("beta1"));
  HPS_ASSIGN_OR_RETURN(o.adamw.beta2, f("beta2"));
  HPS_ASSIGN_OR_RETURN(o.adamw.epsilon, f("epsilon"));
  HPS_ASSIGN_OR_RETURN(o.clip_max_norm, r.number("clip_max_norm"));
  HPS_ASSIGN_OR_RETURN(o.deterministic_clip, r.boolean("deterministic_clip"));
  HPS_ASSIGN_OR_RETURN(o.alignment_bytes, r.uint("alignment_bytes", uint64_t{1} << 30));
  HPS_ASSIGN_OR_RETURN(o.accumulation_steps, r.int32("accumulation_steps", 1, INT32_MAX));
  HPS_ASSIGN_OR_RETURN(o.prefetch_window, r.int32("prefetch_window", 1, INT32_MAX));
  HPS_ASSIGN_OR_RETURN(o.dynamic_loss_scaling, r.boolean("dynamic_loss_scaling"));
  HPS_ASSIGN_OR_RETURN(o.initial_loss_scale, f("initial_loss_scale"));
  HPS_ASSIGN_OR_RETURN(o.growth_factor, f("growth_factor"));
  HPS_ASSIGN_OR_RETURN(o.backoff_factor, f("backoff_factor"));
  HPS_ASSIGN_OR_RETURN(o.growth_interval, r.int32("growth_interval", 1, INT32_MAX));
  // Values no engine takes (a negative rate; 1e300, which is no float) are no engine's.
  if (Status s = check_engine_options(o); !s.ok()) {
    constexpr std::string_view kTheirs = "engine: ";  // the Reader names the field already
    std::string_view why = s.message();
    if (why.substr(0, kTheirs.size()) == kTheirs) why.remove_prefix(kTheirs.size());
    return r.bad(std::string(why));
  }
  return o;
}

// The checksum a manifest carries of itself: of its compact JSON without that field. Invalid
// UTF-8 is replaced as the writer replaces it, so a written manifest reads back to the same
// text.
uint64_t manifest_checksum(json j) {
  j.erase(std::string(kManifestChecksumKey));
  const std::string text = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return checksum(text.data(), text.size());
}

bool printable_name(const std::string& s) { return !s.empty() && !has_control_bytes(s); }

constexpr int32_t kMaxWorld = 1 << 24;

// The fields each object of a manifest has that a check reads; the values of others are
// read past and kept nowhere.
constexpr std::string_view kRootKeys[] = {
    kManifestChecksumKey, "format",   "format_version", "id",       "name",
    "created_unix_ns",    "sequence", "chunk_bytes",    "topology", "engine",
    "metadata",           "files",    "tensors"};
constexpr std::string_view kTopologyKeys[] = {
    "stage", "sharding", "dp", "world", "alignment_bytes", "mp", "mp_rank", "pp", "pp_rank"};
constexpr std::string_view kEngineKeys[] = {"optimizer",
                                            "learning_rate",
                                            "weight_decay",
                                            "momentum",
                                            "nesterov",
                                            "beta1",
                                            "beta2",
                                            "epsilon",
                                            "clip_max_norm",
                                            "deterministic_clip",
                                            "alignment_bytes",
                                            "accumulation_steps",
                                            "prefetch_window",
                                            "dynamic_loss_scaling",
                                            "initial_loss_scale",
                                            "growth_factor",
                                            "backoff_factor",
                                            "growth_interval"};
constexpr std::string_view kFileKeys[] = {"rank", "name", "bytes"};
constexpr std::string_view kTensorKeys[] = {"name", "dtype", "shape", "chunks"};
constexpr std::string_view kChunkKeys[] = {"file", "begin", "end", "offset", "xxh3"};

template <size_t N>
std::string_view known_key(const std::string_view (&keys)[N], std::string_view key) {
  for (std::string_view k : keys) {
    if (k == key) return k;
  }
  return {};
}

// A tensor as read: its fields, and its chunks up to the first one whose own fields fail a
// check (a reader stops at that one).
struct RawTensor {
  RawObject object;  // name and dtype, and the kinds of shape and chunks
  uint64_t dimensions = 0;
  std::vector<Field> shape;            // the first kMaxDimensions dimensions
  std::vector<StoredChunk> chunks;     // sound alone, each beginning where the one before ended
  std::optional<RawObject> bad_chunk;  // the chunk after those, when one failed
};

// What a manifest's text holds that its checks read: the elements of its lists up to the
// first that fails a check of its own (a reader stops at that one at the latest).
struct RawManifest {
  Kind kind = Kind::kObject;  // of the whole document
  RawObject root;
  RawObject topology;
  RawObject engine;
  // The canonical text, kept while the metadata is read from it: the metadata object is
  // [metadata_begin, metadata_end) of it (its values are read once every one is a string).
  std::string canonical;
  size_t metadata_begin = 0;
  size_t metadata_end = 0;
  size_t metadata_entries = 0;
  std::optional<std::string> metadata_not_string;   // the least key whose value is no string
  std::vector<std::pair<int32_t, uint64_t>> files;  // sound alone: rank, bytes
  std::optional<RawObject> bad_file;                // the file after those, when one failed
  std::vector<StoredTensor> tensors;                // sound alone
  std::optional<RawTensor> bad_tensor;              // the tensor after those, when one failed
  uint64_t checksum = 0;  // of the canonical text without kManifestChecksumKey
};

// What a tensor's own fields say (`m` null: the checks that need nothing else, whose
// messages go unused), in a reader's order; fills `out` when they pass (moving the chunks).
Status check_tensor(RawTensor& raw, size_t index, const Manifest* m, const std::string& origin,
                    StoredTensor* out);
// A file's fields (`world` 0: the checks that need nothing else); `ranks` (kMaxWorld bits)
// marks the ranks of the files before it.
StatusOr<StoredFile> check_file(const Reader& f, int32_t world, std::vector<bool>& ranks);
// A chunk's own fields; with `m`, those that need the manifest's files and the tensor too.
Status check_chunk(const Reader& c, const Manifest* m, uint64_t covered, uint64_t numel,
                   uint64_t element, StoredChunk* out);

// The metadata's entries, from its canonical text (every value a string; UTF-8 all, as
// nlohmann's lexer takes no other, so the text gives back each key and value).
class MetadataSax final : public json::json_sax_t {
 public:
  explicit MetadataSax(std::map<std::string, std::string>* out) : out_(out) {}
  bool null() override { return false; }
  bool boolean(bool) override { return false; }
  bool number_integer(number_integer_t) override { return false; }
  bool number_unsigned(number_unsigned_t) override { return false; }
  bool number_float(number_float_t, const string_t&) override { return false; }
  bool string(string_t& v) override {
    out_->emplace_hint(out_->end(), std::move(key_), std::move(v));
    return true;
  }
  bool binary(binary_t&) override { return false; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t& key) override {
    key_ = std::move(key);
    return true;
  }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return false; }
  bool end_array() override { return false; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  std::map<std::string, std::string>* out_;
  std::string key_;
};

// One pass of nlohmann's SAX parser over a manifest: makes JsonChecks' checks
// (json_input.h), writes the canonical text the manifest's checksum is of (nlohmann's
// compact dump of its document: keys sorted bytewise as its std::map orders them, invalid
// UTF-8 replaced) and hashes it, and keeps in a RawManifest what the checks read. No
// document is built: a manifest costs its text, the canonical text, and what it holds.
class ManifestSax final : public json::json_sax_t {
 public:
  enum class Role : uint8_t {
    kSkip,
    kRoot,
    kTopology,
    kEngine,
    kMetadata,
    kFiles,
    kFile,
    kTensors,
    kTensor,
    kShape,
    kChunks,
    kChunk
  };

  ManifestSax(size_t text_bytes, std::string origin) : origin_(std::move(origin)) {
    out_.reserve(text_bytes);
  }

  JsonChecks checks{kMaxJsonDepth};
  RawManifest raw;

  bool null() override { return scalar(json(nullptr), Field{}); }
  bool boolean(bool v) override {
    Field f;
    f.kind = Kind::kBoolean;
    f.boolean = v;
    return scalar(json(v), std::move(f));
  }
  bool number_integer(number_integer_t v) override {
    Field f;
    f.kind = Kind::kInteger;
    f.integer = v;
    return scalar(json(v), std::move(f));
  }
  bool number_unsigned(number_unsigned_t v) override {
    Field f;
    f.kind = Kind::kUnsigned;
    f.unsigned_value = v;
    return scalar(json(v), std::move(f));
  }
  bool number_float(number_float_t v, const string_t&) override {
    Field f;
    f.kind = Kind::kFloat;
    f.number = v;
    return scalar(json(v), std::move(f));
  }
  bool string(string_t& v) override {
    comma();
    write_string(v);
    if (!frames_.empty() && frames_.back().role == Role::kMetadata) {
      return true;
    }
    Field f;
    f.kind = Kind::kString;
    f.text_bytes = v.size();
    if (v.size() > kKeptStringBytes) v.resize(kKeptStringBytes);
    f.text = std::move(v);
    place(std::move(f));
    return true;
  }
  bool binary(binary_t&) override { return false; }  // no JSON text has one

  bool start_object(std::size_t) override { return open(Kind::kObject, '{'); }
  bool start_array(std::size_t) override { return open(Kind::kArray, '['); }

  bool key(string_t& key) override {
    if (!checks.key(key)) return false;
    Frame& f = frames_.back();
    if (f.count > 0) out_ += ',';
    ++f.count;
    write_string(key);
    out_ += ':';
    switch (f.role) {
      case Role::kRoot: f.key = known_key(kRootKeys, key); break;
      case Role::kTopology: f.key = known_key(kTopologyKeys, key); break;
      case Role::kEngine: f.key = known_key(kEngineKeys, key); break;
      case Role::kFile: f.key = known_key(kFileKeys, key); break;
      case Role::kTensor: f.key = known_key(kTensorKeys, key); break;
      case Role::kChunk: f.key = known_key(kChunkKeys, key); break;
      case Role::kMetadata:
        metadata_key_ = key;
        ++raw.metadata_entries;
        break;
      default: break;
    }
    return true;
  }

  bool end_object() override {
    Frame& f = frames_.back();
    if (frames_.size() == 1) {
      hash_root();
    } else {
      if (!checks.in_order()) sort_members(f);
      out_ += '}';
    }
    const Role role = f.role;
    if (role == Role::kMetadata) {
      raw.metadata_begin = f.start - 1;
      raw.metadata_end = out_.size();
    }
    checks.close();
    frames_.pop_back();
    switch (role) {
      case Role::kFile: end_file(); break;
      case Role::kTensor: end_tensor(); break;
      case Role::kChunk: end_chunk(); break;
      default: break;
    }
    if (frames_.empty()) release();
    return true;
  }
  bool end_array() override {
    out_ += ']';
    checks.close();
    frames_.pop_back();
    if (frames_.empty()) release();
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    checks.problem = CheckedJson::Problem::kInvalid;
    return false;
  }

 private:
  struct Frame {
    Role role = Role::kSkip;
    bool object = false;
    size_t count = 0;      // members or elements so far
    std::string_view key;  // an object's: the known key of the member being read ("": none)
    size_t start = 0;      // where its members start in out_
  };

  // An open object's members in out_ (each "key":value) with their keys, in order of keys.
  std::vector<std::pair<std::string, std::string_view>> members_of(const Frame& f) const {
    std::vector<std::pair<std::string, std::string_view>> members;
    const std::string_view text = std::string_view(out_).substr(f.start);
    auto add = [&](std::string_view member) {
      // Its key is the JSON string it starts with, written by write_string from UTF-8 (what
      // nlohmann's lexer takes), so parsing that string gives the key back.
      size_t end = 1;
      while (member[end] != '"') end += member[end] == '\\' ? 2 : 1;
      members.emplace_back(json::parse(member.substr(0, end + 1)).get<std::string>(), member);
    };
    size_t depth = 0;
    size_t start = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
      const char c = text[i];
      if (in_string) {
        if (c == '\\') {
          ++i;
        } else if (c == '"') {
          in_string = false;
        }
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        --depth;
      } else if (c == ',' && depth == 0) {
        add(text.substr(start, i - start));
        start = i + 1;
      }
    }
    if (start < text.size()) add(text.substr(start));
    if (!checks.in_order()) {
      std::sort(members.begin(), members.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    return members;
  }
  void sort_members(const Frame& f) {
    std::string sorted;
    sorted.reserve(out_.size() - f.start);
    for (const auto& [key, text] : members_of(f)) {
      if (!sorted.empty()) sorted += ',';
      sorted += text;
    }
    out_.resize(f.start);
    out_ += sorted;
  }
  // The checksum: of the root's members in order, without the checksum's own.
  void hash_root() {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, "{", 1);
    bool first = true;
    for (const auto& [key, text] : members_of(frames_.back())) {
      if (key == kManifestChecksumKey) continue;
      if (!first) XXH3_64bits_update(&state, ",", 1);
      first = false;
      XXH3_64bits_update(&state, text.data(), text.size());
    }
    XXH3_64bits_update(&state, "}", 1);
    raw.checksum = XXH3_64bits_digest(&state);
  }
  void release() {
    if (raw.metadata_end > 0) {
      raw.canonical = std::move(out_);
    } else {
      std::string().swap(out_);
    }
  }

  void comma() {
    if (frames_.empty() || frames_.back().object) return;
    if (frames_.back().count++ > 0) out_ += ',';
  }
  // Writes `value` as its dump(-1, ' ', false, replace) would, into out_ (no copy of it).
  void write(const json& value) {
    nlohmann::detail::serializer<json> serializer(
        nlohmann::detail::output_adapter<char, std::string>(out_), ' ',
        json::error_handler_t::replace);
    serializer.dump(value, false, false, 0);
  }
  void write_string(std::string& s) {
    json value(std::move(s));
    write(value);
    s = std::move(value.get_ref<std::string&>());
  }
  bool scalar(const json& value, Field f) {
    comma();
    write(value);
    if (!frames_.empty() && frames_.back().role == Role::kMetadata) {
      metadata_not_string();
      return true;
    }
    place(std::move(f));
    return true;
  }
  bool open(Kind kind, char bracket) {
    if (!checks.open(kind == Kind::kObject)) return false;
    comma();
    out_ += bracket;
    Role role = Role::kSkip;
    if (!frames_.empty() && frames_.back().role == Role::kMetadata) {
      metadata_not_string();
    } else {
      Field f;
      f.kind = kind;
      role = place(std::move(f));
    }
    Frame frame;
    frame.role = role;
    frame.object = kind == Kind::kObject;
    frame.start = out_.size();
    frames_.push_back(std::move(frame));
    return true;
  }
  // A metadata value that is no string: the least key of such is named.
  void metadata_not_string() {
    if (!raw.metadata_not_string || metadata_key_ < *raw.metadata_not_string)
      raw.metadata_not_string = metadata_key_;
  }

  // Where a value goes: into the field it is, and (a container) the role of its contents.
  Role place(Field f) {
    const Kind kind = f.kind;
    if (frames_.empty()) {
      raw.kind = kind;
      return kind == Kind::kObject ? Role::kRoot : Role::kSkip;
    }
    Frame& top = frames_.back();
    auto keep = [&](RawObject& o) {
      if (!top.key.empty()) o.fields.emplace_back(top.key, std::move(f));
    };
    switch (top.role) {
      case Role::kSkip:
      case Role::kMetadata: return Role::kSkip;
      case Role::kRoot: {
        const std::string_view key = top.key;
        keep(raw.root);
        if (key == "topology") {
          raw.topology.kind = kind;
          return kind == Kind::kObject ? Role::kTopology : Role::kSkip;
        }
        if (key == "engine") {
          raw.engine.kind = kind;
          return kind == Kind::kObject ? Role::kEngine : Role::kSkip;
        }
        if (key == "metadata" && kind == Kind::kObject) return Role::kMetadata;
        if (key == "files" && kind == Kind::kArray) return Role::kFiles;
        if (key == "tensors" && kind == Kind::kArray) return Role::kTensors;
        return Role::kSkip;
      }
      case Role::kTopology: keep(raw.topology); return Role::kSkip;
      case Role::kEngine: keep(raw.engine); return Role::kSkip;
      case Role::kFiles:
        if (raw.bad_file) return Role::kSkip;
        file_ = RawObject{kind, {}};
        if (kind == Kind::kObject) return Role::kFile;
        end_file();
        return Role::kSkip;
      case Role::kFile: keep(file_); return Role::kSkip;
      case Role::kTensors:
        if (raw.bad_tensor) return Role::kSkip;
        tensor_ = RawTensor{};
        tensor_.object.kind = kind;
        if (kind == Kind::kObject) return Role::kTensor;
        end_tensor();
        return Role::kSkip;
      case Role::kTensor: {
        const std::string_view key = top.key;
        keep(tensor_.object);
        if (key == "shape" && kind == Kind::kArray) return Role::kShape;
        if (key == "chunks" && kind == Kind::kArray) return Role::kChunks;
        return Role::kSkip;
      }
      case Role::kShape:
        if (++tensor_.dimensions <= kMaxDimensions) tensor_.shape.push_back(std::move(f));
        return Role::kSkip;
      case Role::kChunks:
        if (tensor_.bad_chunk) return Role::kSkip;
        chunk_ = RawObject{kind, {}};
        if (kind == Kind::kObject) return Role::kChunk;
        end_chunk();
        return Role::kSkip;
      case Role::kChunk: keep(chunk_); return Role::kSkip;
    }
    return Role::kSkip;
  }

  void end_file() {
    Reader f(file_, std::string());
    if (ranks_.empty()) ranks_.resize(kMaxWorld);
    auto file = check_file(f, 0, ranks_);
    if (file.ok()) {
      raw.files.emplace_back(file->rank, file->bytes);
    } else {
      raw.bad_file = std::move(file_);
    }
  }
  void end_chunk() {
    Reader c(chunk_, std::string());
    StoredChunk chunk;
    const uint64_t covered = tensor_.chunks.empty() ? 0 : tensor_.chunks.back().end;
    if (check_chunk(c, nullptr, covered, UINT64_MAX, 1, &chunk).ok()) {
      tensor_.chunks.push_back(chunk);
    } else {
      tensor_.bad_chunk = std::move(chunk_);
    }
  }
  void end_tensor() {
    StoredTensor t;
    if (check_tensor(tensor_, raw.tensors.size(), nullptr, origin_, &t).ok()) {
      raw.tensors.push_back(std::move(t));
    } else {
      raw.bad_tensor = std::move(tensor_);
    }
  }

  std::string origin_;
  std::vector<Frame> frames_;
  std::string out_;  // the canonical text so far
  std::string metadata_key_;
  std::vector<bool> ranks_;  // of the files so far
  RawObject file_;
  RawObject chunk_;
  RawTensor tensor_;
};

// A parameter's fp32 master has the parameter's shape, beside it: a reader that loads one
// of the pair leaves the other unread, so a master of another shape would go unnoticed.
Status check_masters(const Manifest& m, const Reader& r) {
  std::map<std::string_view, const StoredTensor*> params;
  for (const StoredTensor& t : m.tensors) {
    if (starts_with(t.name, kParamPrefix)) params.emplace(t.name, &t);
  }
  for (const StoredTensor& t : m.tensors) {
    if (!starts_with(t.name, kMasterPrefix)) continue;
    const std::string param = std::string(kParamPrefix) + t.name.substr(kMasterPrefix.size());
    auto it = params.find(param);
    if (it == params.end()) return r.bad("tensor '" + t.name + "' has no '" + param + "'");
    if (t.dtype != DType::kFloat32) {
      return r.bad("tensor '" + t.name + "' is " + std::string(dtype_name(t.dtype)) +
                   ", not float32");
    }
    if (t.shape != it->second->shape) {
      return r.bad("tensor '" + t.name + "' has shape " + shape_text(t.shape) + " but '" + param +
                   "' " + shape_text(it->second->shape));
    }
  }
  return Status::Ok();
}

// Each chunk has bytes of its own in its file: two that share bytes (one checksum good
// for both) would load one element range's values into another.
Status check_file_bytes_apart(const Manifest& m, const Reader& r) {
  struct Span {
    uint32_t file;
    uint64_t offset, stop;
    const StoredTensor* tensor;
    size_t chunk;
  };
  std::vector<Span> spans;
  for (const StoredTensor& t : m.tensors) {
    const uint64_t element = dtype_size(t.dtype);
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const StoredChunk& c = t.chunks[k];
      // Checked when read: the chunk's bytes end inside its file.
      spans.push_back({c.file, c.offset, c.offset + (c.end - c.begin) * element, &t, k});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span& a = spans[i - 1];
    const Span& b = spans[i];
    if (a.file == b.file && b.offset < a.stop) {
      return r.bad("tensor '" + b.tensor->name + "' chunk " + std::to_string(b.chunk) +
                   " and tensor '" + a.tensor->name + "' chunk " + std::to_string(a.chunk) +
                   " share bytes of file '" + m.files[a.file].name + "'");
    }
  }
  return Status::Ok();
}

StatusOr<StoredFile> check_file(const Reader& f, int32_t world, std::vector<bool>& ranks) {
  StoredFile file;
  HPS_ASSIGN_OR_RETURN(file.rank, f.int32("rank", 0, (world > 0 ? world : kMaxWorld) - 1));
  HPS_ASSIGN_OR_RETURN(file.name, f.string("name"));
  // Only the canonical name: a manifest cannot point a reader outside its directory.
  if (file.name != data_file_name(file.rank)) {
    return f.bad("file name '" + shown_value(file.name) + "' is not " + data_file_name(file.rank));
  }
  if (ranks[static_cast<size_t>(file.rank)])
    return f.bad("rank " + std::to_string(file.rank) + " has two files");
  ranks[static_cast<size_t>(file.rank)] = true;
  HPS_ASSIGN_OR_RETURN(file.bytes, f.uint("bytes"));
  return file;
}

// The checks of a chunk whose fields are read (`c`'s where names it): where it lies, in the
// tensor and in its file.
Status check_chunk_place(const StoredChunk& chunk, const std::string& where, const Manifest& m,
                         uint64_t covered, uint64_t numel, uint64_t element) {
  auto bad = [&](const std::string& what) { return invalid_argument(where + ": " + what); };
  if (chunk.begin != covered || chunk.end <= chunk.begin || chunk.end > numel) {
    return bad("covers elements [" + std::to_string(chunk.begin) + ", " +
               std::to_string(chunk.end) + ") where [" + std::to_string(covered) + ", ...) of " +
               std::to_string(numel) + " was due");
  }
  const StoredFile& f = m.files[chunk.file];
  auto bytes = checked_mul(chunk.end - chunk.begin, element);
  auto stop = bytes ? checked_add(chunk.offset, *bytes) : std::nullopt;
  if (chunk.offset < kDataHeaderBytes || !stop || *stop > f.bytes) {
    return bad("lies outside file '" + f.name + "' (" + std::to_string(f.bytes) + " bytes)");
  }
  // A writer cuts at most chunk_bytes (one element at least) into a chunk, and a reader
  // holds a whole chunk to check its sum: a larger one is refused before any is read.
  if (chunk.end - chunk.begin > std::max<uint64_t>(1, m.chunk_bytes / element)) {
    return bad("holds " + std::to_string(chunk.end - chunk.begin) +
               " elements, more than chunk_bytes (" + std::to_string(m.chunk_bytes) + ") allows");
  }
  return Status::Ok();
}

Status check_file_index(uint64_t file, const std::string& where, const Manifest& m) {
  if (file >= m.files.size()) {
    return invalid_argument(where + ": names file " + std::to_string(file) + " of " +
                            std::to_string(m.files.size()));
  }
  return Status::Ok();
}

Status check_chunk(const Reader& c, const Manifest* m, uint64_t covered, uint64_t numel,
                   uint64_t element, StoredChunk* out) {
  StoredChunk& chunk = *out;
  HPS_ASSIGN_OR_RETURN(uint64_t file, c.uint("file"));
  if (m != nullptr) HPS_RETURN_IF_ERROR(check_file_index(file, c.where(), *m));
  if (file > UINT32_MAX) return c.bad("names file " + std::to_string(file));
  chunk.file = static_cast<uint32_t>(file);
  HPS_ASSIGN_OR_RETURN(chunk.begin, c.uint("begin"));
  HPS_ASSIGN_OR_RETURN(chunk.end, c.uint("end"));
  HPS_ASSIGN_OR_RETURN(chunk.offset, c.uint("offset"));
  HPS_ASSIGN_OR_RETURN(std::string sum, c.string("xxh3", 16));
  chunk.xxh3 = parse_hex64(sum);
  if (!chunk.xxh3) return c.bad("'xxh3' is not 16 lowercase hex digits");
  if (m != nullptr) return check_chunk_place(chunk, c.where(), *m, covered, numel, element);
  if (chunk.begin != covered || chunk.end <= chunk.begin) return c.bad("out of place");
  return Status::Ok();
}

Status check_tensor(RawTensor& raw, size_t index, const Manifest* m, const std::string& origin,
                    StoredTensor* out) {
  StoredTensor& t = *out;
  Reader r(raw.object, origin + ": tensors[" + std::to_string(index) + "]");
  HPS_ASSIGN_OR_RETURN(t.name, r.string("name", kMaxStateNameBytes));
  if (!printable_name(t.name)) return r.bad("the tensor name is empty or has control characters");
  for (std::string_view prefix : {kParamPrefix, kMasterPrefix}) {
    if (t.name == prefix) return r.bad("tensor '" + t.name + "' names no parameter");
  }
  Reader named(raw.object, origin + ": tensor '" + t.name + "'");
  HPS_ASSIGN_OR_RETURN(std::string dtype, named.string("dtype"));
  auto d = dtype_from_name(dtype);
  if (!d.ok() || dtype_name(*d) != dtype) return named.bad("unknown dtype '" + dtype + "'");
  t.dtype = *d;
  HPS_RETURN_IF_ERROR(named.array("shape"));
  if (raw.dimensions > kMaxDimensions) return named.bad("has more than 16 dimensions");
  uint64_t numel = 1;
  for (const Field& dim : raw.shape) {
    if (dim.kind != Kind::kUnsigned) return named.bad("a dimension is not an unsigned integer");
    const uint64_t n = dim.unsigned_value;
    auto product = checked_mul(numel, n);
    if (n > kMaxElements || !product || *product > kMaxElements) {
      return named.bad("has more than 2^48 elements");
    }
    numel = *product;
    t.shape.push_back(static_cast<int64_t>(n));
  }
  t.numel = numel;
  const uint64_t element = dtype_size(t.dtype);
  HPS_RETURN_IF_ERROR(named.array("chunks"));
  uint64_t covered = 0;
  size_t k = 0;
  for (const StoredChunk& chunk : raw.chunks) {
    if (m != nullptr) {
      const std::string where = named.where() + ", chunk " + std::to_string(k);
      HPS_RETURN_IF_ERROR(check_file_index(chunk.file, where, *m));
      HPS_RETURN_IF_ERROR(check_chunk_place(chunk, where, *m, covered, numel, element));
    } else if (chunk.end > numel) {
      return named.bad("a chunk lies outside the tensor");
    }
    ++k;
    covered = chunk.end;
  }
  if (raw.bad_chunk) {
    StoredChunk chunk;
    Reader c(*raw.bad_chunk, named.where() + ", chunk " + std::to_string(k));
    HPS_RETURN_IF_ERROR(check_chunk(c, m, covered, numel, element, &chunk));
    // Sound alone but not in place (checked with `m` above, where it is refused).
    return c.bad("covers elements [" + std::to_string(chunk.begin) + ", " +
                 std::to_string(chunk.end) + ") where [" + std::to_string(covered) + ", ...) of " +
                 std::to_string(numel) + " was due");
  }
  if (covered != numel) {
    return named.bad("its chunks cover " + std::to_string(covered) + " of its " +
                     std::to_string(numel) + " elements");
  }
  t.chunks = std::move(raw.chunks);
  return Status::Ok();
}

// The checks of a tensor whose own fields passed them: those of its chunks' files.
Status check_stored_tensor(const StoredTensor& t, const Manifest& m, const std::string& origin) {
  const uint64_t element = dtype_size(t.dtype);
  uint64_t covered = 0;
  for (size_t k = 0; k < t.chunks.size(); ++k) {
    const StoredChunk& chunk = t.chunks[k];
    const std::string where = origin + ": tensor '" + t.name + "', chunk " + std::to_string(k);
    HPS_RETURN_IF_ERROR(check_file_index(chunk.file, where, m));
    HPS_RETURN_IF_ERROR(check_chunk_place(chunk, where, m, covered, t.numel, element));
    covered = chunk.end;
  }
  return Status::Ok();
}

}  // namespace

std::string manifest_to_json(const Manifest& m) {
  json j;
  j["format"] = kFormatName;
  j["format_version"] =
      m.topology.mp > 1 || m.topology.pp > 1 ? kPartFormatVersion : kFormatVersion;
  j["id"] = m.id;
  j["name"] = m.name;
  j["created_unix_ns"] = m.created_unix_ns;
  if (m.sequence > 0) j["sequence"] = m.sequence;
  j["chunk_bytes"] = m.chunk_bytes;
  j["topology"] = {{"stage", m.topology.stage},
                   {"sharding", m.topology.sharding},
                   {"dp", m.topology.dp},
                   {"world", m.world},
                   {"alignment_bytes", m.topology.alignment_bytes},
                   {"mp", m.topology.mp},
                   {"mp_rank", m.topology.mp_rank},
                   {"pp", m.topology.pp},
                   {"pp_rank", m.topology.pp_rank}};
  if (m.engine) j["engine"] = options_to_json(*m.engine);
  j["metadata"] = json::object();
  for (const auto& [k, v] : m.metadata) j["metadata"][k] = v;
  j["files"] = json::array();
  for (const auto& f : m.files) {
    j["files"].push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}});
  }
  j["tensors"] = json::array();
  for (const auto& t : m.tensors) {
    json chunks = json::array();
    for (const auto& c : t.chunks) {
      chunks.push_back({{"file", c.file},
                        {"begin", c.begin},
                        {"end", c.end},
                        {"offset", c.offset},
                        {"xxh3", hex64(c.xxh3.value_or(0))}});
    }
    j["tensors"].push_back({{"name", t.name},
                            {"dtype", std::string(dtype_name(t.dtype))},
                            {"shape", t.shape},
                            {"chunks", std::move(chunks)}});
  }
  j[std::string(kManifestChecksumKey)] = hex64(manifest_checksum(j));
  // Invalid UTF-8 in a name or metadata value is replaced, not thrown on.
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

StatusOr<Manifest> parse_manifest(std::string_view text, const std::string& origin) {
  try {
    // nlohmann's lexer ends the input at a NUL byte, so the bytes after one would go unread;
    // a NUL is no JSON (inside a string it must be escaped): refused.
    ManifestSax sax(text.size(), origin);
    const bool parsed = text.find('\0') == std::string_view::npos && json::sax_parse(text, &sax);
    switch (sax.checks.finish(parsed)) {
      case CheckedJson::Problem::kNone: break;
      case CheckedJson::Problem::kInvalid:
        return invalid_argument(origin + ": not valid JSON (truncated or corrupt manifest?)");
      case CheckedJson::Problem::kTooDeep:
        return invalid_argument(origin + ": JSON nested deeper than " +
                                std::to_string(kMaxJsonDepth));
      case CheckedJson::Problem::kRepeatedKey:
        return invalid_argument(origin + ": key '" + shown_value(sax.checks.repeated) +
                                "' repeated");
    }
    RawManifest& raw = sax.raw;
    raw.root.kind = raw.kind;
    Reader r(raw.root, origin);
    Manifest m;
    // Its own checksum first: an edited or corrupted manifest is said to be one, before any
    // field it may have changed is read.
    HPS_ASSIGN_OR_RETURN(const Field* recorded, r.field(kManifestChecksumKey, false));
    if (recorded != nullptr) {
      const auto sum = recorded->kind == Kind::kString ? parse_hex64(recorded->text) : std::nullopt;
      if (!sum)
        return r.bad("'" + std::string(kManifestChecksumKey) + "' is not 16 lowercase hex digits");
      if (*sum != raw.checksum) {
        return r.bad("the manifest's checksum ('" + std::string(kManifestChecksumKey) +
                     "') does not match its contents: it was edited or is corrupt");
      }
      m.checksummed = true;
    }
    HPS_ASSIGN_OR_RETURN(std::string format, r.string("format"));
    if (format != kFormatName)
      return r.bad("'format' is '" + shown_value(format) + "', not '" + std::string(kFormatName) +
                   "'");
    HPS_ASSIGN_OR_RETURN(uint64_t version, r.uint("format_version"));
    if (version != kFormatVersion && version != kPartFormatVersion) {
      return r.bad("format version " + std::to_string(version) + "; this hpshard reads versions " +
                   std::to_string(kFormatVersion) + " and " + std::to_string(kPartFormatVersion));
    }
    m.format_version = static_cast<uint32_t>(version);
    HPS_ASSIGN_OR_RETURN(m.id, r.string("id"));
    if (!is_checkpoint_id(m.id)) return r.bad("'id' is not 32 lowercase hex digits");
    HPS_ASSIGN_OR_RETURN(m.name, r.string("name"));
    if (Status named = check_checkpoint_name(m.name); !named.ok())
      return r.bad("'name': " + named.message());
    HPS_ASSIGN_OR_RETURN(m.created_unix_ns, r.integer("created_unix_ns"));
    HPS_ASSIGN_OR_RETURN(const Field* sequence, r.field("sequence", false));
    if (sequence != nullptr) {
      HPS_ASSIGN_OR_RETURN(m.sequence, r.uint("sequence", kMaxSequence));
    }
    HPS_ASSIGN_OR_RETURN(m.chunk_bytes, r.uint("chunk_bytes"));
    if (m.chunk_bytes < 1 || m.chunk_bytes > kMaxChunkBytes)
      return r.bad("'chunk_bytes' is " + std::to_string(m.chunk_bytes) + ", not in [1, 2^34]");
    HPS_RETURN_IF_ERROR(r.field("topology").status());
    Reader t(raw.topology, origin + ": topology");

    HPS_ASSIGN_OR_RETURN(m.topology.stage, t.int32("stage", 2, 3));
    HPS_ASSIGN_OR_RETURN(m.topology.sharding, t.int32("sharding", 1, 1 << 24));
    HPS_ASSIGN_OR_RETURN(m.topology.dp, t.int32("dp", 1, 1 << 24));
    HPS_ASSIGN_OR_RETURN(m.world, t.int32("world", 1, 1 << 24));
    // The writing group is the sharding x dp ranks of the state.
    if (int64_t{m.topology.sharding} * m.topology.dp != m.world) {
      return t.bad("sharding " + std::to_string(m.topology.sharding) + " x dp " +
                   std::to_string(m.topology.dp) + " is not the world of " +
                   std::to_string(m.world) + " ranks that wrote it");
    }
    HPS_ASSIGN_OR_RETURN(m.topology.alignment_bytes, t.uint("alignment_bytes"));
    // The writing engine's alignment: what an engine takes (its options say the same).
    if (const uint64_t a = m.topology.alignment_bytes;
        a == 0 || (a & (a - 1)) != 0 || a > kMaxAlignmentBytes) {
      return t.bad("'alignment_bytes' is " + std::to_string(a) + ", not a power of two from 1 to " +
                   std::to_string(kMaxAlignmentBytes));
    }
    // The model-parallel part (absent: the whole model, as before these fields).
    for (auto [degree, rank, degree_key, rank_key] :
         {std::tuple{&m.topology.mp, &m.topology.mp_rank, "mp", "mp_rank"},
          std::tuple{&m.topology.pp, &m.topology.pp_rank, "pp", "pp_rank"}}) {
      HPS_ASSIGN_OR_RETURN(const Field* given, t.field(degree_key, false));
      if (given == nullptr) {
        HPS_ASSIGN_OR_RETURN(const Field* rank_alone, t.field(rank_key, false));
        if (rank_alone != nullptr) {
          return t.bad("'" + std::string(rank_key) + "' without '" + degree_key + "'");
        }
        continue;
      }
      HPS_ASSIGN_OR_RETURN(*degree, t.int32(degree_key, 1, 1 << 24));
      HPS_ASSIGN_OR_RETURN(*rank, t.int32(rank_key, 0, *degree - 1));
    }
    if ((m.topology.mp > 1 || m.topology.pp > 1) != (version == kPartFormatVersion)) {
      return r.bad("format version " + std::to_string(version) + " with mp " +
                   std::to_string(m.topology.mp) + " and pp " + std::to_string(m.topology.pp) +
                   ": a part of a model (mp or pp above 1) is version " +
                   std::to_string(kPartFormatVersion) + ", a whole model version " +
                   std::to_string(kFormatVersion));
    }
    HPS_ASSIGN_OR_RETURN(const Field* engine, r.field("engine", false));
    if (engine != nullptr) {
      HPS_ASSIGN_OR_RETURN(m.engine, options_from_json(Reader(raw.engine, origin + ": engine")));
    }
    HPS_ASSIGN_OR_RETURN(const Field* metadata, r.field("metadata"));
    if (metadata->kind != Kind::kObject) return r.bad("'metadata' is not an object");
    if (raw.metadata_not_string)
      return r.bad("metadata '" + shown_value(*raw.metadata_not_string) + "' is not a string");
    if (raw.metadata_entries > kMaxMetadataEntries) {
      return r.bad("'metadata' has " + std::to_string(raw.metadata_entries) +
                   " entries, more than the " + std::to_string(kMaxMetadataEntries) + " allowed");
    }
    MetadataSax entries(&m.metadata);
    json::sax_parse(std::string_view(raw.canonical)
                        .substr(raw.metadata_begin, raw.metadata_end - raw.metadata_begin),
                    &entries);
    std::string().swap(raw.canonical);
    HPS_RETURN_IF_ERROR(r.array("files"));
    std::vector<bool> ranks(kMaxWorld);
    m.files.reserve(raw.files.size());
    for (const auto& [rank, bytes] : raw.files) {
      if (rank >= m.world) {
        return invalid_argument(origin + ": files[" + std::to_string(m.files.size()) +
                                "]: 'rank' is " + std::to_string(rank) + ", outside [0, " +
                                std::to_string(m.world - 1) + "]");
      }
      ranks[static_cast<size_t>(rank)] = true;
      m.files.push_back({data_file_name(rank), rank, bytes});
    }
    if (raw.bad_file) {
      Reader f(*raw.bad_file, origin + ": files[" + std::to_string(m.files.size()) + "]");
      HPS_RETURN_IF_ERROR(check_file(f, m.world, ranks).status());
    }
    HPS_RETURN_IF_ERROR(r.array("tensors"));
    std::unordered_set<std::string_view> names;
    uint64_t total = 0;  // every tensor's bytes: what inspect adds up
    for (const StoredTensor& tensor : raw.tensors) {
      HPS_RETURN_IF_ERROR(check_stored_tensor(tensor, m, origin));
      if (!names.insert(tensor.name).second)
        return r.bad("tensor '" + tensor.name + "' is listed twice");
      auto sum = checked_add(total, tensor.numel * dtype_size(tensor.dtype));  // 2^48 x 8 fits
      if (!sum) return r.bad("its tensors hold more than 2^64 bytes");
      total = *sum;
    }
    if (raw.bad_tensor) {
      StoredTensor tensor;
      HPS_RETURN_IF_ERROR(check_tensor(*raw.bad_tensor, raw.tensors.size(), &m, origin, &tensor));
    }
    m.tensors = std::move(raw.tensors);
    HPS_RETURN_IF_ERROR(check_masters(m, r));
    HPS_RETURN_IF_ERROR(check_file_bytes_apart(m, r));
    return m;
  } catch (const std::bad_alloc&) {
    return out_of_memory(origin + ": the manifest (" + std::to_string(text.size()) +
                         " bytes) takes more memory to read than there is");
  } catch (const std::exception& e) {
    return invalid_argument(origin + ": " + e.what());
  }
}

StatusOr<Manifest> read_manifest(const std::string& directory) {
  const std::string path = join_path(directory, std::string(kManifestFile));
  auto text = read_file(path, kMaxManifestBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return not_found("no checkpoint at '" + directory + "': " + path +
                       " does not exist (an unpublished or incomplete checkpoint has none)");
    }
    return text.status();
  }
  return parse_manifest(*text, path);
}

SourceIndex source_of(const Manifest& manifest, const std::string& directory) {
  SourceIndex s;
  s.description = "checkpoint " + directory;
  s.directory = directory;
  s.id = manifest.id;
  s.files = manifest.files;
  s.tensors = manifest.tensors;
  return s;
}

}  // namespace hps::ckpt
