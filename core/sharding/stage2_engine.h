// Stage 2 (ZeRO-2): full parameters stay resident; gradients go into flat bucketed
// buffers; a bucket's reduce-scatter is enqueued as soon as all its parameters checked
// in (while backward goes on); the optimizer steps on the local shard; an all-gather
// brings the updated parameters back, and the next forward's first use of a unit waits
// on it. With a dp group above sharding, the reduced shard is all-reduced over dp.
// Nothing in step() blocks the host.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/sharding/engine_base.h"

namespace hps {

class Stage2Engine final : public EngineBase {
 public:
  static StatusOr<std::unique_ptr<Stage2Engine>> create(std::shared_ptr<Communicator> sharding,
                                                        std::shared_ptr<Communicator> dp,
                                                        const EngineOptions& options);
  ~Stage2Engine() override;

  int32_t stage() const override { return 2; }
  Status seal() override;
  Status broadcast_parameters() override;
  StatusOr<void*> param_data(size_t index) override;
  StatusOr<void*> grad_data(size_t index) override;
  // Before the forward of `unit`: the compute stream waits until the last all-gather of
  // its parameters has arrived (on the CPU calling thread: a dependency wait, counted
  // apart from host syncs; zero once prefetched).
  Status wait_parameters(int32_t unit);
  Status gather(int32_t unit) override { return wait_parameters(unit); }
  // After the forward or backward of `unit`: nothing moves (parameters stay resident); the
  // unit is out of use (as it is after step()), so a state load may come.
  Status release(int32_t unit) override;
  // After backward wrote (added) parameter `index`'s gradient. `ready`: the stream the
  // gradient was produced on (null: the compute stream).
  Status grad_ready(size_t index, Stream* ready = nullptr) override;
  // Enqueues the optimizer step and the parameter all-gathers. Host syncs: none.
  Status step() override;
  Status synchronize() override;
  // All-gathers the loaded parameter shards into the full parameters (collective).
  Status end_state_load() override;

 private:
  using EngineBase::EngineBase;
  std::pair<DevicePtr<const void>, DType> parameter_shard(size_t b) const override;
  DevicePtr<void> model_parameter_shard(size_t b) const override { return own_parameters(b); }
  void drop_stage_work() override;
  // No unit between wait_parameters() and its release() or the step: a load would change
  // parameters and the loss scale under a forward or backward.
  Status check_loadable() const override;
  // Buffer b's slice of the full parameters that this rank owns.
  DevicePtr<void> own_parameters(size_t b) const;
  Status launch_reduce(size_t b, Stream* ready);

  std::vector<std::shared_ptr<Work>> reduced_;   // per bucket: this step's reduction
  std::vector<std::shared_ptr<Work>> gathered_;  // per bucket: the latest all-gather
  std::unique_ptr<Event> widened_;               // the sharding stream's widenings, before a step
  std::vector<uint8_t> in_use_;  // per bucket: its unit waited since the last step, not released
};

}  // namespace hps
