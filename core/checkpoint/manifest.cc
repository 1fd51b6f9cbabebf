#include "core/checkpoint/manifest.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "core/checkpoint/file_io.h"
#include "core/checkpoint/reshard.h"
#include "core/common/env.h"
#include "core/common/json_input.h"

namespace hps::ckpt {
namespace {

using json = nlohmann::json;

// Typed access to a JSON object's fields: hostile input never throws past here, and every
// message says where in the manifest the problem is.
class Reader {
 public:
  Reader(const json& object, std::string where) : object_(object), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

  StatusOr<const json*> field(const char* key, bool required = true) const {
    if (!object_.is_object()) return bad("is not a JSON object");
    auto it = object_.find(key);
    if (it == object_.end()) {
      if (!required) return static_cast<const json*>(nullptr);
      return bad(std::string("has no field '") + key + "'");
    }
    return &*it;
  }
  StatusOr<uint64_t> uint(const char* key, uint64_t max = UINT64_MAX) const {
    HPS_ASSIGN_OR_RETURN(const json* v, field(key));
    if (!v->is_number_unsigned())
      return bad(std::string("'") + key + "' is not an unsigned integer");
    const uint64_t x = v->get<uint64_t>();
    if (x > max)
      return bad(std::string("'") + key + "' is " + std::to_string(x) + ", above " +
                 std::to_string(max));
    return x;
  }
  StatusOr<int64_t> integer(const char* key) const {
    HPS_ASSIGN_OR_RETURN(const json* v, field(key));
    if (v->is_number_unsigned()) {
      const uint64_t x = v->get<uint64_t>();
      if (x > static_cast<uint64_t>(INT64_MAX))
        return bad(std::string("'") + key + "' is too large");
      return static_cast<int64_t>(x);
    }
    if (!v->is_number_integer()) return bad(std::string("'") + key + "' is not an integer");
    return v->get<int64_t>();
  }
  StatusOr<int32_t> int32(const char* key, int32_t min, int32_t max) const {
    HPS_ASSIGN_OR_RETURN(int64_t v, integer(key));
    if (v < min || v > max) {
      return bad(std::string("'") + key + "' is " + std::to_string(v) + ", outside [" +
                 std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return static_cast<int32_t>(v);
  }
  StatusOr<double> number(const char* key) const {
    HPS_ASSIGN_OR_RETURN(const json* v, field(key));
    if (!v->is_number()) return bad(std::string("'") + key + "' is not a number");
    return v->get<double>();
  }
  StatusOr<bool> boolean(const char* key) const {
    HPS_ASSIGN_OR_RETURN(const json* v, field(key));
    if (!v->is_boolean()) return bad(std::string("'") + key + "' is not true or false");
    return v->get<bool>();
  }
  StatusOr<std::string> string(const char* key, size_t max_bytes = kMaxNameBytes) const {
    HPS_ASSIGN_OR_RETURN(const json* v, field(key));
    if (!v->is_string()) return bad(std::string("'") + key + "' is not a string");
    const auto& s = v->get_ref<const std::string&>();
    if (s.size() > max_bytes)
      return bad(std::string("'") + key + "' is longer than " + std::to_string(max_bytes) +
                 " bytes");
    return s;
  }
  StatusOr<const json*> array(const char* key) const {
    HPS_ASSIGN_OR_RETURN(const json* v, field(key));
    if (!v->is_array()) return bad(std::string("'") + key + "' is not an array");
    return v;
  }
  Status bad(const std::string& what) const { return invalid_argument(where_ + ": " + what); }

 private:
  const json& object_;
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

StatusOr<StoredTensor> tensor_from_json(const json& j, size_t index, const Manifest& m,
                                        const std::string& origin) {
  Reader r(j, origin + ": tensors[" + std::to_string(index) + "]");
  StoredTensor t;
  HPS_ASSIGN_OR_RETURN(t.name, r.string("name", kMaxStateNameBytes));
  if (!printable_name(t.name)) return r.bad("the tensor name is empty or has control characters");
  for (std::string_view prefix : {kParamPrefix, kMasterPrefix}) {
    if (t.name == prefix) return r.bad("tensor '" + t.name + "' names no parameter");
  }
  Reader named(j, origin + ": tensor '" + t.name + "'");
  HPS_ASSIGN_OR_RETURN(std::string dtype, named.string("dtype"));
  auto d = dtype_from_name(dtype);
  if (!d.ok() || dtype_name(*d) != dtype) return named.bad("unknown dtype '" + dtype + "'");
  t.dtype = *d;
  HPS_ASSIGN_OR_RETURN(const json* shape, named.array("shape"));
  if (shape->size() > kMaxDimensions) return named.bad("has more than 16 dimensions");
  uint64_t numel = 1;
  for (const json& dim : *shape) {
    if (!dim.is_number_unsigned()) return named.bad("a dimension is not an unsigned integer");
    const uint64_t n = dim.get<uint64_t>();
    auto product = checked_mul(numel, n);
    if (n > kMaxElements || !product || *product > kMaxElements) {
      return named.bad("has more than 2^48 elements");
    }
    numel = *product;
    t.shape.push_back(static_cast<int64_t>(n));
  }
  t.numel = numel;
  const uint64_t element = dtype_size(t.dtype);
  HPS_ASSIGN_OR_RETURN(const json* chunks, named.array("chunks"));
  uint64_t covered = 0;
  size_t k = 0;
  for (const json& cj : *chunks) {
    Reader c(cj, named.where() + ", chunk " + std::to_string(k++));
    StoredChunk chunk;
    HPS_ASSIGN_OR_RETURN(uint64_t file, c.uint("file"));
    if (file >= m.files.size())
      return c.bad("names file " + std::to_string(file) + " of " + std::to_string(m.files.size()));
    chunk.file = static_cast<uint32_t>(file);
    HPS_ASSIGN_OR_RETURN(chunk.begin, c.uint("begin"));
    HPS_ASSIGN_OR_RETURN(chunk.end, c.uint("end"));
    HPS_ASSIGN_OR_RETURN(chunk.offset, c.uint("offset"));
    HPS_ASSIGN_OR_RETURN(std::string sum, c.string("xxh3", 16));
    chunk.xxh3 = parse_hex64(sum);
    if (!chunk.xxh3) return c.bad("'xxh3' is not 16 lowercase hex digits");
    if (chunk.begin != covered || chunk.end <= chunk.begin || chunk.end > numel) {
      return c.bad("covers elements [" + std::to_string(chunk.begin) + ", " +
                   std::to_string(chunk.end) + ") where [" + std::to_string(covered) +
                   ", ...) of " + std::to_string(numel) + " was due");
    }
    const StoredFile& f = m.files[chunk.file];
    auto bytes = checked_mul(chunk.end - chunk.begin, element);
    auto stop = bytes ? checked_add(chunk.offset, *bytes) : std::nullopt;
    if (chunk.offset < kDataHeaderBytes || !stop || *stop > f.bytes) {
      return c.bad("lies outside file '" + f.name + "' (" + std::to_string(f.bytes) + " bytes)");
    }
    // A writer cuts at most chunk_bytes (one element at least) into a chunk, and a reader
    // holds a whole chunk to check its sum: a larger one is refused before any is read.
    if (chunk.end - chunk.begin > std::max<uint64_t>(1, m.chunk_bytes / element)) {
      return c.bad("holds " + std::to_string(chunk.end - chunk.begin) +
                   " elements, more than chunk_bytes (" + std::to_string(m.chunk_bytes) +
                   ") allows");
    }
    covered = chunk.end;
    t.chunks.push_back(chunk);
  }
  if (covered != numel) {
    return named.bad("its chunks cover " + std::to_string(covered) + " of its " +
                     std::to_string(numel) + " elements");
  }
  return t;
}

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
    CheckedJson parsed = parse_checked_json(text, kMaxJsonDepth);
    switch (parsed.problem) {
      case CheckedJson::Problem::kNone: break;
      case CheckedJson::Problem::kInvalid:
        return invalid_argument(origin + ": not valid JSON (truncated or corrupt manifest?)");
      case CheckedJson::Problem::kTooDeep:
        return invalid_argument(origin + ": JSON nested deeper than " +
                                std::to_string(kMaxJsonDepth));
      case CheckedJson::Problem::kRepeatedKey:
        return invalid_argument(origin + ": key '" + shown_value(parsed.key) + "' repeated");
    }
    const json& j = parsed.value;
    Reader r(j, origin);
    Manifest m;
    // Its own checksum first: an edited or corrupted manifest is said to be one, before any
    // field it may have changed is read.
    HPS_ASSIGN_OR_RETURN(const json* recorded,
                         r.field(std::string(kManifestChecksumKey).c_str(), false));
    if (recorded != nullptr) {
      const auto sum = recorded->is_string() ? parse_hex64(recorded->get_ref<const std::string&>())
                                             : std::nullopt;
      if (!sum)
        return r.bad("'" + std::string(kManifestChecksumKey) + "' is not 16 lowercase hex digits");
      if (*sum != manifest_checksum(j)) {
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
    HPS_ASSIGN_OR_RETURN(const json* sequence, r.field("sequence", false));
    if (sequence != nullptr) {
      HPS_ASSIGN_OR_RETURN(m.sequence, r.uint("sequence", kMaxSequence));
    }
    HPS_ASSIGN_OR_RETURN(m.chunk_bytes, r.uint("chunk_bytes"));
    if (m.chunk_bytes < 1 || m.chunk_bytes > kMaxChunkBytes)
      return r.bad("'chunk_bytes' is " + std::to_string(m.chunk_bytes) + ", not in [1, 2^34]");
    HPS_ASSIGN_OR_RETURN(const json* topology, r.field("topology"));
    Reader t(*topology, origin + ": topology");
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
      HPS_ASSIGN_OR_RETURN(const json* given, t.field(degree_key, false));
      if (given == nullptr) {
        HPS_ASSIGN_OR_RETURN(const json* rank_alone, t.field(rank_key, false));
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
    HPS_ASSIGN_OR_RETURN(const json* engine, r.field("engine", false));
    if (engine != nullptr) {
      HPS_ASSIGN_OR_RETURN(m.engine, options_from_json(Reader(*engine, origin + ": engine")));
    }
    HPS_ASSIGN_OR_RETURN(const json* metadata, r.field("metadata"));
    if (!metadata->is_object()) return r.bad("'metadata' is not an object");
    for (const auto& [key, value] : metadata->items()) {
      if (!value.is_string()) return r.bad("metadata '" + shown_value(key) + "' is not a string");
      m.metadata[key] = value.get<std::string>();
    }
    HPS_ASSIGN_OR_RETURN(const json* files, r.array("files"));
    std::set<int32_t> ranks;
    for (size_t i = 0; i < files->size(); ++i) {
      Reader f((*files)[i], origin + ": files[" + std::to_string(i) + "]");
      StoredFile file;
      HPS_ASSIGN_OR_RETURN(file.rank, f.int32("rank", 0, m.world - 1));
      HPS_ASSIGN_OR_RETURN(file.name, f.string("name"));
      // Only the canonical name: a manifest cannot point a reader outside its directory.
      if (file.name != data_file_name(file.rank)) {
        return f.bad("file name '" + shown_value(file.name) + "' is not " +
                     data_file_name(file.rank));
      }
      if (!ranks.insert(file.rank).second)
        return f.bad("rank " + std::to_string(file.rank) + " has two files");
      HPS_ASSIGN_OR_RETURN(file.bytes, f.uint("bytes"));
      m.files.push_back(std::move(file));
    }
    HPS_ASSIGN_OR_RETURN(const json* tensors, r.array("tensors"));
    std::set<std::string> names;
    uint64_t total = 0;  // every tensor's bytes: what inspect adds up
    for (size_t i = 0; i < tensors->size(); ++i) {
      HPS_ASSIGN_OR_RETURN(StoredTensor tensor, tensor_from_json((*tensors)[i], i, m, origin));
      if (!names.insert(tensor.name).second)
        return r.bad("tensor '" + tensor.name + "' is listed twice");
      auto sum = checked_add(total, tensor.numel * dtype_size(tensor.dtype));  // 2^48 x 8 fits
      if (!sum) return r.bad("its tensors hold more than 2^64 bytes");
      total = *sum;
      m.tensors.push_back(std::move(tensor));
    }
    HPS_RETURN_IF_ERROR(check_masters(m, r));
    HPS_RETURN_IF_ERROR(check_file_bytes_apart(m, r));
    return m;
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
