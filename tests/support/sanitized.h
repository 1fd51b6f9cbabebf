// HPS_TEST_SANITIZED: defined where the test is built with AddressSanitizer,
// ThreadSanitizer or MemorySanitizer, whose allocators reserve address space and keep freed
// memory of their own (tests that measure memory skip there).
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HPS_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define HPS_TEST_SANITIZED 1
#endif
#endif
