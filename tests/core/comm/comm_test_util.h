// Helpers for multi-rank tests: ranks as threads over one in-memory store, and typed
// element access for every dtype.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "core/comm/communicator.h"
#include "core/common/half.h"

namespace hps::testing_util {

// Death-test predicate: the child was killed by SIGSEGV, or exited with the code of a
// sanitizer that caught the fault and reported it (AddressSanitizer 1, ThreadSanitizer 66);
// never an abort.
inline bool faulted_on_access(int status) {
  if (WIFSIGNALED(status)) return WTERMSIG(status) == SIGSEGV;
  return WIFEXITED(status) && (WEXITSTATUS(status) == 1 || WEXITSTATUS(status) == 66);
}

// Runs fn(rank, communicator) on `size` threads; each creates its communicator first.
inline void run_ranks(int32_t size, const std::function<void(int32_t, Communicator&)>& fn,
                      CommOptions options = {}) {
  if (options.timeout == kDefaultCommTimeout) options.timeout = Milliseconds(20'000);
  auto store = make_in_memory_store();
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto comm = create_communicator(store, r, size, Device::cpu(), options);
      ASSERT_TRUE(comm.ok()) << comm.status().to_string();
      fn(r, **comm);
    });
  }
  for (auto& t : threads) t.join();
}

// Waits until ready() holds, looking every 5 ms: a rank thread waiting for another's
// progress. After `limit` it fails the test and returns false, so a rank that never gets
// there ends the test with a failure rather than hanging it until CTest's timeout.
inline bool wait_until(const std::function<bool()>& ready,
                       std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) {
      ADD_FAILURE() << "what a rank waited for did not happen within " << limit.count() << " ms";
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

inline void store_element(DType dtype, void* base, size_t i, double v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DType::kFloat64: static_cast<double*>(base)[i] = v; return;
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[i] = float_to_half_bits(static_cast<float>(v));
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(static_cast<float>(v));
      return;
    case DType::kInt32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::kInt64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::kUInt8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
  }
}

inline double load_element(DType dtype, const void* base, size_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat64: return static_cast<const double*>(base)[i];
    case DType::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kInt32: return static_cast<const int32_t*>(base)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::kUInt8: return static_cast<const uint8_t*>(base)[i];
  }
  return 0;
}

// A buffer of `count` elements of `dtype`.
struct Buffer {
  Buffer(DType d, size_t n) : dtype(d), count(n), bytes(n * dtype_size(d) + 1) {}
  void* data() { return bytes.data(); }
  double at(size_t i) const { return load_element(dtype, bytes.data(), i); }
  void set(size_t i, double v) { store_element(dtype, bytes.data(), i, v); }
  DType dtype;
  size_t count;
  std::vector<uint8_t> bytes;
};

}  // namespace hps::testing_util
