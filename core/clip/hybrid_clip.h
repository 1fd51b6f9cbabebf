// Hybrid global-norm clipping (DESIGN.md, "Hybrid clipping"). Per gradient the squared
// norm goes into D (is_distributed) or N (the rest); D is summed over the sharding,
// tensor (mp) and pipeline groups, N over the sharding and pipeline groups, each once.
// norm = sqrt(D + N); coef = max_norm / (max(norm, max_norm) + 1e-6); gradients *= coef.
// Written once against the device layer and the kernel table: everything is enqueued on
// the caller's stream and the communicators' streams, the partials, the norm and the
// coefficient live in device memory (ClipState) and the host never blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/comm/communicator.h"
#include "core/device/buffer.h"
#include "core/kernels/kernel_table.h"

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
  // The tag its reductions carry (Communicator::all_reduce): kEngineClipTag for an engine's.
  uint64_t tag = kClipTag;
};

class HybridClip {
 public:
  // Any of the groups may be null (or of size 1): it is not reduced over. The groups
  // given must all be on one device (the CPU, or one CUDA device).
  static StatusOr<std::unique_ptr<HybridClip>> create(std::shared_ptr<Communicator> sharding,
                                                      std::shared_ptr<Communicator> mp,
                                                      std::shared_ptr<Communicator> pp,
                                                      const ClipOptions& options);
  HybridClip(const HybridClip&) = delete;
  HybridClip& operator=(const HybridClip&) = delete;
  // Waits (uncounted) for the work the last run() or finish() enqueued: its kernels and
  // collectives use the state and the gradients.
  ~HybridClip();

  // Registration, before seal(). Refuses non-float dtypes and null data.
  Status add_tensor(const ClipTensor& tensor);
  // Collective over the mp group (host-blocking once, at set-up): every mp rank must have
  // registered the same number of tensors with the same flags. Allocates the clip's device
  // state on the communicators' device (the CPU when there are none).
  Status seal();
  bool sealed() const { return sealed_; }

  // Enqueues the clip of the registered gradients on `stream`: the partials, their
  // reduction over the groups, the coefficient and, with scale, the scaling. The norm is
  // copied to *norm_out (device memory of the stream's device; nullable) in stream order.
  // With scale = false the coefficient waits in coefficient() for a fused optimizer. Calls
  // on one clip must use one stream. Host syncs: none. With no communicators, the first
  // run() on a CUDA stream moves the clip's state to that device.
  Status run(Stream& stream, float* norm_out, bool scale = true);

  // The same steps for callers that add the local partial sums themselves (the engines do
  // it in their unscale pass): begin() zeroes the partials of state(), then the caller's
  // kernels add to state()->partials / fixed, then finish() reduces them over the groups
  // and computes the coefficient. All in `stream`'s order.
  Status begin(Stream& stream);
  DevicePtr<ClipState> state() const { return state_.data<ClipState>(); }
  Status finish(Stream& stream, float* norm_out);

  // Device memory holding the latest coefficient (valid in stream order after run() or
  // finish(); 1 before the first), from seal() on.
  const float* coefficient() const;
  const ClipOptions& options() const { return options_; }
  size_t tensor_count() const { return tensors_.size(); }

  // Blocks (uncounted) until what the latest run()/finish() enqueued has completed: what a
  // handle's destroy waits for while views keep the clip (their owner's memory may go).
  void wait_in_flight();
  // wait_in_flight(), then lets the communicators and the registered gradients go: what a
  // handle's destroy does while views keep the clip, so that its groups close with the
  // handle and the views keep only the state's memory. Every call after it but
  // coefficient() is FAILED_PRECONDITION.
  void drop_groups();

 private:
  HybridClip(std::shared_ptr<Communicator> sharding, std::shared_ptr<Communicator> mp,
             std::shared_ptr<Communicator> pp, ClipOptions options);
  // The device state on `device`, its coefficient 1 (on `stream`, or synchronously).
  Status allocate_state(Device device);
  Status check_not_dropped() const;
  // Checks `stream` against the state's device (moving a communicator-less clip's state).
  Status use_stream(Stream& stream);

  std::shared_ptr<Communicator> sharding_, mp_, pp_;
  // The first failure of any of the groups fails the others (a norm reduced over one group
  // after another must not reach peers with what a failed reduction left).
  std::unique_ptr<Communicator::FailureLink> failure_link_;
  ClipOptions options_;
  std::vector<ClipTensor> tensors_;
  bool sealed_ = false;
  bool has_groups_ = false;
  bool dropped_ = false;  // drop_groups()
  // Records `done_` on `stream`: everything the latest run enqueued there is behind it.
  void mark_enqueued(Stream& stream);
  DeviceBuffer state_;  // one ClipState
  // States a communicator-less clip moved away from: kept, so that coefficient addresses
  // taken before the move stay readable memory.
  std::vector<DeviceBuffer> retired_;
  const Kernels* kernels_ = nullptr;
  // The latest finish()'s collectives and the end of the latest run()/finish() on its
  // stream, waited for by the destructor.
  std::vector<std::shared_ptr<Work>> in_flight_;
  std::unique_ptr<Event> done_;
};

}  // namespace hps
