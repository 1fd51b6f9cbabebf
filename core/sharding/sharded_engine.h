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
//
// Both stages are written once against the device layer (streams, events, allocators),
// the kernel table and the sharded storages: the same engine runs on CPU communicators
// (Gloo / shared memory) and CUDA ones (NCCL).
#pragma once

#include <memory>
#include <vector>

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
  // > 0: a flat buffer (bucket) holds at most this many bytes, so a unit larger than it is
  // reduced in several collectives that overlap its backward. 0: one bucket per unit.
  uint64_t bucket_bytes = 0;
  int32_t accumulation_steps = 1;  // micro-batches per step; dp reduces on the last only
  int32_t prefetch_window = 2;     // stage 3: units gathered ahead, at most, live at once
  // Dynamic loss scaling: the framework multiplies its loss by *loss_scale(); the engine
  // unscales the gradients, skips the step when any rank found a non-finite gradient
  // (halving the scale) and grows the scale after `growth_interval` good steps. The
  // found-inf flag and the scale never leave the engine's streams: no host reads.
  bool dynamic_loss_scaling = false;
  float initial_loss_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
  // The stream the framework runs forward and backward on (on the communicators' device).
  // gather() makes it wait for the unit's all-gather, release() frees the unit after the
  // work queued on it, grad_ready() without a `ready` stream orders the reduction after it.
  // On the CPU always the calling thread (waits block it: dependency waits; a CPU stream
  // given here is checked for its device and not used); null on CUDA: the legacy default
  // stream.
  Stream* compute_stream = nullptr;
};

class ShardedEngine {
 public:
  virtual ~ShardedEngine() = default;
  virtual int32_t stage() const = 0;
  virtual StatusOr<size_t> add_param(ParamSpec spec) = 0;
  // Before seal(): this rank's tensor-parallel (mp) and pipeline (pp) groups, either null.
  // The step's global decisions then span the whole model, not only this replica's part:
  // the clip's norm sums DISTRIBUTED gradients over mp and every counted gradient over pp
  // (DESIGN.md "Hybrid clipping"), and a non-finite gradient on any rank of either group
  // skips the step everywhere. seal() checks (collectively) that the groups are the other
  // axes of one topology and that every mp rank registered the same flags.
  virtual Status set_model_parallel_groups(std::shared_ptr<Communicator> mp,
                                           std::shared_ptr<Communicator> pp) = 0;
  // Collective over the sharding and dp groups (host-blocking once, at set-up): checks
  // every rank registered the same parameters, lays them out and allocates the storages.
  virtual Status seal() = 0;
  // Collective: parameters from each group's source rank (rank 0), so every replica starts
  // equal. Host-blocking, at set-up.
  virtual Status broadcast_parameters() = 0;
  // float32 views (FAILED_PRECONDITION for a parameter of another dtype)...
  virtual StatusOr<float*> param(size_t index) = 0;
  virtual StatusOr<float*> grad(size_t index) = 0;
  // ...and views of any dtype (fp16/bf16 parameters keep fp32 master weights inside).
  virtual StatusOr<void*> param_data(size_t index) = 0;
  virtual StatusOr<void*> grad_data(size_t index) = 0;
  virtual Status gather(int32_t unit) = 0;
  virtual Status release(int32_t unit) = 0;
  virtual Status grad_ready(size_t index, Stream* ready) = 0;
  virtual Status step() = 0;
  // Drains everything in flight (a host sync; for shutdown, checkpoints and tests).
  virtual Status synchronize() = 0;
  // synchronize(), then lets go of everything but the memory handed out as views (the
  // parameters and gradients, the step state and the clip's norm): the communicators, the
  // streams, the work in flight. What a handle's destroy does while views keep the
  // engine: its groups close with the handle, so peers learn at once that this rank left.
  // Every call after it is FAILED_PRECONDITION. Returns synchronize()'s status.
  virtual Status drop_groups() = 0;
  // The framework's handle is gone while checkpoint handles keep the engine: no unit stays
  // gathered for it (stage 3's full buffers stay until the next load returns them), so a
  // load is not refused for a unit nobody can release any more. Stage 2 gathers nothing.
  virtual void release_gathered_units() {}
  // Full fp32 copies of every parameter (for saving or evaluation; Paddle's
  // get_all_parameters): the masters for fp16/bf16 ones. Collective over the sharding
  // group; host-blocking.
  virtual StatusOr<std::vector<std::vector<float>>> gather_all() = 0;
  virtual uint64_t resident_bytes() const = 0;
  virtual const LayoutPlan& plan() const = 0;
  virtual int32_t shard_rank() const = 0;
  virtual Device device() const = 0;
  // The current loss scale (1 without dynamic loss scaling), in the engine's device
  // memory; read it after gather() of the next step, when the last update has landed.
  virtual const float* loss_scale() const = 0;
  // Steps skipped for non-finite gradients so far (device memory, same ordering rule).
  virtual const int64_t* skipped_steps() const = 0;
  // With clipping: the global norm of the last step's gradients as the clip computed it
  // (unscaled; 0 before the first step), device memory under the same ordering rule; null
  // without clipping or before seal().
  virtual const float* grad_norm() const = 0;
  // The learning rate of the steps enqueued from now on (a schedule sets it before each
  // step): the next step's kernels take it as an argument, so nothing waits. A checkpoint
  // records the rate in effect. INVALID_ARGUMENT when negative or not finite.
  virtual Status set_learning_rate(float learning_rate) = 0;
};

// Stage 2 or 3 over `sharding` (CPU or CUDA communicators), `dp` optional.
StatusOr<std::unique_ptr<ShardedEngine>> create_sharded_engine(
    int32_t stage, std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options);

// INVALID_ARGUMENT naming the first bad option or communicator (shared by the stages).
Status check_engine_arguments(const std::shared_ptr<Communicator>& sharding,
                              const std::shared_ptr<Communicator>& dp,
                              const EngineOptions& options);
// The options alone (optimizer, hyperparameters, clipping, layout, loss scaling): what an
// engine takes, so what a checkpoint's manifest may record.
Status check_engine_options(const EngineOptions& options);

}  // namespace hps
