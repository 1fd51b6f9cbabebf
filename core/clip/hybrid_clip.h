// Hybrid global-norm clipping (DESIGN.md, "Hybrid clipping"). Per gradient the squared
// norm goes into D (is_distributed) or N (the rest); D is summed over the sharding,
// tensor (mp) and pipeline groups, N over the sharding and pipeline groups, each once.
// norm = sqrt(D + N); coef = max_norm / (max(norm, max_norm) + 1e-6); gradients *= coef.
// Everything is enqueued on the caller's stream and the communicators' streams: the
// norm and the coefficient never leave the device, the host never blocks. Gradients on a
// CUDA device (CUDA communicators and stream) run the kernels of kernels/cuda/norm.cu.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/comm/communicator.h"
#include "core/kernels/norm.h"

namespace hps {

struct ClipTensor {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  bool is_distributed = false;    // split across mp: its norm is summed over mp
  bool need_clip = true;          // false: neither counted nor scaled
  bool shared_not_first = false;  // a pipeline-shared copy: not counted (still scaled)
};

struct ClipOptions {
  double max_norm = 1.0;
  // Exact fixed-point partial sums: the norm is bitwise identical whatever the dp /
  // sharding / mp / pp layout of the same gradients.
  bool deterministic = false;
};

class HybridClip {
 public:
  // Any of the groups may be null (or of size 1): it is not reduced over. The groups
  // given must all be on one device (the CPU, or one CUDA device).
  static StatusOr<std::unique_ptr<HybridClip>> create(std::shared_ptr<Communicator> sharding,
                                                      std::shared_ptr<Communicator> mp,
                                                      std::shared_ptr<Communicator> pp,
                                                      const ClipOptions& options);
  ~HybridClip();  // frees the device buffers (cudaFree waits for work still using them)
  HybridClip(const HybridClip&) = delete;
  HybridClip& operator=(const HybridClip&) = delete;

  // Registration, before seal(). Refuses non-float dtypes and null data.
  Status add_tensor(const ClipTensor& tensor);
  // Collective over the mp group (host-blocking once, at set-up): every mp rank must have
  // registered the same number of tensors with the same flags. On CUDA it also allocates
  // the clip's device buffers (partials, coefficient, scratch), once.
  Status seal();
  bool sealed() const { return sealed_; }

  // Enqueues the clip of the registered gradients on `stream` (a CPU stream for CPU
  // gradients). The norm is written to *norm_out (device memory; nullable) when the
  // stream gets there. With scale = false the gradients are left alone and the
  // coefficient waits in coefficient() for a fused optimizer. Calls on one clip must use
  // one stream. Host syncs: none. On CUDA the stream must be on the communicators'
  // device; with no communicators, the first run() picks the device.
  Status run(Stream& stream, float* norm_out, bool scale = true);

  // Device memory holding the latest coefficient (valid in stream order after run()). On
  // CUDA, from seal() (or, with no communicators, the first run()) on.
  const float* coefficient() const {
    return device_coefficient_ != nullptr ? device_coefficient_ : &state_->coefficient;
  }
  const ClipOptions& options() const { return options_; }
  size_t tensor_count() const { return tensors_.size(); }

 private:
  HybridClip(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> mp,
             std::shared_ptr<Communicator> pp, ClipOptions options);

  // What travels: float mode {D, N}; deterministic mode D's slots then N's slots.
  struct State {
    double partials[2] = {0, 0};
    FixedSquares fixed[2];
    float coefficient = 1.0f;
  };
  // Reduces `count` elements of the partials over `comm` after everything on `after`.
  StatusOr<std::shared_ptr<Work>> reduce_over(Communicator& comm, bool both, Stream& after);
  // The mp flags check of seal() with the fingerprints in device memory (NCCL).
  Status check_mp_flags_on_device(uint64_t mine, std::vector<uint64_t>& all);
  // The CUDA path: device buffers (allocated once) and run() on a CUDA stream.
  Status allocate_device_state(Device device, bool initialize_coefficient);
  Status run_cuda(Stream& stream, float* norm_out, bool scale);

  std::shared_ptr<Communicator> sharding_, mp_, pp_;
  ClipOptions options_;
  std::vector<ClipTensor> tensors_;
  bool sealed_ = false;
  std::unique_ptr<State> state_;  // stable address: stream tasks and collectives use it
  // The communicators' device (CPU when there are none, until a CUDA run() sets it).
  Device device_ = Device::cpu();
  // On CUDA: one allocation holding a State-like block and the reduction scratch.
  void* device_memory_ = nullptr;
  float* device_coefficient_ = nullptr;
};

}  // namespace hps
