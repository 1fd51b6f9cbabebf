// The TCP store's wire protocol, apart from any socket so that it can be tested and fuzzed
// on its own (tests/fuzz/tcp_store_frames_fuzz.cc).
//
// Every message is a frame: a big-endian u32 length, then that many bytes. Integers are
// big-endian; strings are a u32 length then bytes (any bytes, '\0' included).
//
// A connection opens with a handshake, in frames of at most kMaxHandshakeFrame bytes:
//   server hello    u8 version, u8 status; OK: u8 flags (1 = a token is required),
//                   32-byte server nonce; otherwise a message (the server is full, ...)
//   client proof    u8 version, 32-byte client nonce, u8 has_mac [, 32-byte MAC],
//                   string: the client's process (host::Process::encode; may be empty)
//   server welcome  u8 status; OK: u8 has_mac [, 32-byte MAC]; otherwise a message
// MACs are HMAC-SHA256 keyed by the job's token over a label and both nonces, one label
// per direction, so each side proves it knows the token without sending it. Then
//   request   u8 op, then per op   SET key value | GET key timeout_ms | ADD key delta
//                                  CHECK n key... | WAIT n key... timeout_ms
//   response  u8 status; OK: the op's result (GET value, ADD i64, CHECK u8); else a message
// in frames of at most kMaxFrame bytes (a value of kMaxStoreValueBytes and its key fit).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/comm/auth.h"
#include "core/comm/store.h"

namespace hps::tcp_store {

inline constexpr uint8_t kProtocolVersion = 3;
inline constexpr uint32_t kMaxHandshakeFrame = 512;
// The longest process text a proof carries (the frame holds it with the rest).
inline constexpr uint32_t kMaxProofProcess = 400;
inline constexpr uint32_t kMaxFrame = static_cast<uint32_t>(kMaxStoreValueBytes + 64 * 1024);
// The most keys one CHECK or WAIT names (the client splits longer lists): what a parked
// request holds stays near the bytes it took to send it.
inline constexpr uint32_t kMaxRequestKeys = 4096;

enum class Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5 };

using Nonce = std::array<uint8_t, auth::kNonceBytes>;

class Writer {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(uint32_t v);
  void i64(int64_t v);
  void str(std::string_view s);  // the caller keeps s under 4 GiB (frames are far smaller)
  void bytes(const void* data, size_t size) { out_.append(static_cast<const char*>(data), size); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads a payload front to back; every read fails (false) rather than run past the end.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool u8(uint8_t* v);
  bool u32(uint32_t* v);
  bool i64(int64_t* v);
  bool str(std::string* s);
  bool bytes(void* out, size_t size);
  bool keys(std::vector<std::string>* keys);  // u32 n <= kMaxRequestKeys, then n strings
  bool done() const { return pos_ == in_.size(); }
  std::string_view rest() const { return in_.substr(pos_); }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

// The 4-byte header followed by the payload.
std::string frame(std::string_view payload);

// Collects frames from a byte stream that arrives in pieces. The payload grows with the
// bytes that actually arrived: a header announcing a large frame costs nothing until they do.
class FrameDecoder {
 public:
  enum class State { kMore, kFrame, kTooLarge };
  explicit FrameDecoder(uint32_t limit) : limit_(limit) {}
  void set_limit(uint32_t limit) { limit_ = limit; }
  // Consumes bytes from the front of *in until one frame is complete (kFrame: take() it
  // before feeding more) or *in is empty (kMore). kTooLarge: the header announced more than
  // the limit; the stream is beyond repair.
  State feed(std::string_view* in);
  std::string take();
  uint32_t announced() const { return size_; }  // the current frame's size, once known

 private:
  uint32_t limit_;
  char header_[4] = {};
  size_t header_got_ = 0;
  uint32_t size_ = 0;
  std::string payload_;
  bool complete_ = false;
};

struct Request {
  Op op = Op::kSet;
  std::vector<std::string> keys;  // SET, GET, ADD: one
  std::string value;              // SET
  int64_t number = 0;             // GET, WAIT: timeout in ms; ADD: delta
};
// Nothing when the payload is not exactly one well-formed request.
std::optional<Request> parse_request(std::string_view payload);
std::string encode_request(const Request& request);

// A response: status, then on OK the op's result, otherwise the message.
std::string encode_ok(std::string_view result);
std::string encode_error(const Status& status);
// The status of a response, with *result set to the bytes after it on OK; nothing when
// malformed.
std::optional<Status> parse_response(std::string_view payload, std::string* result);

struct Hello {
  Status status;  // not OK: the server refuses this connection
  bool token_required = false;
  Nonce nonce{};
};
std::string encode_hello(const Hello& hello);
std::optional<Hello> parse_hello(std::string_view payload);

struct Proof {
  Nonce nonce{};
  std::optional<auth::Mac> mac;
  // The client's process as host::Process::encode() writes it, or empty: the serving store,
  // closing, does not wait for a connection whose process has ended (a process it forked
  // holds the socket). Not covered by the MAC: a lie only ends that wait sooner.
  std::string process;
};
std::string encode_proof(const Proof& proof);
std::optional<Proof> parse_proof(std::string_view payload);

struct Welcome {
  Status status;
  std::optional<auth::Mac> mac;
};
std::string encode_welcome(const Welcome& welcome);
std::optional<Welcome> parse_welcome(std::string_view payload);

// The MAC the client (from_client) or the server sends for this pair of nonces.
StatusOr<auth::Mac> handshake_mac(std::string_view token, bool from_client, const Nonce& server,
                                  const Nonce& client);

}  // namespace hps::tcp_store
