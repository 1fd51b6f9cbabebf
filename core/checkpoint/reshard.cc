#include "core/checkpoint/reshard.h"

#include <algorithm>
#include <map>
#include <set>

namespace hps::ckpt {
namespace {

// Up to 8 entries, then how many more; names are quoted.
std::string name_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 8; ++i) {
    if (i > 0) out += ", ";
    out += names[i].front() == '\'' ? names[i] : "'" + names[i] + "'";
  }
  if (names.size() > 8) out += " and " + std::to_string(names.size() - 8) + " more";
  return out;
}

}  // namespace

std::vector<TargetRange> target_ranges(const std::vector<StateTensor>& tensors) {
  std::vector<TargetRange> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back({t.name, t.dtype, t.shape, t.begin, t.end});
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

StatusOr<LoadPlan> plan_load(const SourceIndex& source, const std::vector<TargetRange>& targets,
                             SourceNaming naming, bool allow_partial) {
  std::map<std::string, size_t> stored;
  for (size_t i = 0; i < source.tensors.size(); ++i) stored.emplace(source.tensors[i].name, i);
  auto lookup = [&](const std::string& name) -> int64_t {
    auto it = stored.find(name);
    return it == stored.end() ? -1 : static_cast<int64_t>(it->second);
  };
  LoadPlan plan;
  plan.source_of_target.assign(targets.size(), -1);
  std::set<size_t> used;
  std::set<std::string> loaded_params;  // parameters whose param or master was loaded
  std::vector<std::string> missing, mismatched;
  for (size_t t = 0; t < targets.size(); ++t) {
    const TargetRange& target = targets[t];
    int64_t from = -1;
    std::string param;  // the parameter's name for param/ and master/ targets
    if (starts_with(target.name, kParamPrefix)) param = target.name.substr(kParamPrefix.size());
    if (starts_with(target.name, kMasterPrefix)) param = target.name.substr(kMasterPrefix.size());
    if (naming == SourceNaming::kBareParameters) {
      if (param.empty()) {
        return invalid_argument("checkpoint: " + source.description + " holds parameters only; '" +
                                target.name + "' was asked for");
      }
      from = lookup(param);
    } else if (starts_with(target.name, kParamPrefix)) {
      const int64_t same = lookup(target.name);
      const int64_t master = lookup(std::string(kMasterPrefix) + param);
      if (same >= 0 && source.tensors[static_cast<size_t>(same)].dtype == target.dtype) {
        from = same;
      } else if (master >= 0) {
        from = master;
      } else {
        from = same;
      }
    } else if (starts_with(target.name, kMasterPrefix)) {
      from = lookup(target.name);
      if (from < 0) from = lookup(std::string(kParamPrefix) + param);
    } else {
      from = lookup(target.name);
    }
    if (from < 0) {
      missing.push_back(target.name);
      continue;
    }
    const StoredTensor& s = source.tensors[static_cast<size_t>(from)];
    // Matched by name: a tensor of another shape or type is reported as that, not also
    // as one the engine lacks.
    used.insert(static_cast<size_t>(from));
    if (!param.empty()) loaded_params.insert(param);
    if (s.shape != target.shape) {
      mismatched.push_back("'" + target.name + "' has shape " + shape_text(target.shape) +
                           " here but " + shape_text(s.shape) + " as '" + s.name + "' there");
      continue;
    }
    if (s.dtype != target.dtype &&
        !(dtype_is_floating(s.dtype) && dtype_is_floating(target.dtype))) {
      mismatched.push_back("'" + target.name + "' is " + std::string(dtype_name(target.dtype)) +
                           " here but '" + s.name + "' is " + std::string(dtype_name(s.dtype)) +
                           " there");
      continue;
    }
    if (target.begin > target.end || target.end > s.numel) {
      return internal_error("checkpoint: the range of '" + target.name + "' lies outside it");
    }
    plan.source_of_target[t] = from;
    // The chunks overlapping [begin, end): the first whose end is past begin, onwards.
    auto first = std::upper_bound(s.chunks.begin(), s.chunks.end(), target.begin,
                                  [](uint64_t v, const StoredChunk& c) { return v < c.end; });
    for (auto it = first; it != s.chunks.end() && it->begin < target.end; ++it) {
      plan.pieces.push_back({t, static_cast<size_t>(from),
                             static_cast<size_t>(it - s.chunks.begin()),
                             std::max(it->begin, target.begin), std::min(it->end, target.end)});
    }
  }
  std::vector<std::string> extra;
  for (size_t i = 0; i < source.tensors.size(); ++i) {
    if (used.count(i) != 0) continue;
    const std::string& name = source.tensors[i].name;
    std::string param;
    if (naming == SourceNaming::kCheckpoint) {
      if (starts_with(name, kParamPrefix)) param = name.substr(kParamPrefix.size());
      if (starts_with(name, kMasterPrefix)) param = name.substr(kMasterPrefix.size());
      // The other half of a loaded parameter's param/master pair is not extra.
      if (!param.empty() && loaded_params.count(param) != 0) continue;
    }
    extra.push_back(name);
  }
  // Shapes and types must match even in a partial load; missing and extra tensors only
  // without one.
  if (!mismatched.empty() || (!allow_partial && (!missing.empty() || !extra.empty()))) {
    std::string message = "checkpoint: " + source.description +
                          " does not match this engine (a checkpoint of another model?):";
    std::string separator = " ";
    if (!mismatched.empty()) {
      message += separator + name_list(mismatched);
      separator = "; ";
    }
    if (!allow_partial && !missing.empty()) {
      message += separator + "missing from it: " + name_list(missing) + " (" +
                 std::to_string(missing.size()) + ")";
      separator = "; ";
    }
    if (!allow_partial && !extra.empty()) {
      message += separator + "not registered here: " + name_list(extra) + " (" +
                 std::to_string(extra.size()) + ")";
    }
    if (mismatched.empty()) message += "; a partial load allows it";
    return invalid_argument(message);
  }
  plan.unchanged = std::move(missing);
  plan.unused = std::move(extra);
  // One pass over each file, front to back.
  std::sort(plan.pieces.begin(), plan.pieces.end(), [&](const ReadPiece& a, const ReadPiece& b) {
    const StoredChunk& ca = source.tensors[a.tensor].chunks[a.chunk];
    const StoredChunk& cb = source.tensors[b.tensor].chunks[b.chunk];
    if (ca.file != cb.file) return ca.file < cb.file;
    if (ca.offset != cb.offset) return ca.offset < cb.offset;
    return a.begin < b.begin;
  });
  return plan;
}

}  // namespace hps::ckpt
