// The interface every sharding stage implements, so frameworks (and the C API) drive
// stage 2 and stage 3 the same way:
//
//   for each unit in forward order:  gather(u); forward; release(u)
//   for each unit in backward order: gather(u); backward adds into grad(i); grad_ready(i);
//   release(u) step()
//
// Stage 2 keeps every parameter resident: gather() only waits for the last all-gather,
// release() does nothing. Stage 3 keeps only this rank's shards: gather() brings the
// unit's parameters in (prefetched in the recorded order), release() frees them.
#pragma once

#include <memory>

#include "core/clip/hybrid_clip.h"
#include "core/comm/communicator.h"
#include "core/kernels/optimizer.h"
#include "core/storage/layout_plan.h"

namespace hps {

enum class OptimizerKind : int32_t { kSgd = 0, kAdamW = 1 };

struct EngineOptions {
  OptimizerKind optimizer = OptimizerKind::kSgd;
  SgdHyper sgd;
  AdamWHyper adamw;
  double clip_max_norm = 0;  // > 0: global-norm clipping folded into the optimizer
  bool deterministic_clip = false;
  uint64_t alignment_bytes = 256;
  int32_t accumulation_steps = 1;  // micro-batches per step; dp reduces on the last only
  int32_t prefetch_window = 2;     // stage 3: units gathered ahead, at most, live at once
};

class ShardedEngine {
 public:
  virtual ~ShardedEngine() = default;
  virtual int32_t stage() const = 0;
  virtual StatusOr<size_t> add_param(ParamSpec spec) = 0;
  virtual Status seal() = 0;
  virtual Status broadcast_parameters() = 0;
  virtual StatusOr<float*> param(size_t index) = 0;
  virtual StatusOr<float*> grad(size_t index) = 0;
  virtual Status gather(int32_t unit) = 0;
  virtual Status release(int32_t unit) = 0;
  virtual Status grad_ready(size_t index, Stream* ready) = 0;
  virtual Status step() = 0;
  virtual Status synchronize() = 0;
  virtual uint64_t resident_bytes() const = 0;
  virtual const LayoutPlan& plan() const = 0;
  virtual int32_t shard_rank() const = 0;
};

// Stage 2 or 3 over `sharding` (CPU communicators in this version), `dp` optional.
StatusOr<std::unique_ptr<ShardedEngine>> create_sharded_engine(
    int32_t stage, std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options);

// Checks shared by the stages.
Status check_engine_arguments(const std::shared_ptr<Communicator>& sharding,
                              const std::shared_ptr<Communicator>& dp,
                              const EngineOptions& options);
// All ranks of `comm` registered the same parameters (a host-blocking all-gather, set-up).
Status check_same_model(Communicator& comm, const LayoutPlan& plan);
// Registers `spec` in `plan` unless the plan is sealed or the dtype is not trainable yet.
StatusOr<size_t> add_engine_param(LayoutPlan& plan, ParamSpec spec);
// The clip over this rank's reduced gradient shards (one tensor per parameter part, with
// its flags), sealed; null when options.clip_max_norm is 0.
StatusOr<std::unique_ptr<HybridClip>> make_shard_clip(std::shared_ptr<Communicator> sharding,
                                                      const EngineOptions& options,
                                                      const LayoutPlan& plan,
                                                      std::vector<std::vector<float>>& grad_shards);

}  // namespace hps
