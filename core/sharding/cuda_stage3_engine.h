// Stage 3 on CUDA devices over NCCL communicators: the CPU Stage3Engine's protocol
// (shards resident, gather / release per unit, prefetch in the recorded order within the
// window, reduce-scatter per unit, the optimizer on the shards) with every buffer in
// device memory and every dependency an event wait between CUDA streams:
//
//   optimizer stream: own shard → full buffer, optimizer kernels
//   communicator stream: all-gathers, reduce-scatters (after the compute stream's
//                        gradients), accumulation
//   compute stream (the framework's, EngineOptions::compute_stream): waits for a unit's
//                  all-gather in gather(); release() frees the unit in its stream order
//
// Full buffers come from the stream-ordered allocator (cudaMallocAsync / cudaFreeAsync),
// so nothing in a step blocks the host: no synchronize, no device-to-host copy.
// float32 parameters only; dynamic loss scaling is refused (its found-inf flag and step
// bookkeeping live on the CPU engine's stream, not yet on a device).
#pragma once

#include "core/common/config.h"

#if HPS_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <vector>

#include "core/sharding/sharded_engine.h"
#include "core/sharding/stage3_schedule.h"

namespace hps {

class CudaStage3Engine final : public ShardedEngine {
 public:
  static StatusOr<std::unique_ptr<CudaStage3Engine>> create(std::shared_ptr<Communicator> sharding,
                                                            std::shared_ptr<Communicator> dp,
                                                            const EngineOptions& options);
  ~CudaStage3Engine() override;

  int32_t stage() const override { return 3; }
  StatusOr<size_t> add_param(ParamSpec spec) override;
  Status seal() override;
  Status broadcast_parameters() override;
  // Device pointers, valid while the unit is gathered (or before broadcast_parameters()).
  StatusOr<float*> param(size_t index) override;
  StatusOr<float*> grad(size_t index) override;
  StatusOr<void*> param_data(size_t index) override;
  StatusOr<void*> grad_data(size_t index) override;
  Status gather(int32_t unit) override;
  Status release(int32_t unit) override;
  Status grad_ready(size_t index, Stream* ready) override;
  Status step() override;
  Status synchronize() override;
  StatusOr<std::vector<std::vector<float>>> gather_all() override;
  uint64_t resident_bytes() const override;
  uint64_t peak_resident_bytes() const { return peak_resident_; }
  uint64_t prefetched_gathers() const { return prefetched_; }
  const LayoutPlan& plan() const override { return plan_; }
  // Device memory (1.0 and 0: no loss scaling on CUDA yet).
  const float* loss_scale() const override { return device_loss_scale_; }
  const int64_t* skipped_steps() const override { return device_skipped_; }
  int32_t shard_rank() const override { return sharding_->rank(); }

 private:
  CudaStage3Engine(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> dp,
                   EngineOptions options);
  struct Buffer {
    float* params = nullptr;          // live full parameters (gathered or in flight)
    std::shared_ptr<Work> gathering;  // the all-gather filling `params` (owns its event)
    bool in_use = false;
    float* grads = nullptr;         // full gradients of this micro-batch
    std::shared_ptr<Work> reduced;  // this step's reduction into the shard (last of them)
  };

  cudaStream_t compute() const;
  cudaStream_t comm_stream() const;
  cudaStream_t opt_stream() const;
  Status start_gather(size_t b);
  void note_resident();
  Status free_device_memory();

  std::shared_ptr<Communicator> sharding_, dp_;
  EngineOptions options_;
  int32_t device_index_;
  LayoutPlan plan_;
  bool sealed_ = false;
  bool initialised_ = false;
  std::unique_ptr<Stream> optimizer_stream_;
  // Device memory, per buffer: initial full values (until broadcast_parameters()), the
  // fp32 shards, gradient shards, accumulation scratch, optimizer state.
  std::vector<float*> init_, param_shards_, grad_shards_, incoming_, state_a_, state_b_;
  std::vector<Buffer> buffers_;
  // Per buffer: recorded on the optimizer stream after its latest update (null before the
  // first step); its next all-gather waits for this alone.
  std::vector<cudaEvent_t> updated_;
  Stage3Schedule schedule_;  // units, the recorded gather order, check-ins, micro-batches
  int64_t steps_ = 0;
  float* device_mean_scale_ = nullptr;
  float* device_loss_scale_ = nullptr;
  int64_t* device_skipped_ = nullptr;
  std::unique_ptr<HybridClip> clip_;
  uint64_t shard_bytes_ = 0;  // every per-buffer shard above, allocated at seal()
  uint64_t live_bytes_ = 0;   // full parameter and gradient buffers not yet freed
  uint64_t peak_resident_ = 0;
  uint64_t prefetched_ = 0;
};

}  // namespace hps

#endif  // HPS_HAVE_CUDA
