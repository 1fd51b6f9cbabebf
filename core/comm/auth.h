// Secrets for the stores and control connections: random bytes from the kernel, job
// tokens, HMAC-SHA256 (OpenSSL's libcrypto) and a comparison whose time does not depend on
// where two secrets differ.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/common/status.h"

namespace hps::auth {

inline constexpr size_t kMacBytes = 32;    // HMAC-SHA256
inline constexpr size_t kNonceBytes = 32;  // challenges
// A token longer than this is refused (it is a secret, not a payload).
inline constexpr size_t kMaxTokenBytes = 1024;

using Mac = std::array<uint8_t, kMacBytes>;

// Whether this build can compute HMACs (it was built with OpenSSL's libcrypto).
bool hmac_available();

// Fills `out` from the kernel's random source (getrandom).
Status random_bytes(void* out, size_t size);

// A fresh token: 32 random bytes as 64 lowercase hex digits.
StatusOr<std::string> new_token();

// HMAC-SHA256 of `message` keyed by `key`; UNAVAILABLE when !hmac_available().
StatusOr<Mac> hmac_sha256(std::string_view key, std::string_view message);

// Equality of two byte strings of `size` bytes, in time independent of their contents.
bool equal_secrets(const void* a, const void* b, size_t size);

// INVALID_ARGUMENT naming `what` when `token` is empty or longer than kMaxTokenBytes.
Status check_token(std::string_view token, std::string_view what);

}  // namespace hps::auth
