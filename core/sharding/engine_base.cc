#include "core/sharding/engine_base.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "core/checkpoint/engine_state.h"
#include "core/comm/agreement.h"

namespace hps {

Status check_param_index(const LayoutPlan& plan, size_t index) {
  if (index < plan.params().size()) return Status::Ok();
  return out_of_range("engine: no parameter " + std::to_string(index));
}

Status check_trainable(const LayoutPlan& plan, size_t index, const char* what) {
  if (plan.buffers()[plan.placement(index).buffer].trainable) return Status::Ok();
  return failed_precondition("engine: parameter '" + plan.params()[index].name + "' " + what);
}

Status check_float32_view(const LayoutPlan& plan, size_t index) {
  const DType d = plan.buffers()[plan.placement(index).buffer].dtype;
  if (d == DType::kFloat32) return Status::Ok();
  return failed_precondition("engine: parameter '" + plan.params()[index].name + "' is " +
                             std::string(dtype_name(d)) + ": use its data view");
}

EngineBase::EngineBase(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
                       EngineOptions options)
    : sharding_(std::move(sharding)),
      dp_(std::move(dp)),
      options_(options),
      device_(sharding_->device()),
      shard_rank_(sharding_->rank()) {}

Status EngineBase::drop_groups() {
  if (dropped_) return Status::Ok();
  const Status finished = synchronize();
  drop_stage_work();
  if (optimizer_) optimizer_->drop_groups();  // its step state stays: views read it
  held_.clear();
  stepped_.reset();
  failure_link_.reset();
  sharding_.reset();
  dp_.reset();
  mp_.reset();
  pp_.reset();
  compute_ = nullptr;
  default_compute_.reset();
  optimizer_stream_.reset();
  sealed_ = false;  // synchronize() and the destructor find nothing in flight
  dropped_ = true;
  return finished;
}

Status EngineBase::check_not_dropped() const {
  if (!dropped_) return Status::Ok();
  return failed_precondition(
      "engine: its communicators and streams were let go (its handle "
      "was destroyed)");
}

Status EngineBase::init_device() {
  HPS_ASSIGN_OR_RETURN(kernels_, kernels_for(device_.type));
  HPS_ASSIGN_OR_RETURN(optimizer_stream_, create_stream(device_));
  // Named by rank: ranks as threads share a process's timeline.
  optimizer_stream_->set_name("optimizer, sharding rank " + std::to_string(shard_rank_));
  // A CPU framework computes on the calling thread, which orders the engine's work by
  // blocking in its calls; a CPU stream given as the compute stream is kept alive by the
  // caller and not used (its worker thread would take the waits off the calling thread).
  if (options_.compute_stream != nullptr && device_.type != DeviceType::kCpu) {
    compute_ = options_.compute_stream;
  } else {
    HPS_ASSIGN_OR_RETURN(default_compute_, default_compute_stream(device_));
    compute_ = default_compute_.get();
  }
  return Status::Ok();
}

StatusOr<size_t> EngineBase::add_param(ParamSpec spec) {
  HPS_RETURN_IF_ERROR(check_not_dropped());
  if (plan_.sealed()) {
    return failed_precondition("engine: parameter '" + spec.name + "' registered after seal()");
  }
  if (spec.dtype != DType::kFloat32 && spec.dtype != DType::kFloat16 &&
      spec.dtype != DType::kBFloat16) {
    return unimplemented("engine: parameter '" + spec.name + "' is " +
                         std::string(dtype_name(spec.dtype)) +
                         "; parameters must be float32, float16 or bfloat16");
  }
  HPS_RETURN_IF_ERROR(plan_.add(std::move(spec)));
  return plan_.params().size() - 1;
}

Status EngineBase::set_model_parallel_groups(std::shared_ptr<Communicator> mp,
                                             std::shared_ptr<Communicator> pp) {
  HPS_RETURN_IF_ERROR(check_not_dropped());
  if (sealed_) return failed_precondition("engine: model-parallel groups set after seal()");
  for (const auto& [group, name] : {std::pair{&mp, "mp"}, std::pair{&pp, "pp"}}) {
    if (!*group) continue;
    if (!((*group)->device() == device_)) {
      return invalid_argument(std::string("engine: the ") + name + " communicator is on " +
                              (*group)->device().to_string() + ", the sharding one on " +
                              device_.to_string());
    }
    if (*group == sharding_ || (dp_ && *group == dp_)) {
      return invalid_argument(std::string("engine: the ") + name +
                              " communicator is the engine's sharding or dp communicator");
    }
    HPS_RETURN_IF_ERROR(check_topology_axis(**group, name, "engine"));
  }
  if (mp && mp == pp) {
    return invalid_argument("engine: the mp and pp communicators are the same communicator");
  }
  mp_ = std::move(mp);
  pp_ = std::move(pp);
  return Status::Ok();
}

namespace {
// A group's size for seal's checks: no group and a group of one rank are the same to the
// engine.
uint64_t group_size(const std::shared_ptr<Communicator>& c) {
  return c ? static_cast<uint64_t>(c->size()) : 1;
}
}  // namespace

Status EngineBase::check_registrations(uint64_t& found, Status& first) {
  auto mismatch = [&](uint64_t kind, Status s) {
    found |= kind;
    if (first.ok()) first = std::move(s);
  };
  // `value` on every rank of each group, else the first rank that differs, "engine: rank r of
  // group 'g' " + `differs`.
  using Group = const std::shared_ptr<Communicator>*;
  // `explain` (when given) says how rank r differs: every rank of a group whose values are
  // not all equal calls it (collective over the group), with the first rank that differs
  // from it, or -1 when none does.
  using Explain = std::function<StatusOr<std::string>(Communicator&, int64_t)>;
  auto compare = [&](std::initializer_list<Group> groups, uint64_t value, uint64_t kind,
                     const std::string& differs, const Explain& explain = nullptr) -> Status {
    for (Group group : groups) {
      if (!*group || (*group)->size() == 1) continue;
      HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> all, gather_values(**group, value));
      int64_t first_other = -1;
      bool alike = true;
      for (size_t r = 0; r < all.size(); ++r) {
        alike = alike && all[r] == all[0];
        if (first_other < 0 && all[r] != value) first_other = static_cast<int64_t>(r);
      }
      std::string how;
      if (!alike && explain) {
        HPS_ASSIGN_OR_RETURN(how, explain(**group, first_other));
      }
      if (first_other >= 0) {
        mismatch(kind, invalid_argument(
                           "engine: " + (*group)->rank_names()(static_cast<int32_t>(first_other)) +
                           " of group '" + (*group)->name() + "' " + differs +
                           (how.empty() ? std::string() : ": " + how)));
      }
    }
    return Status::Ok();
  };
  // A rank with nothing registered (a pp stage given no parameters) is refused with the rest
  // (returning alone, it left its mp and pp peers waiting until the timeout).
  if (plan_.params().empty()) {
    mismatch(kSealNoParams, failed_precondition("engine: no parameters registered"));
  }
  // Every rank of both groups registered the same model.
  HPS_RETURN_IF_ERROR(compare(
      {&sharding_, &dp_}, plan_.fingerprint(), kSealParamsDiffer,
      "registered other parameters than this rank (its names, shapes, "
      "dtypes, flags or units differ)",
      [this](Communicator& group, int64_t r) { return explain_param_difference(group, r); }));
  auto mix = [](uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; };
  // Every rank of every group runs the same engine: stage, optimizer and its
  // hyperparameters, clipping, layout, buckets, accumulation and loss scaling (ranks that
  // differed there updated their shards differently, or called different collectives and
  // waited for one another until the timeout). The prefetch window and streams are local.
  {
    auto bits = [](float f) {
      uint32_t u = 0;
      std::memcpy(&u, &f, sizeof u);
      return uint64_t{u};
    };
    auto bits64 = [](double d) {
      uint64_t u = 0;
      std::memcpy(&u, &d, sizeof u);
      return u;
    };
    const EngineOptions& o = options_;
    auto text = [](double v) {
      std::ostringstream out;
      out << v;
      return out.str();
    };
    struct Field {
      const char* name;
      uint64_t bits;
      std::string value;  // this rank's, for the message
    };
    const Field fields[] = {
        {"stage", static_cast<uint64_t>(stage()), std::to_string(stage())},
        {"optimizer", static_cast<uint64_t>(o.optimizer),
         o.optimizer == OptimizerKind::kAdamW ? "AdamW" : "SGD"},
        {"sgd.learning_rate", bits(o.sgd.learning_rate), text(o.sgd.learning_rate)},
        {"sgd.momentum", bits(o.sgd.momentum), text(o.sgd.momentum)},
        {"sgd.weight_decay", bits(o.sgd.weight_decay), text(o.sgd.weight_decay)},
        {"sgd.nesterov", uint64_t{o.sgd.nesterov}, std::to_string(o.sgd.nesterov)},
        {"adamw.learning_rate", bits(o.adamw.learning_rate), text(o.adamw.learning_rate)},
        {"adamw.beta1", bits(o.adamw.beta1), text(o.adamw.beta1)},
        {"adamw.beta2", bits(o.adamw.beta2), text(o.adamw.beta2)},
        {"adamw.epsilon", bits(o.adamw.epsilon), text(o.adamw.epsilon)},
        {"adamw.weight_decay", bits(o.adamw.weight_decay), text(o.adamw.weight_decay)},
        {"clip_max_norm", bits64(o.clip_max_norm), text(o.clip_max_norm)},
        {"deterministic_clip", uint64_t{o.deterministic_clip},
         std::to_string(o.deterministic_clip)},
        {"alignment_bytes", o.alignment_bytes, std::to_string(o.alignment_bytes)},
        {"bucket_bytes", o.bucket_bytes, std::to_string(o.bucket_bytes)},
        {"accumulation_steps", static_cast<uint64_t>(o.accumulation_steps),
         std::to_string(o.accumulation_steps)},
        {"dynamic_loss_scaling", uint64_t{o.dynamic_loss_scaling},
         std::to_string(o.dynamic_loss_scaling)},
        {"initial_loss_scale", bits(o.initial_loss_scale), text(o.initial_loss_scale)},
        {"growth_factor", bits(o.growth_factor), text(o.growth_factor)},
        {"backoff_factor", bits(o.backoff_factor), text(o.backoff_factor)},
        {"growth_interval", static_cast<uint64_t>(o.growth_interval),
         std::to_string(o.growth_interval)},
    };
    uint64_t engine = 1469598103934665603ull;
    std::vector<uint64_t> values;
    for (const Field& f : fields) {
      engine = mix(engine, f.bits);
      values.push_back(f.bits);
    }
    // The first field in which the differing rank's options differ, with this rank's value.
    auto explain = [&](Communicator& group, int64_t r) -> StatusOr<std::string> {
      HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> all, gather_values(group, values));
      if (r < 0) return std::string();
      for (size_t i = 0; i < values.size(); ++i) {
        if (all[static_cast<size_t>(r) * values.size() + i] != values[i]) {
          return std::string("its ") + fields[i].name +
                 " differs (this rank's: " + fields[i].value + ")";
        }
      }
      return std::string();
    };
    HPS_RETURN_IF_ERROR(compare({&sharding_, &dp_, &mp_, &pp_}, engine, kSealOptionsDiffer,
                                "was created with other engine options (stage, optimizer or its "
                                "hyperparameters, clipping, alignment, buckets, accumulation or "
                                "loss scaling) than this rank",
                                explain));
    // Stage 3 prefetches all-gathers among its reduce-scatters on the sharding group, as
    // far ahead as the window lets it: ranks of one group with other windows would call
    // the group's collectives in other orders. (Other groups may differ: pipeline stages.)
    const uint64_t window = stage() == 3 ? static_cast<uint64_t>(o.prefetch_window) : 0;
    HPS_RETURN_IF_ERROR(compare({&sharding_}, window, kSealOptionsDiffer,
                                "was created with another prefetch_window (" +
                                    std::to_string(o.prefetch_window) +
                                    " here): a sharding group's ranks prefetch alike"));
  }
  auto rank_in = [](const std::shared_ptr<Communicator>& c) -> uint64_t {
    return c ? static_cast<uint64_t>(c->rank()) : 0;
  };
  const std::pair<const std::shared_ptr<Communicator>*, const std::shared_ptr<Communicator>*>
      axes[] = {{&mp_, &pp_}, {&pp_, &mp_}};
  for (const auto& [group, other] : axes) {
    if (!*group || (*group)->size() == 1) continue;
    const char* name = group == &mp_ ? "mp" : "pp";
    // The members of an axis's group share every other coordinate, and the sizes of the
    // other groups (a pp group whose members' mp groups differ in size was split by hand
    // into groups of the wrong size).
    uint64_t coordinates = 1469598103934665603ull;
    for (uint64_t v : {rank_in(sharding_), rank_in(dp_), rank_in(*other), group_size(sharding_),
                       group_size(dp_), group_size(*other)}) {
      coordinates = mix(coordinates, v);
    }
    HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> all, gather_values(**group, coordinates));
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] != coordinates) {
        mismatch(kSealGroupsDiffer,
                 invalid_argument(
                     "engine: " + (*group)->rank_names()(static_cast<int32_t>(r)) + " of the " +
                     name + " group '" + (*group)->name() + "' is at other sharding, dp or " +
                     (group == &mp_ ? "pp" : "mp") +
                     " coordinates, or in groups of other sizes, than this rank: the " + name +
                     " group must be that axis of the topology the sharding and dp groups "
                     "come from"));
        break;
      }
    }
    if (group != &mp_) continue;
    // D is summed over mp and N is not: the mp ranks must agree on which gradients are which.
    uint64_t flags = mix(1469598103934665603ull, plan_.params().size());
    for (const ParamSpec& p : plan_.params()) {
      flags = mix(flags, (p.trainable ? 1u : 0u) | (p.is_distributed ? 2u : 0u) |
                             (p.need_clip ? 4u : 0u) | (p.shared_not_first ? 8u : 0u));
    }
    HPS_ASSIGN_OR_RETURN(all, gather_values(**group, flags));
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] != flags) {
        mismatch(kSealMpFlagsDiffer,
                 invalid_argument(
                     "engine: " + (*group)->rank_names()(static_cast<int32_t>(r)) +
                     " of the mp group '" + (*group)->name() +
                     "' registered other parameters or flags (FROZEN, DISTRIBUTED, NO_CLIP, "
                     "SHARED_NOT_FIRST) than this rank's " +
                     std::to_string(plan_.params().size()) +
                     ": the clip and the skip of a step need them equal across mp"));
        break;
      }
    }
  }
  return Status::Ok();
}

namespace {

// What seal compares of a parameter, field by field: its name, its shape, its dtype, and its
// unit with its flags (what LayoutPlan::fingerprint mixes).
constexpr size_t kParamFields = 4;
uint64_t fnv(std::string_view bytes) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : bytes) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}
std::string flags_text(const ParamSpec& p) {
  std::string text;
  for (const auto& [on, name] :
       {std::pair{!p.trainable, "frozen"}, std::pair{p.is_distributed, "distributed"},
        std::pair{!p.need_clip, "no clip"}, std::pair{p.shared_not_first, "shared, not first"},
        std::pair{!p.weight_decay, "no weight decay"}}) {
    if (on) text += (text.empty() ? "" : ", ") + std::string(name);
  }
  return "unit " + std::to_string(p.unit) + (text.empty() ? "" : ", " + text);
}

}  // namespace

StatusOr<std::string> EngineBase::explain_param_difference(Communicator& group, int64_t r) const {
  const std::vector<ParamSpec>& params = plan_.params();
  HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> counts, gather_values(group, params.size()));
  const uint64_t shared = *std::min_element(counts.begin(), counts.end());
  std::vector<uint64_t> mine;
  mine.reserve(shared * kParamFields);
  for (uint64_t i = 0; i < shared; ++i) {
    const ParamSpec& p = params[i];
    std::string shape(reinterpret_cast<const char*>(p.shape.data()),
                      p.shape.size() * sizeof(int64_t));
    mine.push_back(fnv(p.name));
    mine.push_back(fnv(shape) ^ p.shape.size());
    mine.push_back(static_cast<uint64_t>(p.dtype));
    mine.push_back(fnv(flags_text(p)));
  }
  std::vector<uint64_t> all;
  if (shared > 0) {
    HPS_ASSIGN_OR_RETURN(all, gather_values(group, mine));
  }
  if (r < 0) return std::string();
  const size_t theirs = static_cast<size_t>(r) * mine.size();
  for (uint64_t i = 0; i < shared; ++i) {
    const ParamSpec& p = params[i];
    const std::string which = "its parameter " + std::to_string(i) + " ";
    const uint64_t* t = all.data() + theirs + i * kParamFields;
    const uint64_t* m = mine.data() + i * kParamFields;
    if (t[0] != m[0]) return which + "has another name than this rank's '" + p.name + "'";
    if (t[1] != m[1]) {
      return which + "'" + p.name + "' has another shape than this rank's " + shape_text(p.shape);
    }
    if (t[2] != m[2]) {
      return which + "'" + p.name + "' has another dtype than this rank's " +
             std::string(dtype_name(p.dtype));
    }
    if (t[3] != m[3]) {
      return which + "'" + p.name + "' is in another unit or has other flags than this rank's (" +
             flags_text(p) + ")";
    }
  }
  return "it registered " + std::to_string(counts[static_cast<size_t>(r)]) +
         " parameters, this rank " + std::to_string(params.size());
}

Status EngineBase::agree_on_group_sizes() {
  // Every rank of the sharding and dp groups set model-parallel groups of the same sizes, or
  // none. Agreed over those groups alone, before any check over mp or pp: a rank without
  // them would never join its peers there, and they would wait out the timeout.
  auto sizes_text = [](uint64_t sizes) {
    return "mp " + std::to_string(sizes >> 32) + ", pp " + std::to_string(sizes & 0xffffffffu);
  };
  const uint64_t mine = group_size(mp_) << 32 | group_size(pp_);
  Status first = Status::Ok();
  for (const auto* group : {&sharding_, &dp_}) {
    if (!*group) continue;
    HPS_ASSIGN_OR_RETURN(std::vector<uint64_t> all, gather_values(**group, mine));
    for (size_t r = 0; r < all.size() && first.ok(); ++r) {
      if (all[r] != mine) {
        first = invalid_argument("engine: " + (*group)->rank_names()(static_cast<int32_t>(r)) +
                                 " of group '" + (*group)->name() +
                                 "' set model-parallel groups of sizes " + sizes_text(all[r]) +
                                 ", this rank " + sizes_text(mine) +
                                 " (every rank calls set_model_parallel_groups with its "
                                 "groups, or none does; no group counts as 1)");
      }
    }
  }
  HPS_ASSIGN_OR_RETURN(uint64_t differ,
                       combine_over({sharding_.get(), dp_.get()}, first.ok() ? 0 : 1,
                                    [](uint64_t a, uint64_t b) { return a | b; }));
  if (differ == 0) return Status::Ok();
  if (!first.ok()) return first;
  return invalid_argument(
      "engine: seal refused on every rank: ranks set model-parallel groups of different "
      "sizes, or some none (the ranks that found it name it in their errors)");
}

Status EngineBase::agree_on_registrations() {
  uint64_t found = 0;
  Status first = Status::Ok();
  HPS_RETURN_IF_ERROR(agree_on_group_sizes());
  HPS_RETURN_IF_ERROR(check_registrations(found, first));
  // Every rank learns what any rank found, so all refuse together: a rank that returned
  // alone would leave the others waiting in their next collective until the timeout.
  HPS_ASSIGN_OR_RETURN(found, combine_over({sharding_.get(), dp_.get(), mp_.get(), pp_.get()},
                                           found, [](uint64_t a, uint64_t b) { return a | b; }));
  if (found == 0) return Status::Ok();
  if (!first.ok()) return first;
  if (found == kSealNoParams) {
    return failed_precondition(
        "engine: seal refused on every rank: a rank registered no parameters (it names "
        "itself: 'no parameters registered')");
  }
  std::string what;
  for (const auto& [kind, text] :
       {std::pair{kSealParamsDiffer, "ranks registered different parameters"},
        std::pair{kSealGroupsDiffer, "an mp or pp group is not an axis of the topology"},
        std::pair{kSealMpFlagsDiffer, "mp ranks registered different clip flags"},
        std::pair{kSealOptionsDiffer, "ranks were created with different engine options"},
        std::pair{kSealNoParams, "a rank registered no parameters"}}) {
    if (found & kind) what += (what.empty() ? "" : "; ") + std::string(text);
  }
  return invalid_argument("engine: seal refused on every rank: " + what +
                          " (the ranks that found it name it in their errors)");
}

std::vector<Communicator*> EngineBase::model_parallel_groups() const {
  std::vector<Communicator*> out;
  for (const auto* group : {&mp_, &pp_}) {
    if (*group && (*group)->size() > 1) out.push_back(group->get());
  }
  return out;
}

Status EngineBase::check_sealed(const char* call) const {
  if (sealed_) return Status::Ok();
  HPS_RETURN_IF_ERROR(check_not_dropped());
  return failed_precondition(std::string("engine: ") + call + " before seal()");
}

Status EngineBase::seal_storage(std::vector<RoleLayout> roles,
                                const std::function<Status()>& rest) {
  HPS_RETURN_IF_ERROR(check_not_dropped());
  if (sealed_) return failed_precondition("engine: sealed twice");
  failure_link_ =
      Communicator::link_failures({sharding_.get(), dp_.get(), mp_.get(), pp_.get()}, "engine");
  // Every rank of every group registered the same model, and some model (host-blocking,
  // set-up).
  HPS_RETURN_IF_ERROR(agree_on_registrations());
  LayoutPlan unsealed = plan_;  // what a failed seal restores
  const Status s = [&]() -> Status {
    HPS_RETURN_IF_ERROR(
        plan_.seal(sharding_->size(), options_.alignment_bytes, options_.bucket_bytes));
    for (RoleLayout& r : ShardedOptimizer::state_roles(options_)) roles.push_back(std::move(r));
    Stream& stream = optimizer_stream();
    HPS_ASSIGN_OR_RETURN(storage_, ShardedStorage::create(plan_, device_, roles, stream));
    HPS_ASSIGN_OR_RETURN(optimizer_, ShardedOptimizer::create(options_, device_, *storage_,
                                                              {sharding_, dp_, mp_, pp_}, stream));
    // The framework may write its initial values from any thread or stream once seal()
    // returns: the zeroing is done by then (set-up, one counted host sync).
    HPS_RETURN_IF_ERROR(stream.synchronize());
    buckets_.init(plan_, options_.accumulation_steps);
    held_.clear();
    held_.resize(plan_.buffers().size());
    return rest();
  }();
  if (!s.ok()) {
    // The optimizer stream may still be zeroing the storage: it finishes before the memory
    // goes (set-up; counted like seal's own wait).
    (void)optimizer_stream().synchronize();
    optimizer_.reset();
    storage_.reset();
    plan_ = std::move(unsealed);
    return s;
  }
  sealed_ = true;
  return Status::Ok();
}

Status EngineBase::broadcast_full(const std::function<DevicePtr<void>(size_t)>& full) {
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    void* data = full(b).get();
    // After the framework wrote its initial values on its compute stream.
    HPS_ASSIGN_OR_RETURN(auto w, sharding_->broadcast(data, buf.numel, buf.dtype, 0, &compute()));
    HPS_RETURN_IF_ERROR(w->wait());
    if (dp_) {
      HPS_ASSIGN_OR_RETURN(auto d, dp_->broadcast(data, buf.numel, buf.dtype, 0, &compute()));
      HPS_RETURN_IF_ERROR(d->wait());
    }
  }
  return Status::Ok();
}

Status EngineBase::reduce_in_order(size_t index, Stream* ready, bool reduces,
                                   const std::function<Status(size_t, Stream*)>& reduce) {
  HPS_ASSIGN_OR_RETURN(bool complete, buckets_.check_in(plan_, index));
  if (!complete) return Status::Ok();
  const size_t b = plan_.placement(index).buffer;
  if (!reduces) {
    // Nothing is launched: the turns pass to every complete bucket at the head of the order.
    while (buckets_.next_ready()) buckets_.started();
    return Status::Ok();
  }
  Stream& gradients = gradients_from(ready);
  if (buckets_.next() != b) {
    // Its turn comes after buckets not yet complete: the point its gradients are at.
    if (!held_[b]) {
      HPS_ASSIGN_OR_RETURN(held_[b], create_event(device_));
    }
    return held_[b]->record(gradients);
  }
  while (buckets_.next_ready()) {
    const size_t next = buckets_.next();
    if (next == b) {
      HPS_RETURN_IF_ERROR(reduce(next, &gradients));
    } else {
      HPS_RETURN_IF_ERROR(sharding_->stream().wait(*held_[next]));
      HPS_RETURN_IF_ERROR(reduce(next, nullptr));
    }
    buckets_.started();
  }
  return Status::Ok();
}

Status EngineBase::wait_for(Stream& consumer, Work& work) {
  HPS_RETURN_IF_ERROR(work.test().status());  // finished with an error: say so now
  HPS_RETURN_IF_ERROR(consumer.wait(work.done_event()));
  return work.test().status();
}

Status EngineBase::stepped() {
  if (!stepped_) {
    HPS_ASSIGN_OR_RETURN(stepped_, create_event(device_));
  }
  return stepped_->record(optimizer_stream());
}

Status EngineBase::wait_stepped(bool unit_has_update) {
  if (unit_has_update || !stepped_) return Status::Ok();
  return compute().wait(*stepped_);
}

Status EngineBase::reset_loss_scaling(float scale) {
  StepState* state = optimizer_->state().get();  // an address, written on the stream
  const int32_t none = 0;
  Stream& opt = optimizer_stream();
  Status copied = opt.memcpy_async(&state->loss_scale, &scale, sizeof(scale));
  if (copied.ok()) copied = opt.memcpy_async(&state->good_steps, &none, sizeof(none));
  if (!copied.ok()) {
    (void)drain(opt);  // a copy queued reads this frame
    return copied;
  }
  return opt.synchronize();  // the sources are this frame's
}

Status EngineBase::settle_loaded_scaling() {
  return options_.dynamic_loss_scaling ? Status::Ok() : reset_loss_scaling(1.0f);
}

Status EngineBase::restart_loss_scaling() {
  return options_.dynamic_loss_scaling ? reset_loss_scaling(options_.initial_loss_scale)
                                       : Status::Ok();
}

float EngineBase::mean_scale() const {
  return 1.0f / static_cast<float>(sharding_->size() * (dp_ ? dp_->size() : 1) *
                                   options_.accumulation_steps);
}

ShardStep EngineBase::shard_step(size_t b) const {
  ShardStep s;
  s.buffer = b;
  s.count = plan_.buffers()[b].shard_numel;
  s.grad = storage_->get<float>(StorageRole::kGradShard, b);
  s.spans = plan_.shard_spans(b, sharding_->rank(), optimizer_->clips());
  return s;
}

StatusOr<float*> EngineBase::param(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* p, param_data(index));
  HPS_RETURN_IF_ERROR(check_float32_view(plan_, index));
  return static_cast<float*>(p);
}

StatusOr<float*> EngineBase::grad(size_t index) {
  HPS_ASSIGN_OR_RETURN(void* g, grad_data(index));
  HPS_RETURN_IF_ERROR(check_float32_view(plan_, index));
  return static_cast<float*>(g);
}

Status EngineBase::set_learning_rate(float learning_rate) {
  if (!std::isfinite(learning_rate) || learning_rate < 0) {
    return invalid_argument("engine: learning_rate must be >= 0 and finite, not " +
                            std::to_string(learning_rate));
  }
  options_.sgd.learning_rate = learning_rate;
  options_.adamw.learning_rate = learning_rate;
  if (optimizer_) optimizer_->set_learning_rate(learning_rate);
  return Status::Ok();
}

const float* EngineBase::loss_scale() const {
  return optimizer_ ? &optimizer_->state().get()->loss_scale : nullptr;  // an address
}

const int64_t* EngineBase::skipped_steps() const {
  return optimizer_ ? &optimizer_->state().get()->skipped_steps : nullptr;  // an address
}

const float* EngineBase::grad_norm() const {
  const HybridClip* clip = optimizer_ ? optimizer_->clip() : nullptr;
  return clip ? &clip->state().get()->norm : nullptr;  // an address
}

uint64_t EngineBase::resident_bytes() const {
  return (storage_ ? storage_->bytes() : 0) + transient_bytes();
}

StatusOr<std::vector<std::vector<float>>> EngineBase::gather_all() {
  HPS_RETURN_IF_ERROR(check_sealed("gather_all()"));
  HPS_RETURN_IF_ERROR(check_has_state());  // stage 3 before broadcast_parameters(): none
  HPS_RETURN_IF_ERROR(synchronize());
  std::vector<std::vector<float>> out(plan_.params().size());
  Stream& stream = sharding_->stream();
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    const FlatBuffer& buf = plan_.buffers()[b];
    const auto [shard, dtype] = parameter_shard(b);
    const size_t element = dtype_size(dtype);
    HPS_ASSIGN_OR_RETURN(DeviceBuffer gathered,
                         DeviceBuffer::allocate(device_, buf.numel * element));
    HPS_ASSIGN_OR_RETURN(
        auto work, sharding_->all_gather(shard.get(), gathered.data().get(), buf.shard_numel, dtype,
                                         nullptr, bucket_tag(b)));
    HPS_RETURN_IF_ERROR(work->wait());
    DeviceBuffer widened;
    DevicePtr<const float> full = gathered.data<const float>();
    if (dtype != DType::kFloat32) {
      HPS_ASSIGN_OR_RETURN(widened, DeviceBuffer::allocate(device_, buf.numel * sizeof(float)));
      HPS_RETURN_IF_ERROR(kernels_->cast(stream, dtype, gathered.data<const void>(),
                                         DType::kFloat32, widened.data(), buf.numel));
      full = widened.data<const float>();
    }
    std::vector<float> host(buf.numel);
    HPS_RETURN_IF_ERROR(copy_to_host(stream, host.data(), full.get(), buf.numel * sizeof(float)));
    for (size_t i : buf.params) {
      const Placement& p = plan_.placement(i);
      out[i].assign(host.begin() + static_cast<std::ptrdiff_t>(p.offset),
                    host.begin() + static_cast<std::ptrdiff_t>(p.offset + p.numel));
    }
  }
  return out;
}

// ---- Checkpointable ----

StatusOr<std::vector<StateTensor>> EngineBase::state_tensors() {
  HPS_RETURN_IF_ERROR(check_sealed("state_tensors()"));
  // A save may come at any point of a step (stage 3: with units gathered, which only read
  // the shards); a load checks more (begin_state_load).
  HPS_RETURN_IF_ERROR(check_has_state());
  ShardPointers shards;
  shards.adamw = options_.optimizer == OptimizerKind::kAdamW;
  const StorageRole state_a = shards.adamw ? StorageRole::kExpAvg : StorageRole::kMomentum;
  for (size_t b = 0; b < plan_.buffers().size(); ++b) {
    const bool wide = plan_.buffers()[b].dtype == DType::kFloat32;
    shards.params.push_back(model_parameter_shard(b).get());
    // fp32 parameters are their own masters; fp16 / bf16 ones keep fp32 masters.
    shards.masters.push_back(wide ? nullptr : storage_->get<float>(StorageRole::kMasters, b).get());
    shards.state_a.push_back(storage_->get<float>(state_a, b).get());
    shards.state_b.push_back(storage_->get<float>(StorageRole::kExpAvgSq, b).get());
  }
  StepState* step = optimizer_->state().get();  // addresses, read by copies on the stream
  return sharded_state_tensors(
      plan_, sharding_->rank(), dp_ ? dp_->rank() : 0, shards,
      {&step->loss_scale, &step->good_steps, &step->applied_steps, &step->skipped_steps});
}

CheckpointTopology EngineBase::checkpoint_topology() const {
  CheckpointTopology t;
  t.stage = stage();
  t.sharding = sharding_->size();
  t.sharding_rank = sharding_->rank();
  t.dp = dp_ ? dp_->size() : 1;
  t.dp_rank = dp_ ? dp_->rank() : 0;
  t.alignment_bytes = options_.alignment_bytes;
  t.mp = mp_ ? mp_->size() : 1;
  t.mp_rank = mp_ ? mp_->rank() : 0;
  t.pp = pp_ ? pp_->size() : 1;
  t.pp_rank = pp_ ? pp_->rank() : 0;
  return t;
}

Status EngineBase::begin_state_load() {
  HPS_RETURN_IF_ERROR(check_sealed("a state load"));
  HPS_RETURN_IF_ERROR(check_loadable());
  if (!buckets_.between_steps()) {
    return failed_precondition(
        "engine: state can be loaded between steps only (gradients have checked in since the "
        "last step())");
  }
  return synchronize();
}

}  // namespace hps
