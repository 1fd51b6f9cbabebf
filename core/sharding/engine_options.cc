// The engine's options checked alone (check_engine_options, sharded_engine.h): what an
// engine takes, and so what a checkpoint's manifest may record. Its own file: the checkpoint
// reader (and its fuzz target) use it without the engines.
#include <cmath>
#include <string>

#include "core/sharding/sharded_engine.h"

namespace hps {
namespace {

bool finite_at_least(double v, double low) { return std::isfinite(v) && v >= low; }

// INVALID_ARGUMENT "engine: <name> must be <rule>, not <value>".
Status bad_option(const char* name, const char* rule, double value) {
  return invalid_argument(std::string("engine: ") + name + " must be " + rule + ", not " +
                          std::to_string(value));
}

Status check_hyperparameters(const EngineOptions& o) {
  if (o.optimizer == OptimizerKind::kSgd) {
    const SgdHyper& h = o.sgd;
    if (!finite_at_least(h.learning_rate, 0))
      return bad_option("learning_rate", ">= 0 and finite", h.learning_rate);
    if (!finite_at_least(h.momentum, 0))
      return bad_option("momentum", ">= 0 and finite", h.momentum);
    if (!finite_at_least(h.weight_decay, 0))
      return bad_option("weight_decay", ">= 0 and finite", h.weight_decay);
    if (h.nesterov && h.momentum == 0.0f) {
      return invalid_argument("engine: nesterov needs a momentum above 0");
    }
    return Status::Ok();
  }
  const AdamWHyper& h = o.adamw;
  if (!finite_at_least(h.learning_rate, 0))
    return bad_option("learning_rate", ">= 0 and finite", h.learning_rate);
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return bad_option("beta1", "in [0, 1)", h.beta1);
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return bad_option("beta2", "in [0, 1)", h.beta2);
  if (!finite_at_least(h.epsilon, 0)) return bad_option("epsilon", ">= 0 and finite", h.epsilon);
  if (!finite_at_least(h.weight_decay, 0))
    return bad_option("weight_decay", ">= 0 and finite", h.weight_decay);
  return Status::Ok();
}

}  // namespace

Status check_engine_options(const EngineOptions& options) {
  if (options.optimizer != OptimizerKind::kSgd && options.optimizer != OptimizerKind::kAdamW) {
    return invalid_argument("engine: unknown optimizer");
  }
  HPS_RETURN_IF_ERROR(check_hyperparameters(options));
  if (options.accumulation_steps < 1) {
    return invalid_argument("engine: accumulation_steps must be >= 1");
  }
  if (!(options.clip_max_norm >= 0) || !std::isfinite(options.clip_max_norm)) {
    return bad_option("clip_max_norm", ">= 0 and finite (0: no clipping)", options.clip_max_norm);
  }
  if (options.alignment_bytes == 0 ||
      (options.alignment_bytes & (options.alignment_bytes - 1)) != 0 ||
      options.alignment_bytes > kMaxAlignmentBytes) {
    return invalid_argument("engine: alignment_bytes must be a power of two from 1 to " +
                            std::to_string(kMaxAlignmentBytes) + ", not " +
                            std::to_string(options.alignment_bytes));
  }
  if (options.prefetch_window < 1) return invalid_argument("engine: prefetch_window must be >= 1");
  if (options.dynamic_loss_scaling &&
      (!(options.initial_loss_scale > 0) || !std::isfinite(options.initial_loss_scale) ||
       !(options.growth_factor >= 1) || !std::isfinite(options.growth_factor) ||
       !(options.backoff_factor > 0 && options.backoff_factor < 1) ||
       options.growth_interval < 1)) {
    return invalid_argument(
        "engine: loss scaling needs initial_loss_scale > 0, growth_factor >= 1 (both finite), "
        "0 < backoff_factor < 1 and growth_interval >= 1");
  }
  return Status::Ok();
}

}  // namespace hps
