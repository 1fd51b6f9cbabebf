#include "core/storage/sharded_storage.h"

#include <string>

namespace hps {

StatusOr<std::unique_ptr<ShardedStorage>> ShardedStorage::create(
    const LayoutPlan& plan, Device device, const std::vector<RoleLayout>& layouts, Stream& stream) {
  if (!plan.sealed()) return failed_precondition("storage: the layout plan is not sealed");
  auto storage = std::unique_ptr<ShardedStorage>(new ShardedStorage());
  storage->plan_ = &plan;
  storage->device_ = device;
  const uint64_t alignment = plan.alignment_bytes();
  for (const RoleLayout& layout : layouts) {
    Role& role = storage->roles_[static_cast<int>(layout.role)];
    role.full = layout.full;
    role.model_dtype = layout.model_dtype;
    role.offsets.assign(plan.buffers().size(), kAbsent);
    uint64_t total = 0;
    for (size_t b = 0; b < plan.buffers().size(); ++b) {
      const FlatBuffer& buf = plan.buffers()[b];
      if (!layout.holds(buf)) continue;
      const uint64_t element = layout.model_dtype ? dtype_size(buf.dtype) : sizeof(float);
      const uint64_t elements = layout.full ? buf.numel : buf.shard_numel;
      total = (total + alignment - 1) / alignment * alignment;
      role.offsets[b] = total;
      // The plan caps a buffer at 2^56 elements and the model at far fewer: no overflow.
      total += elements * element;
    }
    if (total == 0) continue;
    HPS_ASSIGN_OR_RETURN(role.memory, DeviceBuffer::allocate(device, total, alignment));
  }
  // Zeroed once every role is allocated: a failed allocation frees memory no stream uses.
  for (Role& role : storage->roles_) {
    if (role.memory.bytes() == 0) continue;
    HPS_RETURN_IF_ERROR(stream.memset_async(role.memory.data().get(), 0, role.memory.bytes()));
  }
  return storage;
}

uint64_t ShardedStorage::count(StorageRole role, size_t b) const {
  const Role& r = roles_[static_cast<int>(role)];
  if (r.offsets.empty() || r.offsets[b] == kAbsent) return 0;
  const FlatBuffer& buf = plan_->buffers()[b];
  return r.full ? buf.numel : buf.shard_numel;
}

DType ShardedStorage::dtype(StorageRole role, size_t b) const {
  return roles_[static_cast<int>(role)].model_dtype ? plan_->buffers()[b].dtype : DType::kFloat32;
}

void ShardedStorage::release(StorageRole role) {
  Role& r = roles_[static_cast<int>(role)];
  r.memory.reset();
  r.offsets.clear();
}

uint64_t ShardedStorage::bytes() const {
  uint64_t n = 0;
  for (const Role& r : roles_) n += r.memory.bytes();
  return n;
}

}  // namespace hps
