// Stage 2 (ZeRO-2): full parameters stay resident; gradients go into flat bucketed
// buffers; a bucket's reduce-scatter is enqueued as soon as all its parameters checked
// in (while backward goes on); the optimizer steps on the local shard; an all-gather
// brings the updated parameters back, and the next forward's first use of a unit waits
// on it. With a dp group above sharding, the reduced shard is all-reduced over dp.
// Nothing in step() blocks the host.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

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
  int32_t accumulation_steps = 1;  // micro-batches per step; reduce on the last only
};

class Stage2Engine {
 public:
  // `sharding` must be a CPU communicator (this version); `dp` may be null.
  static StatusOr<std::unique_ptr<Stage2Engine>> create(std::shared_ptr<Communicator> sharding,
                                                        std::shared_ptr<Communicator> dp,
                                                        const EngineOptions& options);
  ~Stage2Engine();

  StatusOr<size_t> add_param(ParamSpec spec);
  // Collective over the sharding and dp groups (host-blocking once, at set-up): checks
  // every rank registered the same parameters, allocates the buffers, zero-filled.
  Status seal();
  // Collective: parameters from each group's source rank (rank 0), so every replica
  // starts equal. Host-blocking, at set-up.
  Status broadcast_parameters();

  // Views the framework points its tensors at (valid after seal).
  StatusOr<float*> param(size_t index);
  StatusOr<float*> grad(size_t index);

  // Before the forward of `unit`: waits until the last all-gather of its parameters has
  // arrived. A dependency wait (counted apart from host syncs), zero once prefetched.
  Status wait_parameters(int32_t unit);
  // After backward wrote (added) parameter `index`'s gradient. `ready`: the stream the
  // gradient was produced on, or null when the calling thread produced it.
  Status grad_ready(size_t index, Stream* ready = nullptr);
  // Enqueues the optimizer step and the parameter all-gathers. Host syncs: none.
  Status step();

  const LayoutPlan& plan() const { return plan_; }
  int32_t shard_rank() const { return sharding_->rank(); }
  uint64_t resident_bytes() const;
  int64_t steps_taken() const { return steps_; }
  // Drains everything in flight (a host sync; for shutdown, checkpoints and tests).
  Status synchronize();

 private:
  Stage2Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
               EngineOptions options);
  Status check_same_model(Communicator& comm);
  Status launch_reduce(size_t buffer, Stream* ready);

  struct Bucket {
    std::vector<uint8_t> checked_in;  // per parameter of the buffer
    size_t pending = 0;               // parameters not checked in this micro-batch
    std::shared_ptr<Work> reduced;    // reduce-scatter (+ dp all-reduce) of this step
    std::shared_ptr<Work> gathered;   // the latest parameter all-gather
  };

  std::shared_ptr<Communicator> sharding_, dp_;
  EngineOptions options_;
  LayoutPlan plan_;
  bool sealed_ = false;
  std::vector<std::vector<float>> params_, grads_, shard_grads_;
  std::vector<std::vector<float>> state_a_, state_b_;  // momentum / exp_avg, exp_avg_sq
  std::vector<Bucket> buckets_;
  std::vector<size_t> position_in_buffer_;
  int32_t micro_batch_ = 0;
  int64_t steps_ = 0;
  std::unique_ptr<cpu::CpuStream> optimizer_stream_;
  std::unique_ptr<HybridClip> clip_;
};

}  // namespace hps
