// The engine through the public C API against the float64 model of its documented semantics
// (tests/reference/engine_model.h), over randomised cases: stage 2 and 3, 1-4 sharding ranks
// under 1-2 dp ranks, the model cut across 1-2 tensor (mp) and 1-2 pipeline (pp) ranks (up to
// 8 ranks; ranks are threads over a memory:// store, groups from the hybrid group, the mp and
// pp groups given to the engine, so that its clip and skip span the whole model),
// SGD and AdamW with random hyperparameters, clipping (deterministic or not), accumulation,
// dynamic loss scaling with injected non-finite gradients, odd sizes, several units in a
// random forward order, NO_CLIP, NO_WEIGHT_DECAY, frozen, distributed and shared parameters,
// fp16 and bf16 parameters, prefetch windows 1-3 and several alignments; in about four cases
// of ten every rank saves a checkpoint after a random step and fresh engines at another layout
// (stage, sharding and dp degrees, alignment, prefetch window, fp32 <-> bf16 and fp16 -> fp32
// parameters) load it and run the remaining steps, while the model runs on unaware of it.
//
// Each rank's gradient is g = a ⊙ p + b (a per rank, b per rank, step and micro-batch) with p
// read from the engine's own view during backward, as a framework computes it; the same
// gradients go to the model, so that one parameter's difference does not spread to the
// others. Checks: every view the framework reads (forward and backward, every micro-batch of
// every step) equals the model's visible parameter, so a stale gather or all-gather shows;
// the gradient view holds what the framework added so far in the step (stage 2) or in the
// micro-batch (stage 3), zero at its start;
// the loss scale and the skipped steps equal the model's; every parameter's master
// (hps_engine_gather_parameter) is within the model's error bound after about half of the
// steps and the last (gathering blocks until the step is done, which would hide a missing
// wait from the views that follow). A difference is reported once per check and parameter,
// with the seed, the case and, where the engine matches the model of a known fault, its name.
//
// Environment: HPS_REFERENCE_SEED=S[,S...] runs only those cases; HPS_REFERENCE_CASES=N runs
// N cases (default 64, about 10 s) from HPS_REFERENCE_FIRST_SEED (default 1).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hpshard/hpshard.h"
#include "tests/reference/engine_model.h"
#include "tests/support/seeds.h"

namespace {

using hps_ref::DType;

// ---------------------------------------------------------------------------------------
// Random numbers: splitmix64, so a case is a pure function of its seed.

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(mix(seed)) {}
  uint64_t next() { return state_ = mix(state_); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  int integer(int lo, int hi) {  // [lo, hi]
    return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(double p) { return uniform() < p; }
  double log_uniform(double lo, double hi) { return std::exp(uniform(std::log(lo), std::log(hi))); }

 private:
  uint64_t state_;
};

// A uniform value in [-1, 1) named by its coordinates (no state to keep in step).
double hashed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e) {
  uint64_t h = mix(seed);
  for (uint64_t x : {a, b, c, d, e}) h = mix(h ^ x);
  return static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0;
}

// ---------------------------------------------------------------------------------------
// A case.

struct Injection {
  int step = -1;
  int rank = 0;
  int micro = 0;
  size_t param = 0;
  size_t element = 0;
  double value = 0;
};

struct Case {
  uint64_t seed = 0;
  int stage = 2;
  int sharding = 1;
  int dp = 1;
  bool pass_dp_comm = false;    // dp == 1: hand the engine the 1-rank dp group, or NULL
  int mp = 1, pp = 1;           // tensor and pipeline degrees: the model in mp × pp parts
  bool pass_mp_groups = false;  // mp == pp == 1: hand the engine the 1-rank groups, or not
  int steps = 3;
  int prefetch_window = 2;
  uint64_t alignment_bytes = 0;  // 0: the default
  bool deterministic_clip = false;
  hps_ref::Options options;
  std::vector<hps_ref::Param> params;
  std::vector<double> grad_scale;  // per parameter: the size of its gradients
  std::vector<int32_t> forward_order;
  std::vector<Injection> injections;
  std::vector<bool> gather_after;  // per step: compare the masters right after it
  std::vector<std::vector<double>> initial;
  // [part][param]: each part's initial values (part 0's are `initial`); a part's
  // non-DISTRIBUTED parameters are those of the part at mp 0 of its pp stage (replicated).
  std::vector<std::vector<std::vector<double>>> part_initial;
  // >= 0: every rank saves a checkpoint after this step, and fresh engines at the layout of
  // `resumed` (another stage, sharding and dp degree, alignment, prefetch window) load it
  // and run the remaining steps; the model runs on as if nothing happened.
  int save_after = -1;
  struct Resumed {
    int stage = 2, sharding = 1, dp = 1;
    bool pass_dp_comm = false;
    int prefetch_window = 1;
    uint64_t alignment_bytes = 0;
    std::vector<DType> dtypes;  // per parameter: its dtype after the resume
  } resumed;

  // The case from step save_after + 1 on: the resumed layout, injections on its ranks.
  Case after_resume() const {
    Case r = *this;
    r.stage = resumed.stage;
    r.sharding = resumed.sharding;
    r.dp = resumed.dp;
    r.pass_dp_comm = resumed.pass_dp_comm;
    r.prefetch_window = resumed.prefetch_window;
    r.alignment_bytes = resumed.alignment_bytes;
    r.options.ranks = r.sharding * r.dp;
    for (size_t i = 0; i < r.params.size(); ++i) r.params[i].dtype = resumed.dtypes[i];
    for (Injection& in : r.injections) in.rank %= r.world();
    return r;
  }

  int parts() const { return mp * pp; }
  int world() const { return sharding * dp * mp * pp; }
  // Coordinates of a rank in the default order dp, pp, sharding, sep (1), mp: its part
  // (pp · mp_degree + mp) and its replica (dp · sharding_degree + sharding) within the part.
  int mp_of(int rank) const { return rank % mp; }
  int part_of(int rank) const { return ((rank / (mp * sharding)) % pp) * mp + mp_of(rank); }
  int replica_of(int rank) const {
    return (rank / (mp * sharding * pp)) * sharding + (rank / mp) % sharding;
  }
};

const char* optimizer_name(hps_ref::Optimizer o) {
  return o == hps_ref::Optimizer::kSgd ? "SGD" : "AdamW";
}

std::string flags_text(const hps_ref::Param& p) {
  std::string s = hps_ref::dtype_name(p.dtype);
  if (!p.trainable) s += ",FROZEN";
  if (!p.need_clip) s += ",NO_CLIP";
  if (p.is_distributed) s += ",DISTRIBUTED";
  if (p.shared_not_first) s += ",SHARED_NOT_FIRST";
  if (!p.weight_decay) s += ",NO_WEIGHT_DECAY";
  return s;
}

std::string describe(const Case& c) {
  const hps_ref::Options& o = c.options;
  std::ostringstream s;
  s.precision(6);
  s << "stage " << c.stage << ", sharding " << c.sharding << " x dp " << c.dp
    << (c.dp == 1 ? (c.pass_dp_comm ? " (1-rank dp group)" : " (no dp group)") : "") << " x mp "
    << c.mp << " x pp " << c.pp
    << (c.parts() == 1 ? (c.pass_mp_groups ? " (1-rank mp and pp groups)" : " (no mp, pp groups)")
                       : "")
    << ", " << c.steps << " steps, " << optimizer_name(o.optimizer) << " lr " << o.learning_rate;
  if (o.optimizer == hps_ref::Optimizer::kSgd) {
    s << " momentum " << o.momentum << (o.nesterov ? " nesterov" : "");
  } else {
    s << " betas " << o.beta1 << "/" << o.beta2 << " eps " << o.epsilon;
  }
  s << " wd " << o.weight_decay;
  if (o.clip_max_norm > 0) {
    s << ", clip " << o.clip_max_norm << (c.deterministic_clip ? " deterministic" : "");
  }
  s << ", accumulation " << o.accumulation_steps;
  if (o.dynamic_loss_scaling) {
    s << ", loss scaling from " << o.initial_loss_scale << " (x" << o.growth_factor << " every "
      << o.growth_interval << ", x" << o.backoff_factor << " on overflow)";
  }
  for (const Injection& in : c.injections) {
    s << ", " << in.value << " at step " << in.step << " rank " << in.rank << " micro " << in.micro
      << " param " << in.param << "[" << in.element << "]";
  }
  s << ", masters compared after steps";
  for (int k = 0; k < c.steps; ++k) {
    if (c.gather_after[static_cast<size_t>(k)] || k + 1 == c.steps) s << " " << k;
  }
  s << ", prefetch " << c.prefetch_window << ", alignment "
    << (c.alignment_bytes ? std::to_string(c.alignment_bytes) : std::string("default"));
  if (c.save_after >= 0) {
    const Case::Resumed& r = c.resumed;
    s << ", saved after step " << c.save_after << " and resumed at stage " << r.stage
      << ", sharding " << r.sharding << " x dp " << r.dp
      << (r.dp == 1 ? (r.pass_dp_comm ? " (1-rank dp group)" : " (no dp group)") : "")
      << ", prefetch " << r.prefetch_window << ", alignment "
      << (r.alignment_bytes ? std::to_string(r.alignment_bytes) : std::string("default"));
    for (size_t i = 0; i < c.params.size(); ++i) {
      if (r.dtypes[i] != c.params[i].dtype) {
        s << ", param " << i << " now " << hps_ref::dtype_name(r.dtypes[i]);
      }
    }
  }
  s << "; forward order";
  for (int32_t u : c.forward_order) s << " " << u;
  s << "; params:";
  for (size_t i = 0; i < c.params.size(); ++i) {
    const hps_ref::Param& p = c.params[i];
    s << " " << i << ":" << p.name << "[" << p.numel() << "," << flags_text(p) << ",unit " << p.unit
      << "]";
  }
  return s.str();
}

Case make_case(uint64_t seed) {
  Rng rng(seed);
  Case c;
  c.seed = seed;
  c.stage = rng.chance(0.5) ? 2 : 3;
  c.sharding = rng.integer(1, 4);
  c.dp = rng.chance(0.35) ? 2 : 1;
  c.pass_dp_comm = c.dp == 1 && rng.chance(0.5);
  c.steps = rng.integer(3, 6);
  for (int k = 0; k < c.steps; ++k) c.gather_after.push_back(rng.chance(0.5));
  c.prefetch_window = rng.integer(1, 3);
  const uint64_t alignments[] = {0, 64, 512};
  c.alignment_bytes = alignments[rng.integer(0, 2)];

  hps_ref::Options& o = c.options;
  o.ranks = c.sharding * c.dp;
  // Options travel to the engine as float: the model takes those floats' values.
  auto as_float = [](double x) { return static_cast<double>(static_cast<float>(x)); };
  if (rng.chance(0.5)) {
    o.optimizer = hps_ref::Optimizer::kSgd;
    o.learning_rate = as_float(rng.log_uniform(0.005, 0.1));
    o.momentum = rng.chance(0.6) ? as_float(rng.uniform(0.5, 0.95)) : 0.0;
    o.nesterov = o.momentum > 0 && rng.chance(0.5);
  } else {
    o.optimizer = hps_ref::Optimizer::kAdamW;
    o.learning_rate = as_float(rng.log_uniform(0.001, 0.05));
    o.beta1 = as_float(rng.uniform(0.8, 0.95));
    o.beta2 = as_float(rng.uniform(0.9, 0.999));
    const double eps[] = {1e-8, 1e-6, 1e-3};
    o.epsilon = as_float(eps[rng.integer(0, 2)]);
  }
  o.weight_decay = rng.chance(0.5) ? as_float(rng.uniform(0.0, 0.1)) : 0.0;
  if (rng.chance(0.7)) {
    o.clip_max_norm = rng.log_uniform(0.3, 30.0);
    c.deterministic_clip = rng.chance(0.4);
  }
  o.accumulation_steps = rng.integer(1, 3);

  // Parameters: odd sizes, several units, every kind of flag, three dtypes.
  const size_t sizes[] = {1, 2, 3, 5, 17, 64, 255, 256, 1000, 1031, 2053};
  const int units = rng.integer(1, 4);
  const int count = rng.integer(3, 9);
  bool any_fp16 = false;
  for (int k = 0; k < count; ++k) {
    hps_ref::Param p;
    p.name = "p" + std::to_string(k);
    const size_t n = sizes[rng.integer(0, 10)];
    p.shape = {static_cast<int64_t>(n)};
    for (int64_t d : {17, 15, 8, 5, 3}) {
      if (n % static_cast<size_t>(d) == 0 && n > static_cast<size_t>(d) && rng.chance(0.5)) {
        p.shape = {d, static_cast<int64_t>(n) / d};
        break;
      }
    }
    const double r = rng.uniform();
    p.dtype = r < 0.5 ? DType::kFloat32 : (r < 0.75 ? DType::kFloat16 : DType::kBFloat16);
    any_fp16 = any_fp16 || p.dtype == DType::kFloat16;
    p.trainable = rng.chance(0.85);
    p.need_clip = rng.chance(0.7);
    p.is_distributed = rng.chance(0.15);
    p.shared_not_first = rng.chance(0.1);
    p.weight_decay = !rng.chance(0.3);
    p.unit = (k == 0) ? 0 : rng.integer(0, units - 1);
    c.params.push_back(p);
    const double scales[] = {0.05, 1.0, 3.0};
    c.grad_scale.push_back(scales[rng.integer(0, 2)]);
  }
  // At least one trainable parameter that is clipped and counted in the norm.
  c.params[0].trainable = true;
  c.params[0].need_clip = true;
  c.params[0].shared_not_first = false;

  std::vector<int32_t> used;
  for (const auto& p : c.params) {
    if (std::find(used.begin(), used.end(), p.unit) == used.end()) used.push_back(p.unit);
  }
  for (size_t k = used.size(); k > 1; --k) {  // a random forward order
    std::swap(used[k - 1], used[static_cast<size_t>(rng.integer(0, static_cast<int>(k) - 1))]);
  }
  c.forward_order = used;

  if (rng.chance(0.45)) {
    o.dynamic_loss_scaling = true;
    o.growth_interval = rng.integer(1, 3);
    o.growth_factor = rng.chance(0.7) ? 2.0 : 4.0;
    o.backoff_factor = rng.chance(0.7) ? 0.5 : 0.25;
    // Powers of two, so that the fp32 scale and the model's agree exactly. With fp16
    // parameters the scale stays at most 32 over the whole case: the gradients (|p| stays
    // below 7 on these convex losses in 6 steps, so |g| < 24) times the scale, summed over up
    // to 24 views, stay below 65504, and only injected faults overflow. (Where an engine
    // rounds a scaled fp16 sum is left open by the documentation: an overflow there is not
    // modelled.)
    int exponent = rng.integer(0, 16);
    if (any_fp16) {
      auto growth_exponent = [&] {
        return (o.growth_factor == 2.0 ? 1 : 2) * (c.steps / o.growth_interval);
      };
      while (growth_exponent() > 5) ++o.growth_interval;
      exponent = std::min(exponent, 5 - growth_exponent());
    }
    o.initial_loss_scale = std::ldexp(1.0, exponent);
    const int faults = rng.chance(0.75) ? (rng.chance(0.3) ? 2 : 1) : 0;
    for (int f = 0; f < faults; ++f) {
      Injection in;
      // Mostly after a good step and before others: the growth count restarts there.
      in.step = rng.chance(0.7) ? rng.integer(1, c.steps - 2) : rng.integer(0, c.steps - 1);
      in.rank = rng.integer(0, o.ranks - 1);
      in.micro = rng.integer(0, o.accumulation_steps - 1);
      do {
        in.param = static_cast<size_t>(rng.integer(0, count - 1));
      } while (!c.params[in.param].trainable);
      in.element =
          static_cast<size_t>(rng.integer(0, static_cast<int>(c.params[in.param].numel()) - 1));
      const double values[] = {INFINITY, -INFINITY, NAN};
      in.value = values[rng.integer(0, 2)];
      c.injections.push_back(in);
    }
  }

  for (const auto& p : c.params) {
    std::vector<double> v(p.numel());
    for (double& x : v) x = hps_ref::round_to(p.dtype, rng.uniform(-1.0, 1.0));
    c.initial.push_back(std::move(v));
  }

  // Tensor and pipeline parallelism, drawn last (the draws above are those of a case without
  // them): up to 8 ranks in all.
  const int replica_ranks = c.sharding * c.dp;
  if (replica_ranks * 2 <= 8 && rng.chance(0.4)) c.mp = 2;
  if (replica_ranks * c.mp * 2 <= 8 && rng.chance(0.4)) c.pp = 2;
  c.pass_mp_groups = c.parts() == 1 && rng.chance(0.3);
  c.part_initial.push_back(c.initial);
  for (int k = 1; k < c.parts(); ++k) {
    std::vector<std::vector<double>> part;
    for (size_t i = 0; i < c.params.size(); ++i) {
      const hps_ref::Param& p = c.params[i];
      if (!p.is_distributed && k % c.mp != 0) {
        part.push_back(c.part_initial[static_cast<size_t>(k - k % c.mp)][i]);
        continue;
      }
      std::vector<double> v(p.numel());
      for (double& x : v) x = hps_ref::round_to(p.dtype, rng.uniform(-1.0, 1.0));
      part.push_back(std::move(v));
    }
    c.part_initial.push_back(std::move(part));
  }
  // A fault on any rank of any part: every part must skip that step.
  if (c.parts() > 1) {
    for (Injection& in : c.injections) in.rank = rng.integer(0, c.world() - 1);
  }
  // A checkpoint and a resume at another layout, drawn last (the draws above are those of a
  // case without it).
  if (rng.chance(0.4)) {
    c.save_after = rng.integer(0, c.steps - 2);
    Case::Resumed& r = c.resumed;
    r.stage = rng.chance(0.5) ? 2 : 3;
    do {
      r.sharding = rng.integer(1, 4);
      r.dp = rng.chance(0.35) ? 2 : 1;
    } while (r.sharding * r.dp * c.parts() > 8);
    r.pass_dp_comm = r.dp == 1 && rng.chance(0.5);
    r.prefetch_window = rng.integer(1, 3);
    r.alignment_bytes = alignments[rng.integer(0, 2)];
    // fp32 and bf16 parameters swap dtypes, fp16 ones become fp32 (the fp32 masters carry
    // over; an fp16 parameter made of another could overflow at the case's loss scale).
    for (const hps_ref::Param& p : c.params) {
      DType t = p.dtype;
      if (rng.chance(0.4)) t = t == DType::kBFloat16 ? DType::kFloat32 : DType::kBFloat16;
      if (p.dtype == DType::kFloat16 && t == DType::kBFloat16) t = DType::kFloat32;
      r.dtypes.push_back(t);
    }
  }
  return c;
}

// ---------------------------------------------------------------------------------------
// Running a case: one thread per rank.

// A barrier that a failing rank can break, so that no rank waits for one that has left.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  bool arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (broken_) return false;
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return true;
    }
    cv_.wait(lock, [&] { return broken_ || generation_ != generation; });
    return generation_ != generation;
  }
  void breaks() {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;
};

std::vector<hps_ref::EngineModel> part_models(const Case& c) {
  std::vector<hps_ref::EngineModel> parts;
  for (const auto& initial : c.part_initial) parts.emplace_back(c.params, c.options, initial);
  return parts;
}

// The steps a set of engines runs: all of a case's, or those before or after its checkpoint.
struct Phase {
  int first_step = 0, end_step = 0;  // [first_step, end_step)
  std::string root;                  // the checkpoints' root (one directory per part under it)
  bool load = false;                 // load the checkpoint before the first step
  bool save = false;                 // save one after the last step
};

struct Shared {
  Shared(const Case& the_case, std::string url, hps_ref::HybridModel the_model, Phase the_phase)
      : c(the_case),
        world(the_case.world()),
        store_url(std::move(url)),
        phase(std::move(the_phase)),
        model(std::move(the_model)),
        last(static_cast<size_t>(the_case.parts())),
        before(static_cast<size_t>(the_case.parts())),
        barrier(world),
        grads(static_cast<size_t>(world)),
        comms(static_cast<size_t>(world)) {}

  const Case& c;
  const int world;
  const std::string store_url;
  const Phase phase;
  hps_ref::HybridModel model;  // one part per (pp, mp); stepped by rank 0 between two barriers
  std::vector<hps_ref::StepResult> last;  // per part, of the latest model step
  // Per part, the masters before the latest step (empty before the first).
  std::vector<std::vector<std::vector<double>>> before;
  Barrier barrier;
  // [world rank][micro][param][element], this step's
  std::vector<std::vector<std::vector<std::vector<double>>>> grads;

  // The model of the part a rank holds, and its latest step.
  hps_ref::EngineModel& model_of(int rank) {
    return model.part(static_cast<size_t>(c.part_of(rank)));
  }
  const std::vector<std::vector<double>>& before_of(int rank) const {
    return before[static_cast<size_t>(c.part_of(rank))];
  }
  const hps_ref::StepResult& last_of(int rank) const {
    return last[static_cast<size_t>(c.part_of(rank))];
  }
  // Steps every part of the model over the gradients the ranks produced.
  void step_model() {
    std::vector<hps_ref::StepGradients> by_part(
        static_cast<size_t>(c.parts()),
        hps_ref::StepGradients(static_cast<size_t>(c.options.ranks)));
    for (int r = 0; r < world; ++r) {
      by_part[static_cast<size_t>(c.part_of(r))][static_cast<size_t>(c.replica_of(r))] =
          grads[static_cast<size_t>(r)];
    }
    for (size_t k = 0; k < model.parts(); ++k) {
      before[k].clear();
      for (size_t i = 0; i < c.params.size(); ++i) before[k].push_back(model.part(k).master(i));
    }
    last = model.step(by_part);
    if (fault_model) fault_model->step(by_part[0]);
  }

  // The model with issue 10 item 1's fault (NO_CLIP updates clipped), stepped beside the
  // model when the case can show it, to name that fault when a NO_CLIP parameter differs.
  std::unique_ptr<hps_ref::EngineModel> fault_model;

  struct Failure {
    std::string key;  // what failed, e.g. "master 3": repeats of a key are only counted
    std::string message;
    int repeats = 0;
  };
  std::mutex mu;
  std::vector<Failure> failures;
  int failure_count = 0;
  bool api_failed = false;
  std::vector<std::vector<hps_comm_t*>> comms;  // per rank, aborted when a rank fails

  void fail(const std::string& key, const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    ++failure_count;
    // A parameter whose master differed already differs in its views: counted, not repeated.
    const std::string view_prefix = "view ";
    if (key.rfind(view_prefix, 0) == 0) {
      for (Failure& f : failures) {
        if (f.key == "master " + key.substr(view_prefix.size())) {
          ++f.repeats;
          return;
        }
      }
    }
    for (Failure& f : failures) {
      if (f.key == key) {
        ++f.repeats;
        return;
      }
    }
    failures.push_back({key, message, 0});
  }

  // An API call failed: nothing more can run in step; every rank's collectives end.
  void api_failure(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mu);
      api_failed = true;
      failures.push_back({"api", message, 0});
      ++failure_count;
      for (auto& rank_comms : comms) {
        for (hps_comm_t* comm : rank_comms) hps_comm_abort(comm);
      }
    }
    barrier.breaks();
  }
};

#define RANK_CALL(call)                                                                 \
  do {                                                                                  \
    const hps_status_t status_ = (call);                                                \
    if (status_ != HPS_STATUS_OK) {                                                     \
      shared.api_failure("rank " + std::to_string(rank) + ": " #call " failed: " +      \
                         hps_status_string(status_) + ": " + hps_last_error_message()); \
      return;                                                                           \
    }                                                                                   \
  } while (0)

#define RANK_SYNC()                          \
  do {                                       \
    if (!shared.barrier.arrive_and_wait()) { \
      return;                                \
    }                                        \
  } while (0)

hps_dtype_t engine_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return HPS_DTYPE_FLOAT32;
    case DType::kFloat16: return HPS_DTYPE_FLOAT16;
    case DType::kBFloat16: return HPS_DTYPE_BFLOAT16;
  }
  return HPS_DTYPE_FLOAT32;
}

uint32_t engine_flags(const hps_ref::Param& p) {
  uint32_t f = 0;
  if (!p.trainable) f |= HPS_PARAM_FROZEN;
  if (p.is_distributed) f |= HPS_PARAM_DISTRIBUTED;
  if (!p.need_clip) f |= HPS_PARAM_NO_CLIP;
  if (p.shared_not_first) f |= HPS_PARAM_SHARED_NOT_FIRST;
  if (!p.weight_decay) f |= HPS_PARAM_NO_WEIGHT_DECAY;
  return f;
}

double read_view(DType t, const void* data, size_t e) {
  if (t == DType::kFloat32) return static_cast<const float*>(data)[e];
  return hps_ref::from_bits(t, static_cast<const uint16_t*>(data)[e]);
}

void write_view(DType t, void* data, size_t e, double x) {  // x: a value of the dtype
  if (t == DType::kFloat32) {
    static_cast<float*>(data)[e] = static_cast<float>(x);
  } else {
    static_cast<uint16_t*>(data)[e] = hps_ref::to_bits(t, x);
  }
}

bool same_value(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

std::string number(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

// How values an engine shows for parameter i compare with a model: elements beyond the
// model's bound (for a view of an fp16/bf16 parameter, plus one spacing of the dtype) and
// the worst of them.
struct Comparison {
  size_t bad = 0;
  size_t worst = 0;
  std::vector<double> update_ratios;  // engine update / model update where they differ
};

Comparison compare(const hps_ref::EngineModel& model, size_t i, const std::vector<double>& got,
                   bool is_view, const std::vector<double>* before) {
  const hps_ref::Param& p = model.params()[i];
  const std::vector<double>& expect = model.master(i);
  const std::vector<double> bound = model.error_bound(i);
  Comparison r;
  double worst_excess = -1;
  for (size_t e = 0; e < expect.size(); ++e) {
    double allowed = bound[e];
    if (is_view && p.dtype != DType::kFloat32) {
      allowed += hps_ref::ulp(p.dtype, std::fabs(expect[e]) + bound[e]);
    }
    const double diff = std::fabs(got[e] - expect[e]);
    if (diff <= allowed) continue;
    ++r.bad;
    const double excess = std::isnan(diff) ? INFINITY : diff - allowed;
    if (excess > worst_excess) worst_excess = excess, r.worst = e;
    if (before != nullptr && expect[e] != (*before)[e]) {
      r.update_ratios.push_back((got[e] - (*before)[e]) / (expect[e] - (*before)[e]));
    }
  }
  return r;
}

// Names a known fault when the engine's values match the model of it.
std::string known_fault(const Shared& shared, size_t i, const std::vector<double>& got,
                        bool is_view) {
  if (shared.fault_model == nullptr || shared.c.params[i].need_clip) return "";
  if (compare(*shared.fault_model, i, got, is_view, nullptr).bad > 0) return "";
  return " — it matches the model of issue 10 item 1's fault: this NO_CLIP parameter's updates "
         "were multiplied by the clip coefficient";
}

// What the framework reads from parameter i's view equals the model's visible parameter.
void check_view(Shared& shared, int rank, const std::string& where, size_t i, const void* view) {
  const hps_ref::Param& p = shared.c.params[i];
  std::vector<double> got(p.numel());
  for (size_t e = 0; e < got.size(); ++e) got[e] = read_view(p.dtype, view, e);
  const hps_ref::EngineModel& model = shared.model_of(rank);
  const Comparison r = compare(model, i, got, true, nullptr);
  if (r.bad == 0) return;
  const size_t w = r.worst;
  const double before = shared.before_of(rank).empty() ? NAN : shared.before_of(rank)[i][w];
  shared.fail(
      "view " + std::to_string(i),
      where + " rank " + std::to_string(rank) + ": the view of param " + std::to_string(i) + " '" +
          p.name + "' [" + flags_text(p) + "] differs from the model in " + std::to_string(r.bad) +
          " of " + std::to_string(got.size()) + " elements; worst [" + std::to_string(w) +
          "]: view " + number(got[w]) + ", model " + number(model.master(i)[w]) + " (bound " +
          number(model.error_bound(i)[w]) + "), model before the last step " + number(before) +
          (same_value(got[w], hps_ref::round_to(p.dtype, before)) ? " — the view is stale" : "") +
          known_fault(shared, i, got, true));
}

// The master of parameter i (gathered) against the model after a step; when they differ,
// how the engine's update compares with the model's, to name the cause.
void check_master(Shared& shared, int rank, int step, size_t i, const std::vector<float>& full) {
  const hps_ref::Param& p = shared.c.params[i];
  const std::vector<double> got(full.begin(), full.end());
  const hps_ref::EngineModel& model = shared.model_of(rank);
  const std::vector<std::vector<double>>& before = shared.before_of(rank);
  Comparison r = compare(model, i, got, false, &before[i]);
  if (r.bad == 0) return;
  const size_t w = r.worst;
  std::ostringstream s;
  s.precision(9);
  s << "after step " << step << " rank " << rank << " (part " << shared.c.part_of(rank)
    << "): param " << i << " '" << p.name << "' [" << flags_text(p) << ", " << p.numel()
    << " elements, unit " << p.unit << "] differs from the model in " << r.bad
    << " elements; worst [" << w << "]: engine " << got[w] << ", model " << model.master(i)[w]
    << " (bound " << model.error_bound(i)[w] << "), before the model's last step " << before[i][w];
  if (!r.update_ratios.empty()) {
    std::vector<double>& q = r.update_ratios;
    std::nth_element(q.begin(), q.begin() + static_cast<long>(q.size() / 2), q.end());
    s << "; engine update / model update over the last step (median over those elements) = "
      << q[q.size() / 2];
  }
  const hps_ref::StepResult& last = shared.last_of(rank);
  if (last.skipped) s << "; the model skipped that step (a non-finite gradient)";
  if (shared.c.options.clip_max_norm > 0) {
    s << "; clip norm " << last.norm << ", coefficient " << last.coefficient;
  }
  s << known_fault(shared, i, got, false);
  shared.fail("master " + std::to_string(i), s.str());
}

void run_rank(Shared& shared, int rank) {
  const Case& c = shared.c;
  const hps_ref::Options& o = c.options;
  const int micro = o.accumulation_steps;
  hps_store_t* store = nullptr;
  hps_comm_t* world = nullptr;
  hps_topology_t* topology = nullptr;
  hps_hybrid_group_t* group = nullptr;
  hps_comm_t* sharding = nullptr;
  hps_comm_t* dp = nullptr;
  hps_comm_t* mp = nullptr;
  hps_comm_t* pp = nullptr;
  hps_engine_t* engine = nullptr;
  hps_comm_t* state_group = nullptr;  // the part's sharding x dp ranks (checkpoints)
  hps_checkpoint_t* checkpoint = nullptr;
  struct Cleanup {
    Shared& shared;
    int rank;
    hps_store_t*& store;
    hps_comm_t*& world;
    hps_topology_t*& topology;
    hps_hybrid_group_t*& group;
    hps_comm_t*& sharding;
    hps_comm_t*& dp;
    hps_comm_t*& mp;
    hps_comm_t*& pp;
    hps_engine_t*& engine;
    hps_comm_t*& state_group;
    hps_checkpoint_t*& checkpoint;
    ~Cleanup() {
      hps_checkpoint_destroy(checkpoint);
      hps_engine_destroy(engine);
      hps_comm_destroy(state_group);
      {
        std::lock_guard<std::mutex> lock(shared.mu);
        shared.comms[static_cast<size_t>(rank)].clear();
      }
      hps_comm_destroy(pp);
      hps_comm_destroy(mp);
      hps_comm_destroy(dp);
      hps_comm_destroy(sharding);
      hps_hybrid_group_destroy(group);
      hps_topology_destroy(topology);
      hps_comm_destroy(world);
      hps_store_destroy(store);
    }
  } cleanup{shared, rank, store, world,  topology,    group,     sharding,
            dp,     mp,   pp,    engine, state_group, checkpoint};

  RANK_CALL(hps_store_open(shared.store_url.c_str(), rank, 60000, &store));
  hps_comm_options_t comm_options;
  RANK_CALL(hps_comm_options_init(&comm_options, sizeof comm_options));
  comm_options.timeout_ms = 60000;
  RANK_CALL(hps_comm_create(store, rank, shared.world, HPS_DEVICE_CPU, 0, &comm_options, &world));
  RANK_CALL(hps_topology_create(c.dp, c.pp, c.sharding, 1, c.mp, nullptr, shared.world, &topology));
  RANK_CALL(hps_hybrid_group_create(world, topology, &group));
  RANK_CALL(hps_hybrid_group_comm(group, HPS_GROUP_SHARDING, &sharding));
  RANK_CALL(hps_hybrid_group_comm(group, HPS_GROUP_DP, &dp));
  RANK_CALL(hps_hybrid_group_comm(group, HPS_GROUP_MP, &mp));
  RANK_CALL(hps_hybrid_group_comm(group, HPS_GROUP_PP, &pp));
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    shared.comms[static_cast<size_t>(rank)] = {world, sharding, dp, mp, pp};
  }
  const int part = c.part_of(rank);
  const int replica = c.replica_of(rank);

  hps_engine_options_t eo;
  RANK_CALL(hps_engine_options_init(&eo, sizeof eo));
  eo.stage = c.stage;
  eo.optimizer = o.optimizer == hps_ref::Optimizer::kSgd ? HPS_OPTIMIZER_SGD : HPS_OPTIMIZER_ADAMW;
  eo.learning_rate = static_cast<float>(o.learning_rate);
  eo.momentum = static_cast<float>(o.momentum);
  eo.weight_decay = static_cast<float>(o.weight_decay);
  eo.nesterov = o.nesterov ? 1 : 0;
  eo.beta1 = static_cast<float>(o.beta1);
  eo.beta2 = static_cast<float>(o.beta2);
  eo.epsilon = static_cast<float>(o.epsilon);
  eo.clip_max_norm = o.clip_max_norm;
  eo.deterministic_clip = c.deterministic_clip ? 1 : 0;
  eo.accumulation_steps = micro;
  if (c.alignment_bytes != 0) eo.alignment_bytes = c.alignment_bytes;
  eo.prefetch_window = c.prefetch_window;
  eo.dynamic_loss_scaling = o.dynamic_loss_scaling ? 1 : 0;
  eo.initial_loss_scale = static_cast<float>(o.initial_loss_scale);
  eo.growth_factor = static_cast<float>(o.growth_factor);
  eo.backoff_factor = static_cast<float>(o.backoff_factor);
  eo.growth_interval = o.growth_interval;
  const bool with_dp = c.dp > 1 || c.pass_dp_comm;
  RANK_CALL(hps_engine_create(sharding, with_dp ? dp : nullptr, &eo, &engine));
  if (c.parts() > 1 || c.pass_mp_groups) {
    RANK_CALL(hps_engine_set_model_parallel_groups(engine,
                                                   c.mp > 1 || c.pass_mp_groups ? mp : nullptr,
                                                   c.pp > 1 || c.pass_mp_groups ? pp : nullptr));
  }

  for (size_t i = 0; i < c.params.size(); ++i) {
    const hps_ref::Param& p = c.params[i];
    size_t index = 0;
    RANK_CALL(hps_engine_add_param(engine, p.name.c_str(), p.shape.data(), p.shape.size(),
                                   engine_dtype(p.dtype), engine_flags(p), p.unit, &index));
    if (index != i) {
      shared.api_failure("rank " + std::to_string(rank) + ": param " + std::to_string(i) +
                         " got index " + std::to_string(index));
      return;
    }
  }
  RANK_CALL(hps_engine_seal(engine));
  // The first replica of each part writes the part's initial values; the others write
  // something else, which the broadcast must replace (over the sharding and the dp group).
  // (A resumed engine's values come from the checkpoint: it broadcasts its zeros.)
  const std::vector<std::vector<double>>& initial = c.part_initial[static_cast<size_t>(part)];
  for (size_t i = 0; i < c.params.size() && !shared.phase.load; ++i) {
    void* view = nullptr;
    RANK_CALL(hps_engine_param(engine, i, &view));
    const DType t = c.params[i].dtype;
    for (size_t e = 0; e < initial[i].size(); ++e) {
      write_view(t, view, e,
                 replica == 0
                     ? initial[i][e]
                     : hps_ref::round_to(t, 0.5 + rank + 0.25 * static_cast<double>(e % 3)));
    }
  }
  RANK_CALL(hps_engine_broadcast_parameters(engine));

  // Checkpoints: each part under a root of its own, written by its sharding x dp ranks.
  const Phase& phase = shared.phase;
  if (phase.load || phase.save) {
    for (int k = 0; k < c.parts(); ++k) {
      std::vector<int32_t> members;
      for (int r = 0; r < shared.world; ++r) {
        if (c.part_of(r) == k) members.push_back(r);
      }
      std::sort(members.begin(), members.end(),
                [&](int32_t a, int32_t b) { return c.replica_of(a) < c.replica_of(b); });
      hps_comm_t* split = nullptr;
      RANK_CALL(hps_comm_split(world, members.data(), members.size(), "state", &split));
      if (split != nullptr) state_group = split;
    }
    const std::string root = phase.root + "/part" + std::to_string(part);
    RANK_CALL(hps_checkpoint_create(engine, state_group, root.c_str(), nullptr, &checkpoint));
  }
  if (phase.load) {
    RANK_CALL(hps_checkpoint_load(checkpoint, "resume", nullptr));
    char text[32] = {};
    size_t length = 0;
    RANK_CALL(hps_checkpoint_metadata(checkpoint, "step", text, sizeof text, &length));
    if (std::string(text, length) != std::to_string(c.save_after)) {
      shared.fail("metadata", "rank " + std::to_string(rank) +
                                  ": the checkpoint's metadata step '" + std::string(text, length) +
                                  "', saved after step " + std::to_string(c.save_after));
    }
  }

  // Units in forward order, and their parameters.
  std::vector<std::vector<size_t>> unit_params(c.forward_order.size());
  for (size_t k = 0; k < c.forward_order.size(); ++k) {
    for (size_t i = 0; i < c.params.size(); ++i) {
      if (c.params[i].unit == c.forward_order[k]) unit_params[k].push_back(i);
    }
  }
  std::vector<std::vector<double>> written(c.params.size());  // the gradient views' contents
  const float* scale_ptr = nullptr;
  const int64_t* skipped_ptr = nullptr;
  RANK_CALL(hps_engine_loss_scale(engine, &scale_ptr, &skipped_ptr));
  int engine_steps = 0;             // steps this engine took (a resumed one starts anew)
  const float* norm_ptr = nullptr;  // with clipping: the last step's gradient norm
  if (o.clip_max_norm > 0) {
    RANK_CALL(hps_engine_grad_norm(engine, &norm_ptr));
  } else if (hps_engine_grad_norm(engine, &norm_ptr) != HPS_STATUS_FAILED_PRECONDITION) {
    shared.fail("gradient norm", "rank " + std::to_string(rank) +
                                     ": hps_engine_grad_norm without clipping did not refuse");
  }

  // One forward pass: each unit's parameters gathered, read (checked), released.
  auto forward = [&](const std::string& where) -> bool {
    auto failed = [&](const char* what, hps_status_t status) {
      shared.api_failure("rank " + std::to_string(rank) + ": " + where + " forward: " + what +
                         " failed: " + hps_status_string(status) + ": " + hps_last_error_message());
      return false;
    };
    for (size_t k = 0; k < c.forward_order.size(); ++k) {
      hps_status_t status = hps_engine_wait_parameters(engine, c.forward_order[k]);
      if (status != HPS_STATUS_OK) return failed("hps_engine_wait_parameters", status);
      for (size_t i : unit_params[k]) {
        void* view = nullptr;
        status = hps_engine_param(engine, i, &view);
        if (status != HPS_STATUS_OK) return failed("hps_engine_param", status);
        check_view(shared, rank, where + " forward", i, view);
      }
      status = hps_engine_release_parameters(engine, c.forward_order[k]);
      if (status != HPS_STATUS_OK) return failed("hps_engine_release_parameters", status);
    }
    return true;
  };
  const hps_ref::EngineModel& model = shared.model_of(rank);
  auto check_scale = [&](const std::string& where) {
    const double expect_scale = model.loss_scale();
    if (static_cast<double>(*scale_ptr) != expect_scale || *skipped_ptr != model.skipped_steps()) {
      shared.fail("loss scale",
                  where + " rank " + std::to_string(rank) + ": loss scale " + number(*scale_ptr) +
                      ", skipped steps " + std::to_string(*skipped_ptr) + "; the model: " +
                      number(expect_scale) + ", " + std::to_string(model.skipped_steps()));
    }
    // The norm of the model's latest step (none before the first: 0).
    if (norm_ptr == nullptr) return;
    const double norm = static_cast<double>(*norm_ptr);
    const hps_ref::StepResult* last = engine_steps > 0 ? &shared.last_of(rank) : nullptr;
    bool ok = false;
    std::string expected;
    if (last == nullptr) {
      ok = norm == 0.0;
      expected = "0 before the first step";
    } else if (last->skipped) {
      // The model has no norm for a step it skipped. The engine's is that of the step's
      // gradients, and the injections here put a non-finite value into one replica of a
      // replicated parameter, which real replicas never hold: not compared.
      ok = true;
    } else {
      const double bound = last->norm_error + std::ldexp(last->norm, -22);
      ok = std::fabs(norm - last->norm) <= bound;
      expected = number(last->norm) + " within " + number(bound);
    }
    if (!ok) {
      shared.fail("gradient norm", where + " rank " + std::to_string(rank) +
                                       ": hps_engine_grad_norm " + number(norm) +
                                       "; the model: " + expected);
    }
  };

  auto gather_and_check = [&](int step) {
    std::vector<float> full;
    for (size_t i = 0; i < c.params.size(); ++i) {
      full.assign(c.params[i].numel(), NAN);
      const hps_status_t status = hps_engine_gather_parameter(engine, i, full.data(), full.size());
      if (status != HPS_STATUS_OK) {
        shared.api_failure("rank " + std::to_string(rank) + ": hps_engine_gather_parameter(" +
                           std::to_string(i) + ") failed: " + hps_status_string(status) + ": " +
                           hps_last_error_message());
        return false;
      }
      check_master(shared, rank, step, i, full);
    }
    return true;
  };

  for (int step = phase.first_step; step < phase.end_step; ++step) {
    auto& my_grads = shared.grads[static_cast<size_t>(rank)];
    my_grads.assign(static_cast<size_t>(micro), std::vector<std::vector<double>>(c.params.size()));
    for (auto& w : written) w.clear();
    for (int mb = 0; mb < micro; ++mb) {
      const std::string where =
          "step " + std::to_string(step) + " micro-batch " + std::to_string(mb);
      // Stage 3 holds full gradients only while a micro-batch's bucket is open: each
      // micro-batch's view starts at zero and is reduce-scattered into the shard when its
      // bucket checks in (hpshard.h, hps_engine_grad); stage 2 keeps adding into one view.
      if (c.stage == 3) {
        for (auto& w : written) w.clear();
      }
      if (!forward(where)) return;
      for (size_t k = c.forward_order.size(); k-- > 0;) {
        const int32_t unit = c.forward_order[k];
        RANK_CALL(hps_engine_wait_parameters(engine, unit));
        if (k + 1 == c.forward_order.size() && mb == 0) check_scale(where);
        const double scale = static_cast<double>(*scale_ptr);
        for (size_t i : unit_params[k]) {
          const hps_ref::Param& p = c.params[i];
          void* view = nullptr;
          RANK_CALL(hps_engine_param(engine, i, &view));
          check_view(shared, rank, where + " backward", i, view);
          if (!p.trainable) continue;
          void* grad = nullptr;
          RANK_CALL(hps_engine_grad(engine, i, &grad));
          const size_t n = p.numel();
          std::vector<double>& w = written[i];
          if (w.empty()) w.assign(n, 0.0);
          std::vector<double>& g = my_grads[static_cast<size_t>(mb)][i];
          g.resize(n);
          // The replicas of a part compute their own gradients; a DISTRIBUTED parameter's
          // differ across mp too, the others are the same on every mp rank (replicated).
          const uint64_t source = static_cast<uint64_t>(
              replica + o.ranks * (c.part_of(rank) - (p.is_distributed ? 0 : c.mp_of(rank))));
          size_t unexpected = 0, zeros = 0, first = 0;
          double first_held = 0, first_expected = 0;
          for (size_t e = 0; e < n; ++e) {
            const double x = read_view(p.dtype, view, e);
            // The gradient of a convex quadratic loss a/2·p² + b·p: a in [0, 1).
            const double a = 0.5 * (1.0 + hashed(c.seed, 1, source, i, e, 0));
            const double b =
                hashed(c.seed, 2, source, i, e, static_cast<uint64_t>(step * micro + mb));
            g[e] = c.grad_scale[i] * (a * x + b);
            for (const Injection& in : c.injections) {
              if (in.step == step && in.rank == rank && in.micro == mb && in.param == i &&
                  in.element == e) {
                g[e] = in.value;
              }
            }
            // The framework adds into whatever the view holds; the documentation says that
            // is what it added earlier in the step (stage 2) or in the micro-batch (stage 3).
            const double held = read_view(p.dtype, grad, e);
            if (!same_value(held, w[e])) {
              if (unexpected++ == 0) {
                first = e;
                first_held = held;
                first_expected = w[e];
              }
              if (held == 0) ++zeros;
            }
            w[e] = hps_ref::EngineModel::framework_accumulate(p.dtype, w[e], scale, g[e]);
            write_view(p.dtype, grad, e,
                       hps_ref::EngineModel::framework_accumulate(p.dtype, held, scale, g[e]));
          }
          if (unexpected > 0) {
            std::string what = "held " + number(first_held) + " at [" + std::to_string(first) +
                               "] (and " + std::to_string(unexpected - 1) +
                               " more elements) where the framework had added " +
                               (mb == 0 ? std::string("nothing yet this step")
                                        : number(first_expected) + " in the earlier micro-batches");
            if (mb > 0 && zeros == unexpected && c.stage == 2) {
              what +=
                  ": the view was zero again at this micro-batch, what the earlier ones added "
                  "is gone from it (the engine reduced them already)";
            }
            shared.fail("gradient view", where + " rank " + std::to_string(rank) +
                                             ": the gradient view of param " + std::to_string(i) +
                                             " '" + p.name + "' " + what);
          }
          RANK_CALL(hps_engine_grad_ready(engine, i, nullptr));
        }
        RANK_CALL(hps_engine_release_parameters(engine, unit));
      }
    }
    RANK_CALL(hps_engine_step(engine));
    ++engine_steps;

    RANK_SYNC();  // every rank's gradients are in
    if (rank == 0) shared.step_model();
    RANK_SYNC();  // the model has stepped

    // Gathering blocks until the step is done: only on some steps, so that the next forward
    // also meets all-gathers still in flight.
    if (c.gather_after[static_cast<size_t>(step)]) {
      if (!gather_and_check(step)) return;
    }
  }
  // The views after the last step, and the loss scale; then the masters.
  if (!forward("after the last step")) return;
  check_scale("after the last step");
  const int last = phase.end_step - 1;
  if (!c.gather_after[static_cast<size_t>(last)] && !gather_and_check(last)) return;
  RANK_CALL(hps_engine_synchronize(engine));
  if (phase.save) {
    const std::string step_text = std::to_string(last);
    const char* key = "step";
    const char* value = step_text.c_str();
    hps_work_t* work = nullptr;
    RANK_CALL(hps_checkpoint_save(checkpoint, "resume", &key, &value, 1, &work));
    const hps_status_t saved = hps_work_wait(work);
    hps_work_destroy(work);
    RANK_CALL(saved);
  }
  RANK_SYNC();
}

// Issue 10's example: two ranks, SGD with lr 1, max_norm 1; `a` (clipped) gets the mean
// gradient [3, 4] and `b` (NO_CLIP) [1, 1], both in one unit (one flat buffer). After one step
// a = -[3, 4] / 5 and b = -[1, 1]: b's update is not scaled by the clip coefficient.
void issue10_example(int stage, std::vector<float>* a_out, std::vector<float>* b_out) {
  const std::string url = "memory://engine_reference_issue10_stage" + std::to_string(stage);
  std::mutex mu;
  std::vector<std::string> errors;
  auto rank_main = [&](int rank) {
    hps_store_t* store = nullptr;
    hps_comm_t* comm = nullptr;
    hps_engine_t* engine = nullptr;
    bool last_step = false;
    auto check = [&](hps_status_t status, const char* what) {
      if (status == HPS_STATUS_OK) return true;
      if (last_step && status == HPS_STATUS_ABORTED &&
          std::string(hps_last_error_message()).find("rank 1") != std::string::npos) {
        return false;  // the peer's leaving, seen by the time this call came
      }
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back("rank " + std::to_string(rank) + ": " + what + ": " +
                       hps_status_string(status) + ": " + hps_last_error_message());
      return false;
    };
    const int64_t shape[] = {2};
    size_t a = 0, b = 0;
    hps_engine_options_t o;
    void* view = nullptr;
    float* grad = nullptr;
    const float grads[2][2][2] = {{{2, 5}, {0, 2}}, {{4, 3}, {2, 0}}};  // [rank][param][element]
    bool ok = check(hps_store_open(url.c_str(), rank, 30000, &store), "store") &&
              check(hps_comm_create(store, rank, 2, HPS_DEVICE_CPU, 0, nullptr, &comm), "comm") &&
              check(hps_engine_options_init(&o, sizeof o), "options");
    if (ok) {
      o.stage = stage;
      o.learning_rate = 1.0f;
      o.clip_max_norm = 1.0;
      ok = check(hps_engine_create(comm, nullptr, &o, &engine), "create") &&
           check(hps_engine_add_param(engine, "a", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &a), "a") &&
           check(hps_engine_add_param(engine, "b", shape, 1, HPS_DTYPE_FLOAT32, HPS_PARAM_NO_CLIP,
                                      0, &b),
                 "b") &&
           check(hps_engine_seal(engine), "seal") &&
           check(hps_engine_broadcast_parameters(engine), "broadcast") &&  // zeros
           check(hps_engine_wait_parameters(engine, 0), "wait (forward)") &&
           check(hps_engine_release_parameters(engine, 0), "release (forward)") &&
           check(hps_engine_wait_parameters(engine, 0), "wait (backward)");
    }
    for (size_t i : {a, b}) {
      ok = ok && check(hps_engine_param(engine, i, &view), "param") &&
           check(hps_engine_grad(engine, i, reinterpret_cast<void**>(&grad)), "grad");
      if (ok) {
        grad[0] = grads[rank][i][0];
        grad[1] = grads[rank][i][1];
        ok = check(hps_engine_grad_ready(engine, i, nullptr), "grad_ready");
      }
    }
    ok = ok && check(hps_engine_release_parameters(engine, 0), "release (backward)") &&
         check(hps_engine_step(engine), "step") &&
         check(hps_engine_gather_parameter(engine, a, a_out->data(), 2), "gather a") &&
         check(hps_engine_gather_parameter(engine, b, b_out->data(), 2), "gather b") &&
         check(hps_engine_synchronize(engine), "synchronize");
    if (!ok) hps_comm_abort(comm);
    hps_engine_destroy(engine);
    hps_comm_destroy(comm);
    hps_store_destroy(store);
  };
  a_out->assign(2, NAN);
  b_out->assign(2, NAN);
  std::thread r1(rank_main, 1);
  rank_main(0);
  r1.join();
  for (const std::string& e : errors) ADD_FAILURE() << e;
}

class Issue10Example : public ::testing::TestWithParam<int> {};

TEST_P(Issue10Example, NoClipParameterIsNotScaledByTheClipCoefficient) {
  std::vector<float> a, b;
  issue10_example(GetParam(), &a, &b);
  const double coef = 1.0 / (5.0 + 1e-6);  // max_norm / (max(norm, max_norm) + 1e-6)
  EXPECT_NEAR(a[0], -3 * coef, 1e-6) << "the clipped parameter a";
  EXPECT_NEAR(a[1], -4 * coef, 1e-6) << "the clipped parameter a";
  EXPECT_NEAR(b[0], -1.0, 1e-6) << "the NO_CLIP parameter b: its update must not be clipped "
                                   "(issue 10 item 1: -0.2 is the update times the coefficient)";
  EXPECT_NEAR(b[1], -1.0, 1e-6) << "the NO_CLIP parameter b: its update must not be clipped "
                                   "(issue 10 item 1: -0.2 is the update times the coefficient)";
}

INSTANTIATE_TEST_SUITE_P(Stages, Issue10Example, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& stage_info) {
                           return "stage" + std::to_string(stage_info.param);
                         });

// Uneven data: rank 1 leaves after its last batch (destroying its engine and communicator),
// rank 0 steps once more, and that step's collectives fail where nothing waits for them
// (no host sync in the step). hps_engine_destroy returned OK for an engine without views,
// so a C program ended as a success with the step's update missing (process red team); it
// returns the failure now. Rank 1's own destroy, after complete work, returns OK. Where
// rank 1 has left before rank 0's last step is called (a loaded machine), a call of that
// step may already refuse, ABORTED naming rank 1: the destroy returns the failure all the
// same.
class DestroyAfterAPeerLeft : public ::testing::TestWithParam<int> {};

TEST_P(DestroyAfterAPeerLeft, ReturnsTheFailureOfTheWorkInFlight) {
  const int stage = GetParam();
  const std::string url = "memory://engine_reference_destroy_stage" + std::to_string(stage);
  hps_status_t destroyed[2] = {HPS_STATUS_INTERNAL, HPS_STATUS_INTERNAL};
  std::string message[2];
  std::mutex mu;
  std::vector<std::string> errors;
  auto rank_main = [&](int rank) {
    hps_store_t* store = nullptr;
    hps_comm_t* comm = nullptr;
    hps_engine_t* engine = nullptr;
    bool last_step = false;
    auto check = [&](hps_status_t status, const char* what) {
      if (status == HPS_STATUS_OK) return true;
      if (last_step && status == HPS_STATUS_ABORTED &&
          std::string(hps_last_error_message()).find("rank 1") != std::string::npos) {
        return false;  // the peer's leaving, seen by the time this call came
      }
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back("rank " + std::to_string(rank) + ": " + what + ": " +
                       hps_status_string(status) + ": " + hps_last_error_message());
      return false;
    };
    const int64_t shape[] = {64};
    size_t w = 0;
    hps_engine_options_t o;
    bool ok = check(hps_store_open(url.c_str(), rank, 30000, &store), "store") &&
              check(hps_comm_create(store, rank, 2, HPS_DEVICE_CPU, 0, nullptr, &comm), "comm") &&
              check(hps_engine_options_init(&o, sizeof o), "options");
    if (ok) {
      o.stage = stage;
      ok = check(hps_engine_create(comm, nullptr, &o, &engine), "create") &&
           check(hps_engine_add_param(engine, "w", shape, 1, HPS_DTYPE_FLOAT32, 0, 0, &w), "w") &&
           check(hps_engine_seal(engine), "seal") &&
           check(hps_engine_broadcast_parameters(engine), "broadcast");
    }
    for (int step = 0; ok && step < (rank == 0 ? 2 : 1); ++step) {
      last_step = rank == 0 && step == 1;
      float* grad = nullptr;
      ok = check(hps_engine_wait_parameters(engine, 0), "wait") &&
           check(hps_engine_grad(engine, w, reinterpret_cast<void**>(&grad)), "grad");
      if (ok) {
        std::fill(grad, grad + 64, 1.0f);
        ok = check(hps_engine_grad_ready(engine, w, nullptr), "grad_ready") &&
             check(hps_engine_release_parameters(engine, 0), "release") &&
             check(hps_engine_step(engine), "step");
      }
    }
    destroyed[rank] = hps_engine_destroy(engine);
    message[rank] = hps_last_error_message();
    hps_comm_destroy(comm);
    hps_store_destroy(store);
  };
  std::thread r1(rank_main, 1);
  rank_main(0);
  r1.join();
  for (const std::string& e : errors) ADD_FAILURE() << e;
  EXPECT_EQ(destroyed[1], HPS_STATUS_OK) << message[1];
  EXPECT_EQ(destroyed[0], HPS_STATUS_ABORTED) << message[0];
  EXPECT_NE(message[0].find("rank 1"), std::string::npos) << message[0];
}

INSTANTIATE_TEST_SUITE_P(Stages, DestroyAfterAPeerLeft, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& stage_info) {
                           return "stage" + std::to_string(stage_info.param);
                         });

// ---------------------------------------------------------------------------------------
// The model itself, on cases worked out by hand.

TEST(EngineModel, RoundsAndEncodesLikeIeee) {
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    for (uint32_t bits = 0; bits < 0x10000; ++bits) {
      const double x = hps_ref::from_bits(t, static_cast<uint16_t>(bits));
      if (std::isnan(x)) continue;
      ASSERT_EQ(hps_ref::round_to(t, x), x) << hps_ref::dtype_name(t) << " " << bits;
      ASSERT_EQ(hps_ref::to_bits(t, x), bits) << hps_ref::dtype_name(t) << " " << bits;
    }
  }
  using hps_ref::round_to;
  EXPECT_EQ(hps_ref::from_bits(DType::kFloat16, 0x3C00), 1.0);
  EXPECT_EQ(hps_ref::from_bits(DType::kFloat16, 0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(hps_ref::from_bits(DType::kBFloat16, 0x3F80), 1.0);
  // Ties go to the even neighbour; half a spacing above the largest finite value is inf.
  EXPECT_EQ(round_to(DType::kFloat16, 1.0 + std::ldexp(1.0, -11)), 1.0);
  EXPECT_EQ(round_to(DType::kFloat16, 1.0 + 3 * std::ldexp(1.0, -11)), 1.0 + std::ldexp(1.0, -9));
  EXPECT_EQ(round_to(DType::kBFloat16, 1.0 + std::ldexp(1.0, -8)), 1.0);
  EXPECT_EQ(round_to(DType::kFloat16, 65519.99), 65504.0);
  EXPECT_TRUE(std::isinf(round_to(DType::kFloat16, 65520.0)));
  EXPECT_EQ(round_to(DType::kFloat16, std::ldexp(1.0, -25)), 0.0);  // a tie with zero
  EXPECT_EQ(round_to(DType::kFloat16, std::ldexp(3.0, -26)), std::ldexp(1.0, -24));
  Rng rng(7);
  for (int k = 0; k < 10000; ++k) {
    const double x = std::ldexp(rng.uniform(-1.0, 1.0), rng.integer(-140, 127));
    ASSERT_EQ(round_to(DType::kFloat32, x), static_cast<double>(static_cast<float>(x))) << x;
  }
}

// torch.optim.SGD with momentum 0.9, lr 0.1 and the gradient 1 three times: the buffer is the
// gradient on the first step, then 1.9, 2.71; with nesterov the step is g + 0.9·buf.
TEST(EngineModel, SgdFollowsTorch) {
  for (bool nesterov : {false, true}) {
    hps_ref::Options o;
    o.learning_rate = 0.1;
    o.momentum = 0.9;
    o.nesterov = nesterov;
    hps_ref::EngineModel m({{"p", {1}}}, o, {{0.0}});
    for (int k = 0; k < 3; ++k) m.step({{{{1.0}}}});
    const double expect = nesterov ? -0.1 * ((1 + 0.9) + (1 + 0.9 * 1.9) + (1 + 0.9 * 2.71))
                                   : -0.1 * (1 + 1.9 + 2.71);
    EXPECT_NEAR(m.master(0)[0], expect, 1e-15) << (nesterov ? "nesterov" : "momentum");
  }
}

// torch.optim.AdamW: a constant gradient gives m̂/sqrt(v̂) = 1 on every applied step when the
// bias corrections count applied steps only (a skipped step in between counted would give
// 0.858 on the next); decoupled weight decay multiplies p by 1 − lr·wd first. The loss scale
// grows after each good step and halves on the skipped one.
TEST(EngineModel, AdamWCountsAppliedStepsAndLossScaleFollowsGradScaler) {
  hps_ref::Options o;
  o.optimizer = hps_ref::Optimizer::kAdamW;
  o.learning_rate = 0.1;
  o.epsilon = 0;
  o.weight_decay = 0.5;
  o.dynamic_loss_scaling = true;
  o.initial_loss_scale = 8;
  o.growth_interval = 1;
  hps_ref::EngineModel m({{"p", {1}}}, o, {{1.0}});
  EXPECT_FALSE(m.step({{{{1.0}}}}).skipped);
  EXPECT_DOUBLE_EQ(m.master(0)[0], 1.0 * 0.95 - 0.1);
  EXPECT_EQ(m.loss_scale(), 16);
  EXPECT_TRUE(m.step({{{{INFINITY}}}}).skipped);
  EXPECT_DOUBLE_EQ(m.master(0)[0], 0.85);
  EXPECT_EQ(m.loss_scale(), 8);
  EXPECT_EQ(m.skipped_steps(), 1);
  EXPECT_FALSE(m.step({{{{1.0}}}}).skipped);
  EXPECT_NEAR(m.master(0)[0], 0.85 * 0.95 - 0.1, 1e-12);
  EXPECT_EQ(m.applied_steps(), 2);
  EXPECT_EQ(m.loss_scale(), 16);
}

// Issue 10's example in the model: the mean of two ranks' gradients, a clipped and b not.
TEST(EngineModel, ClipLeavesNoClipParametersAlone) {
  hps_ref::Options o;
  o.learning_rate = 1;
  o.clip_max_norm = 1;
  o.ranks = 2;
  hps_ref::Param a{"a", {2}}, b{"b", {2}};
  b.need_clip = false;
  hps_ref::EngineModel m({a, b}, o, {{0.0, 0.0}, {0.0, 0.0}});
  EXPECT_EQ(m.error_bound(0)[0], 0.0);
  const hps_ref::StepResult r = m.step({{{{2, 5}, {0, 2}}}, {{{4, 3}, {2, 0}}}});
  EXPECT_DOUBLE_EQ(r.norm, 5.0);
  EXPECT_DOUBLE_EQ(m.master(0)[0], -3 / (5 + 1e-6));
  EXPECT_DOUBLE_EQ(m.master(0)[1], -4 / (5 + 1e-6));
  EXPECT_DOUBLE_EQ(m.master(1)[0], -1.0);
  EXPECT_DOUBLE_EQ(m.master(1)[1], -1.0);
  EXPECT_GT(m.error_bound(0)[0], 0.0);
  EXPECT_LT(m.error_bound(0)[0], 1e-4);
}

// A parameter registered with HPS_PARAM_NO_WEIGHT_DECAY is a torch parameter group with
// weight_decay 0: SGD adds no wd·p to its gradient, AdamW does not multiply it by 1 − lr·wd.
TEST(EngineModel, NoWeightDecayParametersAreNotDecayed) {
  hps_ref::Param w{"w", {1}}, b{"b", {1}};
  b.weight_decay = false;
  hps_ref::Options o;
  o.learning_rate = 0.1;
  o.weight_decay = 0.5;
  hps_ref::EngineModel sgd({w, b}, o, {{2.0}, {2.0}});
  sgd.step({{{{1.0}, {1.0}}}});
  EXPECT_DOUBLE_EQ(sgd.master(0)[0], 2.0 - 0.1 * (1.0 + 0.5 * 2.0));
  EXPECT_DOUBLE_EQ(sgd.master(1)[0], 2.0 - 0.1 * 1.0);
  o.optimizer = hps_ref::Optimizer::kAdamW;
  o.epsilon = 0;
  hps_ref::EngineModel adamw({w, b}, o, {{2.0}, {2.0}});
  adamw.step({{{{1.0}, {1.0}}}});
  EXPECT_DOUBLE_EQ(adamw.master(0)[0], 2.0 * 0.95 - 0.1);
  EXPECT_DOUBLE_EQ(adamw.master(1)[0], 2.0 - 0.1);
}

class EngineReference : public ::testing::TestWithParam<uint64_t> {};

// Runs `c`'s ranks over `phase` from `model`; failures are reported naming `text`. Returns the
// model where the phase left it.
hps_ref::HybridModel run_phase(const Case& c, const std::string& text, hps_ref::HybridModel model,
                               Phase phase, bool with_fault_model) {
  static std::atomic<int> run_counter{0};
  Shared shared(
      c,
      "memory://engine_reference_" + std::to_string(c.seed) + "_" + std::to_string(run_counter++),
      std::move(model), std::move(phase));
  if (with_fault_model) {
    hps_ref::Options faulty = c.options;
    faulty.fault_no_clip_scaled = true;
    shared.fault_model = std::make_unique<hps_ref::EngineModel>(c.params, faulty, c.initial);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < shared.world; ++r) threads.emplace_back(run_rank, std::ref(shared), r);
  for (auto& t : threads) t.join();
  if (shared.failure_count > 0) {
    std::string all;
    for (const Shared::Failure& f : shared.failures) {
      all += "\n  " + f.message;
      if (f.repeats > 0)
        all += "\n    (and " + std::to_string(f.repeats) + " more times later or on other ranks)";
    }
    ADD_FAILURE() << "seed " << c.seed << " (re-run alone: HPS_REFERENCE_SEED=" << c.seed
                  << "): " << text << all;
  }
  return std::move(shared.model);
}

TEST_P(EngineReference, MatchesTheFloat64Model) {
  const uint64_t seed = GetParam();
  const Case c = make_case(seed);
  bool no_clip_trained = false;
  for (const auto& p : c.params) no_clip_trained = no_clip_trained || (p.trainable && !p.need_clip);
  hps_ref::HybridModel model(part_models(c), c.mp);
  if (c.save_after < 0) {
    const bool fault_model = c.options.clip_max_norm > 0 && no_clip_trained && c.parts() == 1;
    run_phase(c, describe(c), std::move(model), {0, c.steps, "", false, false}, fault_model);
    return;
  }
  // Saved by one layout, resumed by another: the model knows nothing of either.
  char root_template[] = "/tmp/hps_engine_reference_XXXXXX";
  ASSERT_NE(::mkdtemp(root_template), nullptr);
  const std::string root = root_template;
  const std::string text = describe(c);
  model = run_phase(c, text + " (before the checkpoint)", std::move(model),
                    {0, c.save_after + 1, root, false, true}, false);
  const Case resumed = c.after_resume();
  model.set_ranks(resumed.options.ranks);
  for (size_t i = 0; i < c.params.size(); ++i) model.set_dtype(i, resumed.params[i].dtype);
  if (!::testing::Test::HasFailure()) {
    run_phase(resumed, text + " (after resuming)", std::move(model),
              {c.save_after + 1, c.steps, root, true, false}, false);
  }
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
}

INSTANTIATE_TEST_SUITE_P(Seeds, EngineReference,
                         ::testing::ValuesIn(hps::testing_util::seeds_from_env("HPS_REFERENCE",
                                                                               64)),
                         [](const ::testing::TestParamInfo<uint64_t>& seed_info) {
                           return "seed_" + std::to_string(seed_info.param);
                         });

}  // namespace
