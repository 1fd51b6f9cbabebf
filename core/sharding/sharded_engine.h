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
#include "core/device/cpu/stream.h"
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
  // Dynamic loss scaling: the framework multiplies its loss by *loss_scale(); the engine
  // unscales the gradients, skips the step when any rank found a non-finite gradient
  // (halving the scale) and grows the scale after `growth_interval` good steps. The
  // found-inf flag and the scale never leave the engine's stream: no host reads.
  bool dynamic_loss_scaling = false;
  float initial_loss_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
  // CUDA engines: the stream the framework runs forward and backward on. gather() makes it
  // wait for the unit's all-gather, release() frees the unit after the work queued on it,
  // grad_ready() without a `ready` stream orders the reduction after it. Null: the CUDA
  // legacy default stream. Ignored on CPU.
  Stream* compute_stream = nullptr;
};

class ShardedEngine {
 public:
  virtual ~ShardedEngine() = default;
  virtual int32_t stage() const = 0;
  virtual StatusOr<size_t> add_param(ParamSpec spec) = 0;
  virtual Status seal() = 0;
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
  virtual Status synchronize() = 0;
  // Full fp32 copies of every parameter (for saving or evaluation; Paddle's
  // get_all_parameters): the masters for fp16/bf16 ones. Collective over the sharding
  // group; host-blocking.
  virtual StatusOr<std::vector<std::vector<float>>> gather_all() = 0;
  virtual uint64_t resident_bytes() const = 0;
  virtual const LayoutPlan& plan() const = 0;
  virtual int32_t shard_rank() const = 0;
  // The current loss scale (1 without dynamic loss scaling), in the engine's memory; read it
  // after wait_parameters()/gather() of the next step, when the last update has landed.
  virtual const float* loss_scale() const = 0;
  // Steps skipped for non-finite gradients so far (same ordering rule).
  virtual const int64_t* skipped_steps() const = 0;
};

// The state of the optimizer step that only tasks on the optimizer stream touch.
struct StepState {
  float loss_scale = 1.0f;
  int32_t found_inf = 0;  // all-reduced (max) over the groups before the update
  int32_t skip = 0;       // this step's verdict, set by the step update before the optimizers
  int32_t good_steps = 0;
  int64_t applied_steps = 0;  // AdamW's step count and SGD's first-step rule (this step's)
  int64_t skipped_steps = 0;
};

// Enqueues on `opt`, after the gradient shards are reduced: the mean and the unscale
// (one pass), the zeroing of the consumed full gradients, and with dynamic loss scaling
// the found-inf check all-reduced over `sharding` and `dp`. `full` may hold nulls.
struct ShardGradients {
  void* full;  // the consumed full gradients, zeroed (may be null)
  size_t full_bytes;
  float* shard;  // the fp32 gradient shard the optimizer reads
  size_t shard_count;
  const void* reduced = nullptr;  // fp16/bf16: the reduced shard, converted into `shard`
  DType reduced_dtype = DType::kFloat32;
};
Status enqueue_unscale_and_check(cpu::CpuStream& opt, StepState* state,
                                 const std::vector<ShardGradients>& grads, float mean_scale,
                                 const EngineOptions& options, Communicator& sharding,
                                 Communicator* dp);
// After the found-inf check, before the optimizer tasks: whether this step is skipped,
// the step counts and the scale update. Enqueued before any all-gather of the step, so a
// completed all-gather (wait_parameters) means the scale and the counts have landed.
void enqueue_step_update(cpu::CpuStream& opt, StepState* state, const EngineOptions& options);
// One shard's optimizer update, skipped when the step found a non-finite gradient.
void enqueue_optimizer(cpu::CpuStream& opt, StepState* state, const EngineOptions& options,
                       float* param, float* grad, float* state_a, float* state_b, size_t count,
                       const float* clip_coefficient);

// Stage 2 or 3 over `sharding`, `dp` optional. CPU communicators: both stages; CUDA
// communicators (NCCL): stage 3 with float32 parameters (CudaStage3Engine).
StatusOr<std::unique_ptr<ShardedEngine>> create_sharded_engine(
    int32_t stage, std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
    const EngineOptions& options);

// Checks shared by the stages.
// `device`: the device type the engine works on; both communicators must be on it.
Status check_engine_arguments(const std::shared_ptr<Communicator>& sharding,
                              const std::shared_ptr<Communicator>& dp, const EngineOptions& options,
                              DeviceType device = DeviceType::kCpu);
// All ranks of `comm` registered the same parameters (a host-blocking all-gather, set-up).
Status check_same_model(Communicator& comm, const LayoutPlan& plan);
// seal()'s common part: refuses a second seal and an empty model, checks that every rank of
// both groups registered the same parameters, and seals the plan over `sharding`.
Status seal_plan(LayoutPlan& plan, bool sealed, Communicator& sharding, Communicator* dp,
                 uint64_t alignment_bytes);
// gather_all's last part: buffer b's full fp32 values cut into its parameters' vectors.
void split_buffer(const LayoutPlan& plan, size_t b, const std::vector<float>& full,
                  std::vector<std::vector<float>>& out);
// OUT_OF_RANGE unless `index` names a registered parameter.
Status check_param_index(const LayoutPlan& plan, size_t index);
// FAILED_PRECONDITION naming the parameter when it is frozen; `what` ends the message
// ("is not trainable" ...).
Status check_trainable(const LayoutPlan& plan, size_t index, const char* what);
// Stage 3: the FAILED_PRECONDITION of a view of a parameter whose unit is not gathered.
Status not_gathered(const LayoutPlan& plan, size_t index);
// OK when parameter `index` is float32 (its float* views); else FAILED_PRECONDITION
// pointing at the data views.
Status check_float32_view(const LayoutPlan& plan, size_t index);
// Registers `spec` in `plan` unless the plan is sealed or the dtype is not trainable
// (float32, or float16/bfloat16 with fp32 master weights inside).
StatusOr<size_t> add_engine_param(LayoutPlan& plan, ParamSpec spec);
// The clip over this rank's reduced gradient shards (one tensor per parameter part, with
// its flags), sealed; null when options.clip_max_norm is 0.
// grad_shards[b]: buffer b's fp32 gradient shard (host or device memory, as the
// communicator's device), or null for buffers that are not trainable.
StatusOr<std::unique_ptr<HybridClip>> make_shard_clip(std::shared_ptr<Communicator> sharding,
                                                      const EngineOptions& options,
                                                      const LayoutPlan& plan,
                                                      const std::vector<float*>& grad_shards);
// Every buffer's data() (null for empty ones).
std::vector<float*> shard_pointers(std::vector<std::vector<float>>& shards);

}  // namespace hps
