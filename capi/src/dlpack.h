// DLPack tensors at the C boundary: reading the tensors callers pass (collective buffers,
// clipped gradients) and handing out views of library memory that keep their owner alive.
// The host/device policy lives here, once: a tensor is host memory when its device is.
#pragma once

#include <memory>
#include <vector>

#include "capi/src/error.h"
#include "core/common/dtype.h"
#include "core/device/device.h"

namespace hps::capi {

// A tensor a caller passed, checked: compact row-major, one of hpshard's dtypes, a
// device hpshard knows, an element count that fits 64 bits.
struct TensorArg {
  void* data = nullptr;  // dl_tensor.data + byte_offset
  uint64_t count = 0;
  DType dtype = DType::kFloat32;
  Device device;
};

// `what` names the argument in messages ("send"). A NULL tensor is refused.
StatusOr<TensorArg> tensor_arg(const DLTensor* tensor, const char* what);
// INVALID_ARGUMENT unless `tensor` lives on `device` (host memory counts as the CPU).
Status check_device(const TensorArg& tensor, const char* what, Device device);
// The same for several tensors of one operation, which must also share one dtype.
Status check_same_dtype(const TensorArg& a, const char* a_name, const TensorArg& b,
                        const char* b_name);

// A view of `data` (owned by whatever `keep` keeps alive) as a DLManagedTensor whose
// deleter drops `keep`. `shape` empty: a scalar.
DLManagedTensor* make_view(std::shared_ptr<const void> keep, void* data, DType dtype,
                           const std::vector<int64_t>& shape, Device device);

// The DLPack device of an hpshard device, and hpshard's name of a DLPack device
// ("cpu:0", "cuda:1", "dlpack-device-type-9:0").
DLDevice to_dlpack(Device device);
std::string dlpack_device_name(DLDevice device);

}  // namespace hps::capi
