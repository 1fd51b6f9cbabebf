// The sharded storages of an engine (DESIGN.md, "Storage layout"): for each flat buffer of
// a LayoutPlan, the device memory of every role the engine's stage needs — parameter
// storage (full parameters, fp32 master shards, the model-dtype shard all-gathers send),
// gradient storage (full gradients, the reduced shard, its fp32 form, accumulation
// scratch) and optimizer state (momentum, exp_avg, exp_avg_sq). One allocation per role
// from the device's allocator; each buffer's region starts on the plan's alignment,
// relative to the device address.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/device/buffer.h"
#include "core/device/stream.h"
#include "core/storage/layout_plan.h"

namespace hps {

enum class StorageRole : int {
  kParams = 0,    // full parameters, model dtype
  kGrads,         // full gradients, model dtype
  kMasters,       // fp32 parameter shard (master weights)
  kWireShard,     // parameter shard in the model dtype (what an all-gather sends)
  kGradShard,     // fp32 reduced gradient shard (what the optimizer reads)
  kReducedShard,  // reduced gradient shard in the model dtype (fp16 / bf16 reductions)
  kIncoming,      // fp32 shard scratch: later micro-batches reduce here, then add
  kMomentum,      // SGD
  kExpAvg,        // AdamW
  kExpAvgSq,      // AdamW
};
inline constexpr int kStorageRoleCount = 10;

// How much of each buffer a role holds, in which dtype, and for which buffers.
struct RoleLayout {
  StorageRole role;
  bool full = false;                             // the whole buffer (else this rank's shard)
  bool model_dtype = false;                      // the buffer's dtype (else fp32)
  std::function<bool(const FlatBuffer&)> holds;  // which buffers get the role
};

class ShardedStorage {
 public:
  // Allocates (zero-filled, on `stream`) every role of `layouts` for `plan` (sealed) on
  // `device`. The memory is reached through get(); zeroing completes in `stream`'s order.
  static StatusOr<std::unique_ptr<ShardedStorage>> create(const LayoutPlan& plan, Device device,
                                                          const std::vector<RoleLayout>& layouts,
                                                          Stream& stream);

  // Role `role` of buffer `b` (null when the role does not hold b).
  template <typename T = void>
  DevicePtr<T> get(StorageRole role, size_t b) const {
    const Role& r = roles_[static_cast<int>(role)];
    if (r.offsets.empty() || r.offsets[b] == kAbsent) return nullptr;
    return r.memory.data<T>().byte_offset(r.offsets[b]);
  }
  bool holds(StorageRole role, size_t b) const { return static_cast<bool>(get(role, b)); }
  // Elements of role `role` for buffer `b` (0 when absent), and their dtype.
  uint64_t count(StorageRole role, size_t b) const;
  DType dtype(StorageRole role, size_t b) const;
  // Frees a role entirely (stage 3's full parameters after initialisation).
  void release(StorageRole role);
  uint64_t bytes() const;
  Device device() const { return device_; }

 private:
  static constexpr uint64_t kAbsent = ~uint64_t{0};
  struct Role {
    bool full = false;
    bool model_dtype = false;
    DeviceBuffer memory;
    std::vector<uint64_t> offsets;  // bytes, per buffer; kAbsent when not held
  };
  const LayoutPlan* plan_ = nullptr;
  Device device_;
  std::array<Role, kStorageRoleCount> roles_;
};

}  // namespace hps
