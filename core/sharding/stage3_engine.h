// Stage 3 (ZeRO-3): only this rank's shard of each parameter buffer is resident. Before a
// unit's forward (and again before its backward) gather() all-gathers it into a full
// buffer from the pool; release() gives it back. The order of gathers in the first step is
// recorded, and later steps prefetch the next units in that order, at most
// `prefetch_window` units live at once, so memory stays within the shards plus the window
// without the host blocking. Gradients are reduce-scattered per bucket into the local
// gradient shard as soon as the bucket's backward checked in; the optimizer steps on the
// shards.
#pragma once

#include <memory>
#include <vector>

#include "core/sharding/engine_base.h"
#include "core/sharding/stage3_schedule.h"
#include "core/storage/full_buffer_pool.h"

namespace hps {

class Stage3Engine final : public EngineBase {
 public:
  static StatusOr<std::unique_ptr<Stage3Engine>> create(std::shared_ptr<Communicator> sharding,
                                                        std::shared_ptr<Communicator> dp,
                                                        const EngineOptions& options);
  ~Stage3Engine() override;

  int32_t stage() const override { return 3; }
  // Allocates the shards and, for initialisation only, full buffers the framework writes
  // its initial values into; broadcast_parameters() shards them and frees them.
  Status seal() override;
  Status broadcast_parameters() override;
  // Valid while the parameter's unit is gathered (or before broadcast_parameters()).
  StatusOr<void*> param_data(size_t index) override;
  // Valid while the unit is gathered; zero when first taken in a micro-batch.
  StatusOr<void*> grad_data(size_t index) override;
  Status gather(int32_t unit) override;
  Status release(int32_t unit) override;
  Status grad_ready(size_t index, Stream* ready) override;
  Status step() override;
  Status synchronize() override;
  // Drops the units gathered before the load (their values are stale).
  Status end_state_load() override;

  // The most bytes held at once since broadcast_parameters().
  uint64_t peak_resident_bytes() const { return peak_resident_; }
  // All-gathers started ahead of their gather() call (prefetch), and gather() calls that
  // found their unit already in flight or arrived.
  uint64_t prefetched_gathers() const { return prefetched_; }
  uint64_t gathers_found_in_flight() const { return found_in_flight_; }
  // release() calls that kept their unit live because the recorded order gathers it next.
  uint64_t releases_kept_live() const { return kept_live_; }
  // Units whose full parameters are live (gathered or in flight) now, and the most at once
  // since broadcast_parameters().
  int32_t live_units() const;
  int32_t peak_live_units() const { return peak_live_units_; }
  // Units prefetched (or kept live) for the recorded order and dropped unused to keep the
  // window when a step gathered another unit (the order changed).
  uint64_t units_dropped() const { return dropped_; }
  // Units in use across a step (gathered, never released), gathered again after the update.
  uint64_t regathered_in_use() const { return regathered_in_use_; }
  // Full buffers taken from the pool since seal(), and those of them allocated afresh.
  uint64_t full_buffers_taken() const { return pool_->takes(); }
  uint64_t fresh_full_buffers() const { return pool_->fresh_allocations(); }
  void release_gathered_units() override;

 private:
  Stage3Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
               EngineOptions options, bool checked_views);
  std::pair<DevicePtr<const void>, DType> parameter_shard(size_t b) const override;
  uint64_t transient_bytes() const override;
  DevicePtr<void> model_parameter_shard(size_t b) const override;
  Status check_has_state() const override;
  Status check_loadable() const override;
  // The collectives' work handles; the units' full buffers stay (views may point there).
  void drop_stage_work() override;
  Status start_gather(size_t b);
  // Buffer b's full parameters into its live `params`: our shard in place, then the
  // all-gather of the others' (on the communicator's stream, after what it waits for).
  Status fill(size_t b);
  struct Unit;
  // Gives a unit's live full parameters back to the pool after their last reader.
  Status drop_parameters(Unit& u);
  // Before gather(unit) makes it live: drops live units not in use, the recorded order's
  // farthest first, while the window would be exceeded.
  Status keep_window(int32_t unit);
  // Buffer b's complete gradients reduce-scattered into its shard (after `ready`, when given).
  Status launch_reduce(size_t b, Stream* ready);
  void note_resident();

  struct Unit {
    std::unique_ptr<FullBuffer> params;  // live full parameters (gathered or in flight)
    std::shared_ptr<Work> gathering;     // the all-gather filling `params`
    bool in_use = false;                 // gathered by the framework and not released
    bool used = false;                   // the compute stream waited for `gathering`
    std::unique_ptr<FullBuffer> grads;   // live full gradients of this micro-batch
    std::shared_ptr<Work> reduced;       // this step's reduction into the shard
  };
  bool initialised_ = false;  // broadcast_parameters() done: the init buffers are gone
  std::unique_ptr<FullBufferPool> pool_;
  std::vector<Unit> buffers_;  // per flat buffer
  // Per buffer: recorded on the optimizer stream after its latest update; its next
  // all-gather (on the communicator's stream) waits for this alone.
  std::vector<std::unique_ptr<Event>> updated_;
  std::vector<bool> updated_recorded_;
  std::unique_ptr<Event> accumulated_;  // the sharding stream's adds, before a step
  std::unique_ptr<Event> read_;         // the compute stream's reads, before a unit's refill
  Stage3Schedule schedule_;
  uint64_t peak_resident_ = 0;
  uint64_t prefetched_ = 0;
  uint64_t found_in_flight_ = 0;
  uint64_t kept_live_ = 0;
  uint64_t dropped_ = 0;
  uint64_t regathered_in_use_ = 0;
  int32_t peak_live_units_ = 0;
};

}  // namespace hps
