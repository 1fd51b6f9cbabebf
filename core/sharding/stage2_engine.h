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

#include "core/checkpoint/checkpointable.h"
#include "core/clip/hybrid_clip.h"
#include "core/device/cpu/stream.h"
#include "core/sharding/sharded_engine.h"

namespace hps {

class Stage2Engine final : public ShardedEngine, public Checkpointable {
 public:
  // `sharding` must be a CPU communicator (this version); `dp` may be null.
  static StatusOr<std::unique_ptr<Stage2Engine>> create(std::shared_ptr<Communicator> sharding,
                                                        std::shared_ptr<Communicator> dp,
                                                        const EngineOptions& options);
  ~Stage2Engine() override;

  int32_t stage() const override { return 2; }
  StatusOr<size_t> add_param(ParamSpec spec) override;
  // Collective over the sharding and dp groups (host-blocking once, at set-up): checks
  // every rank registered the same parameters, allocates the buffers, zero-filled.
  Status seal() override;
  // Collective: parameters from each group's source rank (rank 0), so every replica
  // starts equal. Host-blocking, at set-up.
  Status broadcast_parameters() override;

  // Views the framework points its tensors at (valid after seal).
  StatusOr<float*> param(size_t index) override;
  StatusOr<float*> grad(size_t index) override;
  StatusOr<void*> param_data(size_t index) override;
  StatusOr<void*> grad_data(size_t index) override;

  // Before the forward of `unit`: waits until the last all-gather of its parameters has
  // arrived. A dependency wait (counted apart from host syncs), zero once prefetched.
  Status wait_parameters(int32_t unit);
  Status gather(int32_t unit) override { return wait_parameters(unit); }
  Status release(int32_t unit) override;
  // After backward wrote (added) parameter `index`'s gradient. `ready`: the stream the
  // gradient was produced on, or null when the calling thread produced it.
  Status grad_ready(size_t index, Stream* ready = nullptr) override;
  // Enqueues the optimizer step and the parameter all-gathers. Host syncs: none.
  Status step() override;

  const LayoutPlan& plan() const override { return plan_; }
  int32_t shard_rank() const override { return sharding_->rank(); }
  uint64_t resident_bytes() const override;
  int64_t steps_taken() const { return steps_; }
  const float* loss_scale() const override { return &step_state_.loss_scale; }
  const int64_t* skipped_steps() const override { return &step_state_.skipped_steps; }
  // Drains everything in flight (a host sync; for shutdown, checkpoints and tests).
  Status synchronize() override;
  StatusOr<std::vector<std::vector<float>>> gather_all() override;

  // ---- Checkpointable (core/checkpoint/checkpointable.h): state for checkpoints ----
  // The state lives in host memory: the fp32 or fp16/bf16 parameter shard inside the full
  // parameters, the fp32 masters, momentum / exp_avg / exp_avg_sq shards, the StepState;
  // the optimizer stream is the last to write any of it.
  StatusOr<std::vector<StateTensor>> state_tensors() override;
  Stream& state_stream() override { return *optimizer_stream_; }
  CheckpointTopology checkpoint_topology() const override;
  const EngineOptions& checkpoint_options() const override { return options_; }
  Status begin_state_load() override;
  // All-gathers the loaded parameter shards into the full parameters.
  Status end_state_load() override;

 private:
  Stage2Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
               EngineOptions options);
  Status launch_reduce(size_t buffer, Stream* ready);

  struct Bucket {
    std::vector<uint8_t> checked_in;  // per parameter of the buffer
    size_t pending = 0;               // parameters not checked in this micro-batch
    bool complete = false;            // every parameter checked in this micro-batch
    std::shared_ptr<Work> reduced;    // reduce-scatter (+ dp all-reduce) of this step
    std::shared_ptr<Work> gathered;   // the latest parameter all-gather
  };

  std::shared_ptr<Communicator> sharding_, dp_;
  EngineOptions options_;
  LayoutPlan plan_;
  bool sealed_ = false;
  // Full parameters and gradients in the parameters' dtype; the fp32 gradient shard the
  // optimizer reads; for fp16/bf16 buffers the reduced shard in that dtype and the fp32
  // master weights of this rank's shard.
  std::vector<std::vector<uint8_t>> params_, grads_, reduced_;
  std::vector<std::vector<float>> shard_grads_, masters_;
  std::vector<std::vector<float>> state_a_, state_b_;  // momentum / exp_avg, exp_avg_sq
  std::vector<Bucket> buckets_;
  std::vector<size_t> position_in_buffer_;
  int32_t micro_batch_ = 0;
  int64_t steps_ = 0;
  std::unique_ptr<cpu::CpuStream> optimizer_stream_;
  std::unique_ptr<HybridClip> clip_;
  StepState step_state_;  // touched only by tasks on optimizer_stream_ after seal()
};

}  // namespace hps
