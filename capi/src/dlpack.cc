// DLPack tensors: the checks of tensors passed in, the views handed out, and the one
// host/device policy (hps_dlpack_host_data).
#include "capi/src/dlpack.h"

#include <cstdint>
#include <string>

namespace hps::capi {
namespace {

// A DLDevice's type as the integer the caller stored: a foreign or hostile tensor may hold a
// value no DLDeviceType names, and loading that as the enum is undefined.
int32_t device_type_of(const DLDevice& device) { return raw_enum(device.device_type); }

// Host memory: what the CPU may dereference.
bool is_host(const DLDevice& device) {
  const int32_t type = device_type_of(device);
  return type == kDLCPU || type == kDLCUDAHost || type == kDLCUDAManaged;
}

StatusOr<DType> dtype_of(DLDataType t, const char* what) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
    if (t.code == kDLFloat && t.bits == 64) return DType::kFloat64;
    if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
    if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
    if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
    if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
    if (t.code == kDLUInt && t.bits == 8) return DType::kUInt8;
  }
  return invalid_argument(std::string(what) + ": DLPack dtype (code " + std::to_string(t.code) +
                          ", bits " + std::to_string(t.bits) + ", lanes " +
                          std::to_string(t.lanes) +
                          ") is none of hpshard's (float32/64/16, bfloat16, int32/64, uint8)");
}

DLDataType to_dlpack(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kFloat64: return {kDLFloat, 64, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kInt32: return {kDLInt, 32, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
    case DType::kUInt8: return {kDLUInt, 8, 1};
  }
  return {kDLOpaqueHandle, 0, 0};
}

// What a view holds besides the DLManagedTensor it starts with.
struct View {
  DLManagedTensor managed{};  // first: the deleter's argument is this View
  std::shared_ptr<const void> keep;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t born = fork_generation();
};

// In a forked child a view made before the fork is left as it is: what it keeps (an
// engine, a clip) would wait for threads the child does not have when let go.
void delete_view(DLManagedTensor* self) {
  auto* view = static_cast<View*>(self->manager_ctx);
  if (made_before_fork(view)) return;
  delete view;
}

}  // namespace

DLDevice to_dlpack(Device device) {
  if (device.type == DeviceType::kCuda) return {kDLCUDA, device.index};
  return {kDLCPU, 0};
}

std::string dlpack_device_name(DLDevice device) {
  switch (device_type_of(device)) {
    case kDLCPU: return "cpu:0";
    case kDLCUDAHost: return "cuda-host:0";
    case kDLCUDAManaged: return "cuda-managed:0";
    case kDLCUDA: return "cuda:" + std::to_string(device.device_id);
    default: break;
  }
  return "dlpack-device-type-" + std::to_string(device_type_of(device)) + ":" +
         std::to_string(device.device_id);
}

StatusOr<TensorArg> tensor_arg(const DLTensor* tensor, const char* what) {
  if (tensor == nullptr) return invalid_argument(std::string(what) + " is NULL");
  TensorArg arg;
  HPS_ASSIGN_OR_RETURN(arg.dtype, dtype_of(tensor->dtype, what));
  if (is_host(tensor->device)) {
    arg.device = Device::cpu();
  } else if (device_type_of(tensor->device) == kDLCUDA && tensor->device.device_id >= 0) {
    arg.device = Device::cuda(tensor->device.device_id);
  } else {
    return invalid_argument(std::string(what) + ": hpshard has no device for DLPack device " +
                            dlpack_device_name(tensor->device));
  }
  if (tensor->ndim < 0 || tensor->ndim > 64) {
    return invalid_argument(std::string(what) + ": ndim " + std::to_string(tensor->ndim) +
                            " is outside 0..64");
  }
  if (tensor->ndim > 0 && tensor->shape == nullptr) {
    return invalid_argument(std::string(what) + ": shape is NULL");
  }
  uint64_t count = 1;
  for (int i = 0; i < tensor->ndim; ++i) {
    const int64_t d = tensor->shape[i];
    if (d < 0) {
      return invalid_argument(std::string(what) + ": dimension " + std::to_string(i) + " is " +
                              std::to_string(d));
    }
    if (d != 0 && count > UINT64_MAX / static_cast<uint64_t>(d)) {
      return invalid_argument(std::string(what) + ": the element count overflows 64 bits");
    }
    count *= static_cast<uint64_t>(d);
  }
  // Compact row-major: strides NULL, or each the product of the later dimensions
  // (a dimension of size 1 may have any stride; an empty tensor any strides).
  // The products are unsigned: each is at most `count`, which fits 64 bits, but not always 63.
  if (tensor->strides != nullptr && count > 0) {
    uint64_t expected = 1;
    for (int i = tensor->ndim - 1; i >= 0; --i) {
      if (tensor->shape[i] != 1 &&
          (tensor->strides[i] < 0 || static_cast<uint64_t>(tensor->strides[i]) != expected)) {
        return invalid_argument(std::string(what) + ": not contiguous (dimension " +
                                std::to_string(i) + " has stride " +
                                std::to_string(tensor->strides[i]) + ", compact row-major is " +
                                std::to_string(expected) + "); pass a contiguous copy");
      }
      expected *= static_cast<uint64_t>(tensor->shape[i]);
    }
  }
  if (tensor->data == nullptr && count > 0) {
    return invalid_argument(std::string(what) + ": data is NULL");
  }
  const uint64_t bytes = dtype_size(arg.dtype);
  if (count > UINT64_MAX / bytes) {
    return invalid_argument(std::string(what) + ": the size in bytes overflows 64 bits");
  }
  if (tensor->data != nullptr) {
    // data + byte_offset starts the elements: it must not wrap the address space with them,
    // and must be aligned to one (a kernel's loads assume it).
    const auto base = reinterpret_cast<uintptr_t>(tensor->data);
    const uint64_t extent = count * bytes;
    if (tensor->byte_offset > UINTPTR_MAX - base ||
        extent > UINTPTR_MAX - base - tensor->byte_offset) {
      return invalid_argument(std::string(what) + ": byte_offset " +
                              std::to_string(tensor->byte_offset) +
                              " and the size wrap the address space");
    }
    if ((base + tensor->byte_offset) % bytes != 0) {
      return invalid_argument(std::string(what) + ": data + byte_offset is not aligned to its " +
                              std::to_string(bytes) + "-byte elements");
    }
  }
  arg.data =
      tensor->data == nullptr ? nullptr : static_cast<char*>(tensor->data) + tensor->byte_offset;
  arg.count = count;
  return arg;
}

Status check_device(const TensorArg& tensor, const char* what, Device device) {
  if (tensor.device == device) return Status::Ok();
  return invalid_argument(std::string(what) + " is on " +
                          dlpack_device_name(to_dlpack(tensor.device)) +
                          " but the operation runs on " + dlpack_device_name(to_dlpack(device)));
}

Status check_same_dtype(const TensorArg& a, const char* a_name, const TensorArg& b,
                        const char* b_name) {
  if (a.dtype == b.dtype) return Status::Ok();
  return invalid_argument(std::string(a_name) + " is " + std::string(dtype_name(a.dtype)) +
                          " but " + b_name + " is " + std::string(dtype_name(b.dtype)));
}

DLManagedTensor* make_view(std::shared_ptr<const void> keep, void* data, DType dtype,
                           const std::vector<int64_t>& shape, Device device) {
  auto view = std::make_unique<View>();
  view->keep = std::move(keep);
  view->shape = shape;
  view->strides.assign(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) view->strides[i - 1] = view->strides[i] * shape[i];
  DLTensor& t = view->managed.dl_tensor;
  t.data = data;
  t.device = to_dlpack(device);
  t.ndim = static_cast<int>(shape.size());
  t.dtype = to_dlpack(dtype);
  t.shape = view->shape.empty() ? nullptr : view->shape.data();
  t.strides = view->strides.empty() ? nullptr : view->strides.data();
  t.byte_offset = 0;
  view->managed.manager_ctx = view.get();
  view->managed.deleter = delete_view;
  return &view.release()->managed;
}

}  // namespace hps::capi

using hps::capi::guard;

extern "C" {

HPS_API hps_status_t hps_dlpack_host_data(const DLTensor* tensor, void** out_data) {
  HPS_CHECK_ARG(tensor);
  HPS_CHECK_ARG(out_data);
  return guard(__func__, [&]() -> hps::Status {
    if (!hps::capi::is_host(tensor->device)) {
      return hps::failed_precondition(
          "the tensor's memory is on " + hps::capi::dlpack_device_name(tensor->device) +
          ", not the host: it has no host view there. Hand the tensor (or its data address) "
          "to that device's tools");
    }
    *out_data =
        tensor->data == nullptr ? nullptr : static_cast<char*>(tensor->data) + tensor->byte_offset;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_dlpack_release(DLManagedTensor* tensor) {
  return guard(__func__, [&]() -> hps::Status {
    if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
    return hps::Status::Ok();
  });
}

}  // extern "C"
