// The sharded optimizer: the step pipeline both stages run on their optimizer stream,
// written once against the kernel table —
//
//   unscale (mean over ranks and micro-batches, loss scale; found-inf; the clip's partial
//   sums of squares, split by the clip flags, in the same pass; with a clip or loss scaling
//   it is enqueued by reduced() after each buffer's reduction, while the shard is fresh,
//   not by step()) → found-inf max over the
//   groups (sharding, dp, mp, pp) → the clip's reduction and coefficient → the step's verdict
//   (skip, step count, loss scale) → SGD / AdamW on each shard (the coefficient folded in where the
//   flags say) → the updated masters rounded into the model dtype → the stage's hook (an
//   all-gather, or the event the next one waits for).
//
// Every scalar that steers it lives in device memory (StepState, ClipState). Nothing
// blocks the host.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "core/clip/hybrid_clip.h"
#include "core/comm/communicator.h"
#include "core/device/buffer.h"
#include "core/kernels/kernel_table.h"
#include "core/sharding/sharded_engine.h"
#include "core/storage/sharded_storage.h"

namespace hps {

// One trainable flat buffer's shard, as the step sees it.
struct ShardStep {
  size_t buffer = 0;
  size_t count = 0;  // shard elements
  // The reduced fp32 gradient shard (the sum over ranks and micro-batches): unscaled in
  // place, then read by the optimizer.
  DevicePtr<float> grad;
  DevicePtr<float> master;  // the fp32 parameters the optimizer updates
  // Where the updated master is rounded to after the update (null: nowhere).
  DevicePtr<void> rounded;
  DType rounded_dtype = DType::kFloat32;
  // Full gradients the reduction consumed, zeroed for the next step (null: none).
  DevicePtr<void> consumed;
  size_t consumed_bytes = 0;
  std::vector<ShardSpan> spans;  // the shard's clip treatment (LayoutPlan::shard_spans)
};

// The groups a step spans: the engine's sharding and dp groups and this rank's
// model-parallel ones (any but sharding may be null).
struct StepGroups {
  std::shared_ptr<Communicator> sharding, dp, mp, pp;
};

class ShardedOptimizer {
 public:
  // The optimizer state roles `options` needs (momentum; exp_avg and exp_avg_sq), for the
  // storage to allocate.
  static std::vector<RoleLayout> state_roles(const EngineOptions& options);
  // The step state (initial loss scale) written on `stream`.
  static StatusOr<std::unique_ptr<ShardedOptimizer>> create(const EngineOptions& options,
                                                            Device device,
                                                            const ShardedStorage& storage,
                                                            StepGroups groups, Stream& stream);

  // Whether the step has a global stage (the clip's norm, the found-inf flag) that needs
  // every shard unscaled first: then the engines call reduced() for each buffer as its
  // step's last reduction is enqueued.
  bool unscales_early() const { return clip_ != nullptr || options_.dynamic_loss_scaling; }
  // The rate the update kernels and AdamW's step constants take from the next step on.
  void set_learning_rate(float learning_rate) {
    options_.sgd.learning_rate = learning_rate;
    options_.adamw.learning_rate = learning_rate;
    rule_.adamw_hyper.learning_rate = learning_rate;
  }
  // Buffer `shard.buffer`'s last reduction of the step is enqueued: `wait_reduced()` makes
  // `stream` wait for it, then its unscale pass (and the clip's partial sums) is enqueued,
  // so it reads the shard while the reduction's writes are still in cache, beside the rest
  // of the backward, and step() reads the gradients once, in the optimizer. A no-op unless
  // unscales_early().
  Status reduced(Stream& stream, const ShardStep& shard, float mean_scale,
                 const std::function<Status()>& wait_reduced);
  // Enqueues one step on `stream`. `wait_reduced(b)` makes `stream` wait for buffer b's
  // reduction (for buffers reduced() did not see); `updated(b)` runs once b's update (and
  // rounding) are enqueued.
  Status step(Stream& stream, const std::vector<ShardStep>& shards, float mean_scale,
              const std::function<Status(size_t)>& wait_reduced,
              const std::function<Status(size_t)>& updated);

  DevicePtr<StepState> state() const { return state_.data<StepState>(); }
  // The clip whose state step() fills (null without clipping).
  const HybridClip* clip() const { return clip_.get(); }
  bool clips() const { return clip_ != nullptr; }
  // Lets the groups go (the clip's too), keeping the step state and the clip's state: the
  // engine's drop_groups() (no step after it).
  void drop_groups();

 private:
  ShardedOptimizer() = default;
  Status optimize(Stream& stream, const ShardStep& shard, const ShardSpan& span) const;
  Status unscale(Stream& stream, const ShardStep& shard, float mean_scale) const;
  Status begin_step(Stream& stream);

  EngineOptions options_;
  const Kernels* kernels_ = nullptr;
  const ShardedStorage* storage_ = nullptr;
  StepGroups groups_;
  std::unique_ptr<HybridClip> clip_;
  DeviceBuffer state_;  // one StepState
  StepRule rule_;
  // This step so far: the clip's partials zeroed, and which buffers reduced() unscaled.
  bool begun_ = false;
  std::vector<uint8_t> unscaled_;
};

}  // namespace hps
