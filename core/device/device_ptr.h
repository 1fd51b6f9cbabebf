// DevicePtr<T>: an address in a device's memory (host memory for the CPU device, GPU memory
// for CUDA). Engine and clip code hold device memory only through it. It has no operator*,
// operator-> or operator[]: a host read of a device scalar cannot be written by accident
// and then pass on the CPU, where it would not fault, while it would fault (or silently
// force a synchronisation) on a GPU. Kernels, communicators and views get the raw address
// with get().
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace hps {

template <typename T>
class DevicePtr {
 public:
  constexpr DevicePtr() = default;
  constexpr DevicePtr(std::nullptr_t) {}  // NOLINT: null converts implicitly
  constexpr explicit DevicePtr(T* address) : address_(address) {}
  // float → const float, float → void, ... as the raw pointers convert.
  template <typename U>
  requires std::is_convertible_v<U*, T*>
  constexpr DevicePtr(DevicePtr<U> other) : address_(other.get()) {}  // NOLINT: as T* does

  // The raw address, for kernels, communicators and views handed to the framework.
  constexpr T* get() const { return address_; }
  constexpr explicit operator bool() const { return address_ != nullptr; }

  // Element arithmetic (not for void).
  template <typename U = T>
  requires(!std::is_void_v<U>) constexpr DevicePtr operator+(size_t elements) const {
    return DevicePtr(address_ + elements);
  }
  // Byte arithmetic, for any T.
  constexpr DevicePtr byte_offset(size_t bytes) const {
    using Byte = std::conditional_t<std::is_const_v<T>, const uint8_t, uint8_t>;
    return DevicePtr(reinterpret_cast<T*>(reinterpret_cast<Byte*>(address_) + bytes));
  }
  // The same address as another element type (the caller knows what lives there); const
  // stays const.
  template <typename U>
  constexpr DevicePtr<U> as() const {
    using Source = std::conditional_t<std::is_const_v<T>, const void, void>;
    return DevicePtr<U>(static_cast<U*>(static_cast<Source*>(address_)));
  }

  friend constexpr bool operator==(DevicePtr, DevicePtr) = default;

 private:
  T* address_ = nullptr;
};

}  // namespace hps
