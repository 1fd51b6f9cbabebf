// What stage 2 and stage 3 share: the communicators, the layout, the streams (the
// framework's compute stream and the engine's optimizer stream), the sharded storages, the
// sharded optimizer and the gradient buckets' check-ins, and the calls that do not depend
// on the stage. Each stage adds only its protocol (stage2_engine.cc, stage3_engine.cc).
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/checkpoint/checkpointable.h"
#include "core/kernels/kernel_table.h"
#include "core/sharding/grad_buckets.h"
#include "core/sharding/sharded_engine.h"
#include "core/sharding/sharded_optimizer.h"
#include "core/storage/sharded_storage.h"

namespace hps {

class EngineBase : public ShardedEngine, public Checkpointable {
 public:
  ~EngineBase() override = default;

  StatusOr<size_t> add_param(ParamSpec spec) override;
  Status set_model_parallel_groups(std::shared_ptr<Communicator> mp,
                                   std::shared_ptr<Communicator> pp) override;
  StatusOr<float*> param(size_t index) override;
  StatusOr<float*> grad(size_t index) override;
  StatusOr<std::vector<std::vector<float>>> gather_all() override;
  const LayoutPlan& plan() const override { return plan_; }
  int32_t shard_rank() const override { return shard_rank_; }
  Device device() const override { return device_; }
  const float* loss_scale() const override;
  Status set_learning_rate(float learning_rate) override;
  const int64_t* skipped_steps() const override;
  const float* grad_norm() const override;
  uint64_t resident_bytes() const override;
  Status drop_groups() override;
  int64_t steps_taken() const override { return steps_; }
  // The step pipeline (its step state and clip state in device memory); null before seal().
  const ShardedOptimizer* optimizer() const { return optimizer_.get(); }

  // ---- Checkpointable (core/checkpoint/checkpointable.h) ----
  // The parameter shards (model dtype), fp32 masters, optimizer state and the step state,
  // on the engine's device; the optimizer stream writes all of them last.
  StatusOr<std::vector<StateTensor>> state_tensors() override;
  Stream& state_stream() override { return optimizer_stream(); }
  CheckpointTopology checkpoint_topology() const override;
  std::vector<Communicator*> model_parallel_groups() const override;
  const EngineOptions& checkpoint_options() const override { return options_; }
  // Between steps only (no gradient checked in since the last step(); stage 3: no unit
  // gathered); waits for the work in flight.
  Status begin_state_load() override;
  Status restart_loss_scaling() override;

 protected:
  EngineBase(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
             EngineOptions options);
  // The streams and kernels of the sharding communicator's device.
  Status init_device();
  // seal(): refuses a second seal and an empty model, checks every rank of both groups
  // registered the same model, lays it out, allocates `roles` plus the optimizer state,
  // creates the optimizer, then runs the stage's own set-up (`rest`). A failure anywhere
  // (an allocation, say) leaves the engine unsealed, as before the call.
  Status seal_storage(std::vector<RoleLayout> roles, const std::function<Status()>& rest);
  // Parameters broadcast from rank 0 of the sharding group, then of the dp group, in
  // `full` (buffer b's full parameters, model dtype). Host-blocking (set-up).
  Status broadcast_full(const std::function<DevicePtr<void>(size_t)>& full);
  Stream& compute() { return *compute_; }
  Stream& optimizer_stream() { return *optimizer_stream_; }
  // The stream a reduction of the framework's gradients must follow.
  Stream& gradients_from(Stream* ready) { return ready != nullptr ? *ready : compute(); }
  // grad_ready(index, ready) after the check-in: when the parameter's bucket is complete,
  // starts the reductions whose turn has come, in GradBuckets' order, each by
  // `reduce(bucket, stream its reduction must follow)`. A bucket complete before its turn
  // keeps its gradients' point on their stream (an event); when its turn comes the
  // sharding stream waits for it and `reduce` gets null. A micro-batch whose gradients stay
  // in their full buffers (`reduces` false: stage 2 before the last micro-batch) only
  // passes the turns: no event, no wait, no `reduce`.
  Status reduce_in_order(size_t index, Stream* ready, bool reduces,
                         const std::function<Status(size_t, Stream*)>& reduce);
  // The tag of bucket b's collectives (Communicator::all_reduce): ranks whose collectives
  // at one place are of different buckets are refused where arguments are checked.
  static uint64_t bucket_tag(size_t b) { return static_cast<uint64_t>(b) + 1; }
  // `consumer` waits (device-side; on the CPU calling thread a dependency wait) for
  // `work`, and its failure is reported once known.
  Status wait_for(Stream& consumer, Work& work);
  // 1 / (ranks that hold replicas of a gradient × micro-batches): the mean's factor.
  float mean_scale() const;
  // step(): after the optimizer's work is enqueued, marks the optimizer stream (the step's
  // loss-scaling state is updated by then).
  Status stepped();
  // A unit none of whose buffers is updated by the optimizer (only frozen parameters) has
  // no all-gather that follows the step: the compute stream waits for the last step, so
  // that the loss scale read after the unit's wait is that step's.
  Status wait_stepped(bool unit_has_update);
  // end_state_load(): an engine without dynamic loss scaling keeps a loss scale of 1 (and
  // no good-step count) whatever the checkpoint's engine used. Host-blocking.
  Status settle_loaded_scaling();
  // The loss scale set to `scale` and the good-step count to 0, on the optimizer stream,
  // waited for (host-blocking: load time only).
  Status reset_loss_scaling(float scale);
  // Buffer b's fp32 parameter shard (or, for a frozen 16-bit buffer, its model-dtype
  // shard): what gather_all() gathers.
  virtual std::pair<DevicePtr<const void>, DType> parameter_shard(size_t b) const = 0;
  // Bytes held outside the storages (stage 3's full buffers).
  virtual uint64_t transient_bytes() const { return 0; }
  // Buffer b's parameter shard in the model dtype: what "param/<p>" of a checkpoint holds.
  virtual DevicePtr<void> model_parameter_shard(size_t b) const = 0;
  // The stage's own reason it has no state to save or load yet (stage 3: before
  // broadcast_parameters() the shards do not exist).
  virtual Status check_has_state() const { return Status::Ok(); }
  // The stage's own reasons a load must wait (stage 3: no state yet, a gathered unit).
  virtual Status check_loadable() const { return check_has_state(); }
  // The ShardStep of trainable buffer b with its clip spans; the stage fills in where its
  // gradients and parameters are.
  ShardStep shard_step(size_t b) const;
  Status check_sealed(const char* call) const;
  // FAILED_PRECONDITION once drop_groups() has run.
  Status check_not_dropped() const;
  // drop_groups()'s part in the stage: its pending collectives' work handles.
  virtual void drop_stage_work() = 0;

  // Collective over the engine's groups (seal(), host-blocking): the ranks of sharding and
  // dp registered the same model; the mp and pp groups are axes of the same topology as
  // sharding and dp (their members share this rank's other coordinates); the mp ranks
  // registered the same clip flags. Then every rank learns whether any rank found a
  // mismatch, so all return INVALID_ARGUMENT together (the finder naming it).
  Status agree_on_registrations();
  // Part of it, first: the same sizes of model-parallel groups (or none) across the
  // sharding and dp groups.
  Status agree_on_group_sizes();
  // The checks alone: each mismatch adds its kind to `found` and the first sets `first`;
  // a failed collective is returned.
  Status check_registrations(uint64_t& found, Status& first);
  // Collective over `group`, whose ranks registered different parameters: how rank `r`'s
  // registrations differ from this rank's (its first parameter that differs, and in what;
  // or its count); empty when r < 0 (this rank is like every other).
  StatusOr<std::string> explain_param_difference(Communicator& group, int64_t r) const;
  static constexpr uint64_t kSealParamsDiffer = 1, kSealGroupsDiffer = 2, kSealMpFlagsDiffer = 4,
                            kSealOptionsDiffer = 8, kSealNoParams = 16;

  std::shared_ptr<Communicator> sharding_, dp_;
  std::shared_ptr<Communicator> mp_, pp_;  // null: none (set_model_parallel_groups)
  // From seal() on, the first failure of any of the groups fails the others (a step's
  // later collectives must not send what a failed one left to peers on the others).
  std::unique_ptr<Communicator::FailureLink> failure_link_;
  EngineOptions options_;
  Device device_;
  int32_t shard_rank_;
  bool dropped_ = false;  // drop_groups()
  const Kernels* kernels_ = nullptr;
  LayoutPlan plan_;
  bool sealed_ = false;
  int64_t steps_ = 0;
  std::unique_ptr<Stream> default_compute_;  // when the framework names no compute stream
  Stream* compute_ = nullptr;
  std::unique_ptr<Stream> optimizer_stream_;
  std::unique_ptr<Event> stepped_;  // recorded by stepped()
  std::unique_ptr<ShardedStorage> storage_;
  std::unique_ptr<ShardedOptimizer> optimizer_;
  GradBuckets buckets_;
  std::vector<std::unique_ptr<Event>> held_;  // per bucket, for reduce_in_order()
};

// Shared argument checks of the views.
Status check_param_index(const LayoutPlan& plan, size_t index);
// FAILED_PRECONDITION naming the parameter when it is frozen; `what` ends the message.
Status check_trainable(const LayoutPlan& plan, size_t index, const char* what);
// OK when parameter `index` is float32 (its float* views); else FAILED_PRECONDITION.
Status check_float32_view(const LayoutPlan& plan, size_t index);

}  // namespace hps
