// A float64 model of what a sharded engine step must produce, written from the documented
// semantics (DESIGN.md "Stage 2 and stage 3" and "Hybrid clipping", the engine section of
// hpshard.h and of the README), not from the engines' code, so that a test comparing an
// engine with it can catch the engines' own assumptions. Header-only, standard library only.
//
// What is modelled, per step:
//  - The framework (one per rank, sharding × dp ranks) runs `accumulation_steps`
//    micro-batches and adds each micro-batch's gradient of the scaled loss, loss_scale × g,
//    into the gradient view of the parameter's dtype: view ← round_dtype(view + scale·g),
//    starting from zero at every step (framework_accumulate does exactly this).
//  - Dynamic loss scaling (torch.cuda.amp.GradScaler): a non-finite gradient view on any rank
//    skips the step on every rank (parameters and optimizer state untouched), the scale is
//    multiplied by backoff_factor and the count of good steps restarts; after growth_interval
//    consecutive good steps it is multiplied by growth_factor, unless that would pass the
//    largest float32 (the engine's scale is one; GradScaler keeps a scale that would not be
//    finite).
//  - The gradient is the mean over every rank and micro-batch of the unscaled views:
//    Σ_rank view / (ranks · accumulation_steps · scale). fp16 and bf16 parameters' reduced
//    gradients are rounded once to their dtype.
//  - Global-norm clipping: norm² is the sum of the squared mean gradients of every trainable
//    parameter except need_clip = false and shared_not_first ones (of the whole model when it
//    is cut across mp and pp: HybridModel, at the end; is_distributed only picks the partial);
//    coef = max_norm / (max(norm, max_norm) + 1e-6); gradients of need_clip parameters
//    (shared_not_first included) are multiplied by coef, need_clip = false ones are not.
//  - SGD as torch.optim.SGD (dampening 0): d = g + wd·p (d = g when wd = 0, so an infinite
//    p stays infinite rather than NaN); the momentum buffer is d on the
//    first applied step, then momentum·buf + d; nesterov uses d + momentum·buf;
//    p ← p − lr·(that). AdamW as torch.optim.AdamW: p ← p·(1 − lr·wd); m, v exponential
//    averages; bias corrections 1 − β^t with t counting applied (not skipped) steps;
//    p ← p − lr/(1 − β1^t) · m / (sqrt(v)/sqrt(1 − β2^t) + ε). A parameter registered
//    with HPS_PARAM_NO_WEIGHT_DECAY has wd = 0 (a torch parameter group with weight_decay 0).
//  - Frozen parameters never change and have no gradient. fp16/bf16 parameters are trained
//    on a master copy (initially the parameter's value); the visible parameter is the master
//    rounded to nearest even in the dtype.
//
// Alongside the expected values the model carries a first-order bound, per element, of how
// far an engine that computes in float32 may be from them (error_bound). It starts from the
// relative accuracies in Accuracy: an fp32 reduction of up to ranks × micro-batches terms is
// within a few 2^-24 of the sum of their absolute values (not of the sum: terms may cancel);
// the fp32 clip coefficient within 1e-5 (the README's bound on the chunked fp32 norm) plus
// how far the gradients' errors move the norm; each fp32 operation of the optimizer within
// 2^-24 of its result; for fp16/bf16 parameters four roundings of the dtype of the absolute
// gradients, because the documentation leaves open where the reduced gradient is rounded
// (sum or mean, per micro-batch or per step). These are propagated linearly through the clip,
// the momentum buffer, Adam's moments (|Δ sqrt v| <= min(Δv / 2 sqrt v, sqrt Δv), and the
// quotient m / (sqrt v + ε)) and the parameter, step after step, then multiplied by a safety
// factor for the products of errors a first-order bound leaves out. Since the gradients are
// inputs, an engine's earlier differences do not feed back through them. A view of an
// fp16/bf16 parameter is the master rounded once more: compare it with master() within the
// bound plus one spacing of the dtype (ulp).
//
// Use: build an EngineModel from the parameters, options and initial values; per step,
// collect what each rank's framework computed for each micro-batch (the gradients of the
// unscaled loss; the framework writes framework_accumulate(dtype, view, loss_scale(), g) into
// the engine's gradient view) and call step(); compare the engine's parameters with master()
// or visible() within error_bound(), its loss scale with loss_scale().
#ifndef HPSHARD_TESTS_REFERENCE_ENGINE_MODEL_H_
#define HPSHARD_TESTS_REFERENCE_ENGINE_MODEL_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hps_ref {

enum class DType { kFloat32, kFloat16, kBFloat16 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "?";
}

// The binary format of a dtype: significand bits (with the implicit one), the smallest
// normal exponent and the largest finite value.
struct Format {
  int precision;
  int min_exponent;
  double max_finite;
};

inline Format format_of(DType t) {
  switch (t) {
    case DType::kFloat32: return {24, -126, std::ldexp(2.0 - std::ldexp(1.0, -23), 127)};
    case DType::kFloat16: return {11, -14, 65504.0};
    case DType::kBFloat16: return {8, -126, std::ldexp(2.0 - std::ldexp(1.0, -7), 127)};
  }
  return {53, -1022, std::numeric_limits<double>::max()};
}

// Unit roundoff: half the spacing at 1 (2^-24, 2^-11, 2^-8).
inline double unit_roundoff(DType t) { return std::ldexp(1.0, -format_of(t).precision); }

// The smallest positive (subnormal) value of the dtype.
inline double min_subnormal(DType t) {
  const Format f = format_of(t);
  return std::ldexp(1.0, f.min_exponent - (f.precision - 1));
}

// The spacing of the dtype's values at magnitude |x| (the subnormal spacing below the normals).
inline double ulp(DType t, double x) {
  const Format f = format_of(t);
  x = std::fabs(x);
  int e = 0;
  if (x == 0.0 || !std::isfinite(x)) return min_subnormal(t);
  std::frexp(x, &e);  // x = m·2^e, 0.5 <= m < 1: the leading bit's exponent is e - 1
  return std::ldexp(1.0, std::max(e - 1, f.min_exponent) - (f.precision - 1));
}

// x rounded to the nearest value of the dtype, ties to even; beyond the largest finite value
// (by half a spacing or more) ±inf, as IEEE 754 rounding does. NaN and ±inf stay.
inline double round_to(DType t, double x) {
  if (!std::isfinite(x) || x == 0.0) return x;
  const Format f = format_of(t);
  const double spacing = ulp(t, x);
  int e = 0;
  std::frexp(spacing, &e);
  // Scaling by a power of two is exact; nearbyint rounds to nearest even.
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, 1 - e)), e - 1);
  if (std::fabs(r) > f.max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

// The 16 bits of a float16 or bfloat16 value, and back; written here rather than taken from
// the library so that the test does not share its conversions. `x` must be a value of the
// dtype (round_to first).
inline uint16_t to_bits(DType t, double x) {
  if (t == DType::kBFloat16) {
    const float f = static_cast<float>(x);  // exact: every bf16 value is a float
    uint32_t u = 0;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<uint16_t>(u >> 16);
  }
  if (t != DType::kFloat16) throw std::invalid_argument("to_bits: float16 or bfloat16 only");
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isnan(x)) return 0x7E00u;
  if (std::isinf(x)) return static_cast<uint16_t>(sign | 0x7C00u);
  const double a = std::fabs(x);
  if (a == 0.0) return sign;
  if (a < std::ldexp(1.0, -14)) {  // subnormal: a multiple of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::ldexp(a, 24)));
  }
  int e = 0;
  const double m = std::frexp(a, &e);  // a = m·2^e, m in [0.5, 1)
  const auto biased = static_cast<uint16_t>(e - 1 + 15);
  const auto mantissa = static_cast<uint16_t>(std::ldexp(m, 11) - 1024.0);
  return static_cast<uint16_t>(sign | (biased << 10) | mantissa);
}

inline double from_bits(DType t, uint16_t bits) {
  if (t == DType::kBFloat16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f = 0.0f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  if (t != DType::kFloat16) throw std::invalid_argument("from_bits: float16 or bfloat16 only");
  const double sign = (bits & 0x8000u) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  if (exponent == 31) {
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  }
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  bool trainable = true;
  bool need_clip = true;          // false: HPS_PARAM_NO_CLIP
  bool is_distributed = false;    // HPS_PARAM_DISTRIBUTED
  bool shared_not_first = false;  // HPS_PARAM_SHARED_NOT_FIRST
  int32_t unit = 0;
  bool weight_decay = true;  // false: HPS_PARAM_NO_WEIGHT_DECAY (no decay at all)

  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
};

enum class Optimizer { kSgd, kAdamW };

// The engine's options, as the values the engine receives (pass float options as the
// doubles of those floats: (double)(float)x).
struct Options {
  Optimizer optimizer = Optimizer::kSgd;
  double learning_rate = 0.01;
  double momentum = 0.0;  // SGD
  double weight_decay = 0.0;
  bool nesterov = false;  // SGD
  double beta1 = 0.9;     // AdamW
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double clip_max_norm = 0.0;  // <= 0: no clipping
  int accumulation_steps = 1;
  int ranks = 1;  // sharding × dp: the ranks the mean is taken over
  bool dynamic_loss_scaling = false;
  double initial_loss_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
  // A model of a known engine fault, to name it when a test sees it; false for the
  // documented semantics. Issue 10 item 1: the updates of need_clip = false parameters are
  // multiplied by the clip coefficient as well (they still do not count in the norm).
  bool fault_no_clip_scaled = false;
};

// Relative accuracies of an engine that computes in float32, from which error_bound starts.
struct Accuracy {
  // Of a reduced gradient, relative to the mean of the absolute values reduced (fp32 sums of
  // up to ranks × micro-batches terms, and the scalings).
  double reduction = 32 * std::ldexp(1.0, -24);
  // Of the clip coefficient for exact gradients (fp32 norm accumulated in chunks; the
  // README bounds it by 1e-5).
  double coefficient = 1e-5;
  // Of one fp32 operation of the optimizer; a step's update counts a few of them.
  double arithmetic = std::ldexp(1.0, -24);
  // First-order bounds leave out products of errors and constant factors: multiply by this.
  double safety = 4.0;
};

// What one step did.
struct StepResult {
  bool skipped = false;     // a non-finite gradient view: no update
  double norm = 0.0;        // the clip's global norm (0 without clipping)
  double norm_error = 0.0;  // how far an fp32 engine's norm may be from it
  double coefficient = 1.0;
  double loss_scale = 1.0;  // the scale this step's gradients were produced with
};

// What a step needs from one part of a model cut across mp and pp (EngineModel::prepare):
// whether its gradient views were all finite, and the sums of the squared mean gradients it
// counts in the clip norm — of DISTRIBUTED parameters and of the others — with the sums of
// their squared error bounds.
struct StepPart {
  bool finite = true;
  double distributed = 0.0, others = 0.0;
  double err_distributed = 0.0, err_others = 0.0;
};

// Gradients of one step: [rank][micro_batch][param][element], the gradient of the UNSCALED
// loss (the model multiplies by the loss scale, as the framework does); frozen parameters'
// entries are empty. An injected fault is just a non-finite entry.
using StepGradients = std::vector<std::vector<std::vector<std::vector<double>>>>;

class EngineModel {
 public:
  // `initial[i]`: parameter i's initial values, which must be values of its dtype.
  EngineModel(std::vector<Param> params, Options options, std::vector<std::vector<double>> initial,
              Accuracy accuracy = {})
      : params_(std::move(params)),
        options_(options),
        accuracy_(accuracy),
        master_(std::move(initial)),
        scale_(options.dynamic_loss_scaling ? options.initial_loss_scale : 1.0) {
    if (master_.size() != params_.size())
      throw std::invalid_argument("one initial value per param");
    if (options_.ranks < 1 || options_.accumulation_steps < 1) {
      throw std::invalid_argument("ranks and accumulation_steps must be >= 1");
    }
    state_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      const size_t n = params_[i].numel();
      if (master_[i].size() != n) {
        throw std::invalid_argument("initial value of '" + params_[i].name +
                                    "' has the wrong size");
      }
      for (double x : master_[i]) {
        if (!(round_to(params_[i].dtype, x) == x)) {
          throw std::invalid_argument("initial value of '" + params_[i].name +
                                      "' not of its dtype");
        }
      }
      State& s = state_[i];
      for (std::vector<double>* v :
           {&s.buf, &s.m, &s.v, &s.err_p, &s.err_buf, &s.err_m, &s.err_v}) {
        v->assign(n, 0.0);
      }
    }
  }

  // What a framework writes into a gradient view of `dtype` holding `view` when it adds the
  // gradient `grad` of the loss multiplied by `scale`.
  static double framework_accumulate(DType dtype, double view, double scale, double grad) {
    return round_to(dtype, view + scale * grad);
  }

  const std::vector<Param>& params() const { return params_; }
  const Options& options() const { return options_; }

  // The job resumed from a checkpoint on another number of sharding × dp ranks: the mean is
  // taken over `ranks` from the next step on; the state carries over unchanged.
  void set_ranks(int ranks) {
    if (ranks < 1) throw std::invalid_argument("ranks must be >= 1");
    options_.ranks = ranks;
  }
  // ... and with parameter i held in another dtype: the framework's views and gradients are
  // of `dtype` from the next step on. A trainable parameter keeps its fp32 master; a frozen
  // one has none (an engine keeps no optimizer state for it), so its value is rounded to
  // `dtype`.
  void set_dtype(size_t i, DType dtype) {
    params_.at(i).dtype = dtype;
    if (params_[i].trainable) return;
    for (double& x : master_[i]) x = round_to(dtype, x);
  }

  // The loss scale the framework multiplies its loss by in the next step.
  double loss_scale() const { return scale_; }
  int64_t skipped_steps() const { return skipped_; }
  int64_t applied_steps() const { return applied_; }

  // The (master) value of parameter i: what hps_engine_gather_parameter hands back.
  const std::vector<double>& master(size_t i) const { return master_.at(i); }

  // The value the framework sees in parameter i's view: the master rounded to its dtype.
  std::vector<double> visible(size_t i) const {
    std::vector<double> out(master_.at(i));
    for (double& x : out) x = round_to(params_[i].dtype, x);
    return out;
  }

  // Per element of parameter i: how far an engine's (fp32) master may be from master(i).
  std::vector<double> error_bound(size_t i) const {
    std::vector<double> out(state_.at(i).err_p);
    for (double& x : out) x *= accuracy_.safety;
    return out;
  }

  // One engine step over the gradients every rank produced in its micro-batches, for an
  // engine with no mp or pp group (its clip and skip span its own ranks).
  StepResult step(const StepGradients& grads) {
    const StepPart part = prepare(grads);
    return finish(part.finite, part.distributed + part.others,
                  part.err_distributed + part.err_others);
  }

  // A step in two halves, for a model cut across mp and pp (HybridModel): prepare() takes
  // this part's gradients and returns what the whole model's decisions need from it;
  // finish() applies the step with the whole model's verdict (every view finite) and the
  // squared norm of every counted gradient (and its error bound), and returns what step()
  // returns. Between the two no other call may come.
  StepPart prepare(const StepGradients& grads) {
    const size_t ranks = static_cast<size_t>(options_.ranks);
    const size_t micro = static_cast<size_t>(options_.accumulation_steps);
    if (grads.size() != ranks) throw std::invalid_argument("step: one gradient set per rank");
    if (pending_) throw std::logic_error("prepare twice without finish");

    // The framework's gradient views after the last micro-batch, per rank, and the sum of
    // the absolute values of every scaled gradient added (what reduction errors scale with,
    // whatever the order of the additions).
    std::vector<std::vector<std::vector<double>>> views(ranks);
    std::vector<std::vector<double>> abs_sum(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) abs_sum[i].assign(params_[i].numel(), 0.0);
    bool finite = true;
    for (size_t r = 0; r < ranks; ++r) {
      if (grads[r].size() != micro) throw std::invalid_argument("step: one set per micro-batch");
      views[r].resize(params_.size());
      for (size_t i = 0; i < params_.size(); ++i) {
        if (!params_[i].trainable) continue;
        std::vector<double>& view = views[r][i];
        view.assign(params_[i].numel(), 0.0);
        for (size_t mb = 0; mb < micro; ++mb) {
          const std::vector<double>& g = grads[r][mb].at(i);
          if (g.size() != view.size()) {
            throw std::invalid_argument("step: gradient of '" + params_[i].name +
                                        "' has the wrong size");
          }
          for (size_t e = 0; e < view.size(); ++e) {
            view[e] = framework_accumulate(params_[i].dtype, view[e], scale_, g[e]);
            abs_sum[i][e] += std::fabs(scale_ * g[e]);
          }
        }
        for (double x : view) finite = finite && std::isfinite(x);
      }
    }

    StepPart part;
    part.finite = finite;
    pending_ = true;
    if (options_.dynamic_loss_scaling && !finite) return part;  // the step is skipped

    // Mean gradients (and the mean of absolute values, for the error bounds).
    const double divisor = static_cast<double>(ranks * micro) * scale_;
    std::vector<std::vector<double>> mean(params_.size()), abs_mean(params_.size());
    std::vector<std::vector<double>> err_g(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].trainable) continue;
      const size_t n = params_[i].numel();
      const DType t = params_[i].dtype;
      mean[i].assign(n, 0.0);
      abs_mean[i].assign(n, 0.0);
      err_g[i].assign(n, 0.0);
      for (size_t e = 0; e < n; ++e) {
        double sum = 0.0;
        for (size_t r = 0; r < ranks; ++r) sum += views[r][i][e];
        mean[i][e] = sum / divisor;
        abs_mean[i][e] = abs_sum[i][e] / divisor;
        err_g[i][e] = accuracy_.reduction * abs_mean[i][e];
        if (t != DType::kFloat32) {
          mean[i][e] = round_to(t, mean[i][e]);
          // The documentation leaves open where the reduced gradient is rounded (the sum or
          // the mean, per micro-batch or per step, scaled or not) and an engine may add
          // micro-batches in fp32 rather than in the view: each choice is within a few
          // roundings of the dtype, relative to the absolute values added, and a subnormal
          // spacing per micro-batch.
          err_g[i][e] +=
              4 * unit_roundoff(t) * abs_mean[i][e] + static_cast<double>(micro) * min_subnormal(t);
        }
      }
    }

    // This part's squares of the counted gradients, split as the clip splits them.
    for (size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      if (!p.trainable || !p.need_clip || p.shared_not_first) continue;
      double& sum = p.is_distributed ? part.distributed : part.others;
      double& err = p.is_distributed ? part.err_distributed : part.err_others;
      for (size_t e = 0; e < mean[i].size(); ++e) {
        sum += mean[i][e] * mean[i][e];
        err += err_g[i][e] * err_g[i][e];
      }
    }
    mean_ = std::move(mean);
    err_g_ = std::move(err_g);
    return part;
  }

  StepResult finish(bool finite_everywhere, double norm2, double err_norm2) {
    if (!pending_) throw std::logic_error("finish without prepare");
    pending_ = false;
    StepResult result;
    result.loss_scale = scale_;
    if (options_.dynamic_loss_scaling && !finite_everywhere) {
      scale_ *= options_.backoff_factor;
      good_steps_ = 0;
      ++skipped_;
      result.skipped = true;
      return result;
    }
    const std::vector<std::vector<double>>& mean = mean_;
    const std::vector<std::vector<double>>& err_g = err_g_;

    // The clip coefficient, and how far an fp32 engine's may be from it.
    double coef = 1.0, err_coef = 0.0;
    if (options_.clip_max_norm > 0) {
      const double norm = std::sqrt(norm2);
      const double max_norm = options_.clip_max_norm;
      coef = max_norm / (std::max(norm, max_norm) + 1e-6);
      // coef = max_norm / max(norm, max_norm) is 1-Lipschitz in norm relative to itself:
      // |Δcoef| <= coef · |Δnorm| / max(norm, max_norm), and |Δnorm| <= ||Δg|| (triangle).
      err_coef = coef * (accuracy_.coefficient + std::sqrt(err_norm2) / std::max(norm, max_norm));
      result.norm = norm;
      result.norm_error = accuracy_.safety * (accuracy_.coefficient * norm + std::sqrt(err_norm2));
      result.coefficient = coef;
    }

    const double lr = options_.learning_rate;
    const double arith = accuracy_.arithmetic;
    ++applied_;
    const double bc1 = 1.0 - std::pow(options_.beta1, static_cast<double>(applied_));
    const double bc2 = 1.0 - std::pow(options_.beta2, static_cast<double>(applied_));
    for (size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      if (!p.trainable) continue;
      State& s = state_[i];
      const double wd = p.weight_decay ? options_.weight_decay : 0.0;
      const bool clipped =
          options_.clip_max_norm > 0 && (p.need_clip || options_.fault_no_clip_scaled);
      for (size_t e = 0; e < mean[i].size(); ++e) {
        const double g = clipped ? coef * mean[i][e] : mean[i][e];
        const double eg =
            clipped ? coef * err_g[i][e] + err_coef * std::fabs(mean[i][e]) : err_g[i][e];
        double& x = master_[i][e];
        double& ex = s.err_p[e];
        const double x_before = x;
        if (options_.optimizer == Optimizer::kSgd) {
          const double mu = options_.momentum;
          const double d = wd != 0.0 ? g + wd * x : g;
          const double ed = eg + wd * ex + arith * (std::fabs(g) + wd * std::fabs(x));
          double step = d, estep = ed;
          if (mu != 0.0) {
            if (applied_ == 1) {
              s.buf[e] = d;
              s.err_buf[e] = ed;
            } else {
              s.buf[e] = mu * s.buf[e] + d;
              s.err_buf[e] = mu * s.err_buf[e] + ed + 2 * arith * std::fabs(s.buf[e]);
            }
            if (options_.nesterov) {
              step = d + mu * s.buf[e];
              estep = ed + mu * s.err_buf[e] + arith * std::fabs(step);
            } else {
              step = s.buf[e];
              estep = s.err_buf[e];
            }
          }
          x = x - lr * step;
          ex += lr * estep + 2 * arith * (std::fabs(x_before) + lr * std::fabs(step));
        } else {
          const double b1 = options_.beta1, b2 = options_.beta2, eps = options_.epsilon;
          x = x * (1.0 - lr * wd);
          s.m[e] = b1 * s.m[e] + (1.0 - b1) * g;
          s.v[e] = b2 * s.v[e] + (1.0 - b2) * g * g;
          s.err_m[e] = b1 * s.err_m[e] + (1.0 - b1) * eg + 2 * arith * std::fabs(s.m[e]);
          s.err_v[e] =
              b2 * s.err_v[e] + (1.0 - b2) * (2 * std::fabs(g) * eg + eg * eg) + 2 * arith * s.v[e];
          const double m_hat = s.m[e] / bc1, em_hat = s.err_m[e] / bc1;
          const double v_hat = s.v[e] / bc2, ev_hat = s.err_v[e] / bc2;
          const double root = std::sqrt(v_hat);
          // |sqrt(v + δ) − sqrt(v)| <= min(δ / (2 sqrt v), sqrt δ)
          const double eroot =
              root > 0 ? std::min(ev_hat / (2 * root), std::sqrt(ev_hat)) : std::sqrt(ev_hat);
          const double denom = root + eps;
          const double update = m_hat / denom;
          const double slack = denom - eroot;
          const double eupdate = slack > 0
                                     ? em_hat / denom + std::fabs(m_hat) * eroot / (denom * slack) +
                                           4 * arith * std::fabs(update)
                                     : std::numeric_limits<double>::infinity();
          x = x - lr * update;
          ex = ex * (1.0 - lr * wd) + lr * eupdate +
               3 * arith * (std::fabs(x_before) + lr * std::fabs(update));
        }
      }
    }

    if (options_.dynamic_loss_scaling && ++good_steps_ >= options_.growth_interval) {
      const double grown = scale_ * options_.growth_factor;
      if (grown <= std::numeric_limits<float>::max()) scale_ = grown;
      good_steps_ = 0;
    }
    return result;
  }

 private:
  struct State {
    std::vector<double> buf, m, v;                     // SGD momentum; AdamW moments
    std::vector<double> err_p, err_buf, err_m, err_v;  // first-order error bounds
  };

  std::vector<Param> params_;
  Options options_;
  Accuracy accuracy_;
  // Between prepare() and finish(): the step's mean gradients and their error bounds.
  bool pending_ = false;
  std::vector<std::vector<double>> mean_, err_g_;
  std::vector<std::vector<double>> master_;
  std::vector<State> state_;
  double scale_;
  int good_steps_ = 0;
  int64_t applied_ = 0;
  int64_t skipped_ = 0;
};

// A model cut across tensor (mp) and pipeline (pp) parallelism: one EngineModel per (pp, mp)
// coordinate, parts[pp · mp_degree + mp], each over the sharding × dp ranks that hold that
// part. DESIGN.md "Hybrid clipping": the squared norm of the whole model counts each
// DISTRIBUTED part once per mp rank (they are slices of one tensor) and the other gradients
// once per pp stage (they are replicated across mp: the framework computes the same ones on
// every mp rank, and the part at mp 0 stands for them); a non-finite gradient view in any part
// skips the step in every part (with dynamic loss scaling).
class HybridModel {
 public:
  HybridModel(std::vector<EngineModel> parts, int mp_degree)
      : parts_(std::move(parts)), mp_(mp_degree) {
    if (mp_ < 1 || parts_.empty() || parts_.size() % static_cast<size_t>(mp_) != 0) {
      throw std::invalid_argument("HybridModel: pp x mp parts");
    }
  }
  EngineModel& part(size_t k) { return parts_.at(k); }
  const EngineModel& part(size_t k) const { return parts_.at(k); }
  size_t parts() const { return parts_.size(); }
  void set_ranks(int ranks) {
    for (EngineModel& m : parts_) m.set_ranks(ranks);
  }
  void set_dtype(size_t i, DType dtype) {
    for (EngineModel& m : parts_) m.set_dtype(i, dtype);
  }

  // grads[k]: part k's gradients; the result per part (the same verdict and norm in all).
  std::vector<StepResult> step(const std::vector<StepGradients>& grads) {
    if (grads.size() != parts_.size()) throw std::invalid_argument("step: gradients per part");
    bool finite = true;
    double norm2 = 0.0, err2 = 0.0;
    for (size_t k = 0; k < parts_.size(); ++k) {
      const StepPart p = parts_[k].prepare(grads[k]);
      finite = finite && p.finite;
      norm2 += p.distributed;
      err2 += p.err_distributed;
      if (k % static_cast<size_t>(mp_) == 0) {
        norm2 += p.others;
        err2 += p.err_others;
      }
    }
    std::vector<StepResult> out;
    for (EngineModel& m : parts_) out.push_back(m.finish(finite, norm2, err2));
    return out;
  }

 private:
  std::vector<EngineModel> parts_;
  int mp_;
};

}  // namespace hps_ref

#endif  // HPSHARD_TESTS_REFERENCE_ENGINE_MODEL_H_
