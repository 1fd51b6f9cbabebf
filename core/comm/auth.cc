#include "core/comm/auth.h"

#include <sys/random.h>

#include <cerrno>
#include <system_error>

#include "core/common/config.h"
#if HPS_HAVE_OPENSSL
#include <openssl/evp.h>
#include <openssl/hmac.h>
#endif

namespace hps::auth {

bool hmac_available() { return HPS_HAVE_OPENSSL != 0; }

Status random_bytes(void* out, size_t size) {
  auto* p = static_cast<uint8_t*>(out);
  while (size > 0) {
    const ssize_t n = ::getrandom(p, size, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return backend_error("getrandom: " +
                           std::error_code(errno, std::generic_category()).message());
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

StatusOr<std::string> new_token() {
  uint8_t bytes[32];
  HPS_RETURN_IF_ERROR(random_bytes(bytes, sizeof bytes));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  token.reserve(2 * sizeof bytes);
  for (uint8_t b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 0xF];
  }
  return token;
}

StatusOr<Mac> hmac_sha256(std::string_view key, std::string_view message) {
#if HPS_HAVE_OPENSSL
  Mac mac{};
  unsigned int length = 0;
  if (::HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac.data(),
             &length) == nullptr ||
      length != mac.size()) {
    return backend_error("HMAC-SHA256 failed in libcrypto");
  }
  return mac;
#else
  (void)key;
  (void)message;
  return unavailable(
      "this build of hpshard has no OpenSSL (libcrypto): it cannot check a store token");
#endif
}

bool equal_secrets(const void* a, const void* b, size_t size) {
  // Every byte is visited whatever the first difference: the time tells nothing.
  const auto* x = static_cast<const volatile uint8_t*>(a);
  const auto* y = static_cast<const volatile uint8_t*>(b);
  uint8_t difference = 0;
  for (size_t i = 0; i < size; ++i) difference = static_cast<uint8_t>(difference | (x[i] ^ y[i]));
  return difference == 0;
}

Status check_token(std::string_view token, std::string_view what) {
  if (token.empty()) return invalid_argument(std::string(what) + " is empty");
  if (token.size() > kMaxTokenBytes) {
    return invalid_argument(std::string(what) + " has " + std::to_string(token.size()) +
                            " bytes; at most " + std::to_string(kMaxTokenBytes) + " are allowed");
  }
  return Status::Ok();
}

}  // namespace hps::auth
