#include "core/common/fork_generation.h"

#include <pthread.h>

#include <atomic>

namespace hps {
namespace {

std::atomic<uint64_t> g_generation{0};

void after_fork_in_child() { g_generation.fetch_add(1, std::memory_order_relaxed); }

// Registered when the library loads, before any object can be made.
[[maybe_unused]] const bool g_registered =
    ::pthread_atfork(nullptr, nullptr, after_fork_in_child) == 0;

}  // namespace

uint64_t fork_generation() noexcept { return g_generation.load(std::memory_order_relaxed); }

}  // namespace hps
