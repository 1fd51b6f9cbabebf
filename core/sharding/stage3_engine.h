// Stage 3 (ZeRO-3): only this rank's shard of each parameter buffer is resident. Before a
// unit's forward (and again before its backward) gather() all-gathers it into a full
// buffer; release() frees it. The order of gathers in the first step is recorded, and
// later steps prefetch the next units in that order, at most `prefetch_window` units
// live at once, so memory stays within the shards plus the window without the host
// blocking. Gradients are reduce-scattered per unit into the local gradient shard as
// soon as the unit's backward checked in; the optimizer steps on the shards.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/checkpoint/checkpointable.h"
#include "core/clip/hybrid_clip.h"
#include "core/device/cpu/stream.h"
#include "core/flow/task_flow.h"
#include "core/sharding/sharded_engine.h"
#include "core/sharding/stage3_schedule.h"

namespace hps {

class Stage3Engine final : public ShardedEngine, public Checkpointable {
 public:
  static StatusOr<std::unique_ptr<Stage3Engine>> create(std::shared_ptr<Communicator> sharding,
                                                        std::shared_ptr<Communicator> dp,
                                                        const EngineOptions& options);
  ~Stage3Engine() override;

  int32_t stage() const override { return 3; }
  StatusOr<size_t> add_param(ParamSpec spec) override;
  // Allocates the shards and, for initialisation only, full buffers the framework writes
  // its initial values into; broadcast_parameters() shards them and frees them.
  Status seal() override;
  Status broadcast_parameters() override;
  // Valid while the parameter's unit is gathered (or before broadcast_parameters()).
  StatusOr<float*> param(size_t index) override;
  // Valid while the unit is gathered; zero when first taken in a micro-batch.
  StatusOr<float*> grad(size_t index) override;
  StatusOr<void*> param_data(size_t index) override;
  StatusOr<void*> grad_data(size_t index) override;
  Status gather(int32_t unit) override;
  Status release(int32_t unit) override;
  Status grad_ready(size_t index, Stream* ready) override;
  Status step() override;
  Status synchronize() override;
  uint64_t resident_bytes() const override;
  // The most bytes held at once since seal() (after initialisation).
  uint64_t peak_resident_bytes() const { return peak_resident_; }
  // All-gathers started ahead of their gather() call (prefetch), and gather() calls that
  // found their unit already in flight or arrived.
  uint64_t prefetched_gathers() const { return prefetched_; }
  uint64_t gathers_found_in_flight() const { return found_in_flight_; }
  // release() calls that kept their unit live because the recorded order gathers it next.
  uint64_t releases_kept_live() const { return kept_live_; }
  // Full buffers handed out since seal(), and those of them allocated afresh (not reused
  // from the pool).
  uint64_t full_buffers_taken() const { return taken_full_; }
  uint64_t fresh_full_buffers() const { return fresh_full_; }
  const LayoutPlan& plan() const override { return plan_; }
  const float* loss_scale() const override { return &step_state_.loss_scale; }
  const int64_t* skipped_steps() const override { return &step_state_.skipped_steps; }
  int32_t shard_rank() const override { return sharding_->rank(); }
  // Full copies of every parameter (for saving or evaluation; Paddle's
  // get_all_parameters). Collective; host-blocking.
  StatusOr<std::vector<std::vector<float>>> gather_all() override;

  // ---- Checkpointable (core/checkpoint/checkpointable.h): state for checkpoints ----
  // The state lives in host memory: the shards (fp32 masters in param_shards_, the
  // fp16/bf16 parameters in wire_shards_), momentum / exp_avg / exp_avg_sq shards, the
  // StepState; the optimizer stream is the last to write any of it. Available after
  // broadcast_parameters().
  StatusOr<std::vector<StateTensor>> state_tensors() override;
  Stream& state_stream() override { return *optimizer_stream_; }
  CheckpointTopology checkpoint_topology() const override;
  const EngineOptions& checkpoint_options() const override { return options_; }
  Status begin_state_load() override;
  // Drops gathered and prefetched units (they hold the old values) and refreshes the fp32
  // shards of frozen fp16/bf16 buffers from the loaded parameters.
  Status end_state_load() override;

 private:
  Stage3Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
               EngineOptions options);
  // A full unit buffer in the parameters' dtype.
  // Not value-initialised: the all-gather writes every byte of a parameter buffer, so
  // only gradient buffers are zeroed.
  struct FullBuffer {
    FullBuffer(std::unique_ptr<uint8_t[]> storage, size_t size, size_t capacity)
        : bytes(std::move(storage)), size_(size), capacity_(capacity) {}
    uint8_t* data() { return bytes.get(); }
    size_t size() const { return size_; }
    size_t capacity() const { return capacity_; }  // what it holds resident
    std::unique_ptr<uint8_t[]> bytes;

   private:
    size_t size_;
    size_t capacity_;
  };
  using Full = std::shared_ptr<FullBuffer>;
  // A full buffer of `bytes`, reusing a freed one of that size when the pool has one.
  // Freed buffers return to the pool; before a fresh allocation the pool gives back what
  // would lift the resident bytes above both the peak so far and the memory budget (the
  // shards plus prefetch_window units of full parameters and gradients), so pooling never
  // takes the engine past either: it keeps memory the engine may use anyway (no page
  // faults and no allocator trips per gather in steady steps).
  Full take_full(size_t bytes);
  struct Buffer {
    Full params;                      // live full parameters (gathered or in flight)
    std::shared_ptr<Work> gathering;  // the all-gather filling `params`
    bool in_use = false;              // gathered by the framework and not released
    Full grads;                       // live full gradients of this micro-batch
    std::shared_ptr<Work> reduced;    // this step's reduction into the shard
  };

  Status start_gather(size_t b);
  void note_resident();

  std::shared_ptr<Communicator> sharding_, dp_;
  EngineOptions options_;
  LayoutPlan plan_;
  bool sealed_ = false;
  bool initialised_ = false;  // broadcast_parameters() done: the init buffers are gone
  // init_: full buffers in the parameters' dtype until broadcast_parameters(). The fp32
  // shards (masters, gradients, optimizer state) for every dtype; for fp16/bf16 buffers the
  // shard in that dtype too (what the all-gather sends) and the reduced gradient shard.
  std::vector<std::vector<uint8_t>> init_, wire_shards_, wire_reduced_;
  std::vector<std::vector<float>> param_shards_, grad_shards_, incoming_, state_a_, state_b_;
  mutable std::mutex pool_mutex_;  // buffers are freed where their last holder lets go
  std::multimap<size_t, std::unique_ptr<uint8_t[]>> pool_;
  uint64_t pooled_bytes_ = 0;
  uint64_t memory_budget_ = 0;  // set by broadcast_parameters()
  std::vector<Buffer> buffers_;
  Stage3Schedule schedule_;  // units, the recorded gather order, check-ins, micro-batches
  int64_t steps_ = 0;
  uint64_t peak_resident_ = 0;
  uint64_t prefetched_ = 0;
  uint64_t found_in_flight_ = 0;
  uint64_t kept_live_ = 0;
  uint64_t fresh_full_ = 0;
  uint64_t taken_full_ = 0;
  std::unique_ptr<cpu::CpuStream> optimizer_stream_;
  // Per buffer: recorded on the optimizer stream after its latest update; its next
  // all-gather (on the communicator's stream) waits for this alone.
  std::vector<std::unique_ptr<cpu::CpuEvent>> updated_;
  std::unique_ptr<HybridClip> clip_;
  // Reductions in flight, keeping their full gradient buffers alive until they finish.
  TaskFlow in_flight_;
  StepState step_state_;  // touched only by tasks on optimizer_stream_ after seal()
  uint64_t in_flight_bytes_ = 0;
};

}  // namespace hps
