// Fuzzes what a TCP store's server and clients read from a socket: bytes arrive in pieces of
// any size, frames are cut from them under the handshake's and the requests' limits, and
// each frame is read as every message it could be. Whatever parses must encode back to the
// same bytes (the format has one spelling per message), and nothing may read out of bounds,
// allocate what was only announced, or crash.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/comm/tcp_store_protocol.h"

namespace {

using namespace hps;             // NOLINT
using namespace hps::tcp_store;  // NOLINT

void require(bool condition) {
  if (!condition) std::abort();
}

void check_frame(std::string_view payload) {
  if (auto request = parse_request(payload)) {
    require(encode_request(*request) == payload);
    for (const auto& key : request->keys) (void)check_store_key(key);
    if (request->op == Op::kAdd) {
      const std::string current(request->keys[0]);
      (void)store_add_result(request->keys[0], &current, request->number);
    }
    if (request->op == Op::kSet) (void)check_store_value(request->keys[0], request->value.size());
  }
  std::string result;
  if (auto status = parse_response(payload, &result)) {
    require((status->ok() ? encode_ok(result) : encode_error(*status)) == payload);
  }
  if (auto hello = parse_hello(payload)) {
    if (hello->status.message().size() <= 256) require(encode_hello(*hello) == payload);
  }
  if (auto proof = parse_proof(payload)) require(encode_proof(*proof) == payload);
  if (auto welcome = parse_welcome(payload)) {
    if (welcome->status.message().size() <= 256) require(encode_welcome(*welcome) == payload);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // The first byte picks how the stream is cut into reads and whether the handshake's limit
  // applies; the rest is the stream.
  const size_t piece = (data[0] & 0x3F) + 1;
  FrameDecoder decoder((data[0] & 0x40) ? kMaxHandshakeFrame : kMaxFrame);
  std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);
  size_t taken = 0;
  while (!stream.empty()) {
    std::string_view in = stream.substr(0, piece);
    stream.remove_prefix(in.size());
    while (true) {
      const size_t before = in.size();
      const auto state = decoder.feed(&in);
      taken += before - in.size();
      if (state == FrameDecoder::State::kTooLarge) {
        require(decoder.announced() > ((data[0] & 0x40) ? kMaxHandshakeFrame : kMaxFrame));
        return 0;
      }
      if (state == FrameDecoder::State::kMore) {
        require(in.empty());
        break;
      }
      const std::string payload = decoder.take();
      require(payload.size() <= kMaxFrame);
      check_frame(payload);
      // A frame re-framed is the bytes it came from.
      require(frame(payload).size() == payload.size() + 4);
    }
  }
  require(taken == size - 1);
  return 0;
}
