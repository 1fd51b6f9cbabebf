#include "core/comm/tcp_store_protocol.h"

#include <algorithm>
#include <cstring>

namespace hps::tcp_store {
namespace {

// Error messages travel in handshake frames too: keep them well inside one.
constexpr size_t kMaxHandshakeMessage = 256;

// A status byte from the wire: OK or one of the known codes.
std::optional<StatusCode> status_code_from_wire(uint8_t byte) {
  if (byte > static_cast<uint8_t>(StatusCode::kBackendError)) return std::nullopt;
  return static_cast<StatusCode>(byte);
}

void put_status(Writer& w, const Status& status, size_t max_message) {
  w.u8(static_cast<uint8_t>(status.code()));
  if (!status.ok()) w.str(std::string_view(status.message()).substr(0, max_message));
}

// The status at the front of a payload; a non-OK one must be followed by its message.
std::optional<Status> get_status(Reader& r) {
  uint8_t byte = 0;
  if (!r.u8(&byte)) return std::nullopt;
  auto code = status_code_from_wire(byte);
  if (!code) return std::nullopt;
  if (*code == StatusCode::kOk) return Status::Ok();
  std::string message;
  if (!r.str(&message)) return std::nullopt;
  return Status(*code, std::move(message));
}

bool get_mac(Reader& r, std::optional<auth::Mac>* mac) {
  uint8_t has = 0;
  if (!r.u8(&has) || has > 1) return false;
  if (has) {
    auth::Mac m{};
    if (!r.bytes(m.data(), m.size())) return false;
    *mac = m;
  }
  return true;
}

void put_mac(Writer& w, const std::optional<auth::Mac>& mac) {
  w.u8(mac ? 1 : 0);
  if (mac) w.bytes(mac->data(), mac->size());
}

}  // namespace

void Writer::u32(uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) u8(static_cast<uint8_t>(v >> shift));
}

void Writer::i64(int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int shift = 56; shift >= 0; shift -= 8) u8(static_cast<uint8_t>(u >> shift));
}

void Writer::str(std::string_view s) {
  u32(static_cast<uint32_t>(s.size()));
  out_.append(s);
}

bool Reader::u8(uint8_t* v) {
  if (pos_ >= in_.size()) return false;
  *v = static_cast<uint8_t>(in_[pos_++]);
  return true;
}

bool Reader::u32(uint32_t* v) {
  if (in_.size() - pos_ < 4) return false;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r = (r << 8) | static_cast<uint8_t>(in_[pos_++]);
  *v = r;
  return true;
}

bool Reader::i64(int64_t* v) {
  if (in_.size() - pos_ < 8) return false;
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r = (r << 8) | static_cast<uint8_t>(in_[pos_++]);
  *v = static_cast<int64_t>(r);
  return true;
}

bool Reader::str(std::string* s) {
  uint32_t n = 0;
  if (!u32(&n) || n > in_.size() - pos_) return false;
  s->assign(in_.substr(pos_, n));
  pos_ += n;
  return true;
}

bool Reader::bytes(void* out, size_t size) {
  if (size > in_.size() - pos_) return false;
  std::memcpy(out, in_.data() + pos_, size);
  pos_ += size;
  return true;
}

bool Reader::keys(std::vector<std::string>* keys) {
  uint32_t n = 0;
  // Each key takes at least its 4-byte length: bounds n before reserving.
  if (!u32(&n) || n > kMaxRequestKeys || n > (in_.size() - pos_) / 4) return false;
  keys->resize(n);
  for (auto& k : *keys) {
    if (!str(&k)) return false;
  }
  return true;
}

std::string frame(std::string_view payload) {
  Writer w;
  w.u32(static_cast<uint32_t>(payload.size()));
  w.bytes(payload.data(), payload.size());
  return w.take();
}

FrameDecoder::State FrameDecoder::feed(std::string_view* in) {
  if (complete_) return State::kFrame;
  if (header_got_ < sizeof header_) {
    const size_t n = std::min(sizeof header_ - header_got_, in->size());
    std::memcpy(header_ + header_got_, in->data(), n);
    header_got_ += n;
    in->remove_prefix(n);
    if (header_got_ < sizeof header_) return State::kMore;
    Reader(std::string_view(header_, sizeof header_)).u32(&size_);
    if (size_ > limit_) return State::kTooLarge;
  }
  if (size_ > limit_) return State::kTooLarge;
  const size_t n = std::min<size_t>(size_ - payload_.size(), in->size());
  payload_.append(in->data(), n);
  in->remove_prefix(n);
  if (payload_.size() < size_) return State::kMore;
  complete_ = true;
  return State::kFrame;
}

std::string FrameDecoder::take() {
  std::string out = std::move(payload_);
  payload_.clear();
  header_got_ = 0;
  size_ = 0;
  complete_ = false;
  return out;
}

std::optional<Request> parse_request(std::string_view payload) {
  Reader r(payload);
  uint8_t op = 0;
  if (!r.u8(&op)) return std::nullopt;
  Request q;
  q.op = static_cast<Op>(op);
  bool ok = false;
  switch (q.op) {
    case Op::kSet:
      q.keys.resize(1);
      ok = r.str(&q.keys[0]) && r.str(&q.value);
      break;
    case Op::kGet:
    case Op::kAdd:
      q.keys.resize(1);
      ok = r.str(&q.keys[0]) && r.i64(&q.number);
      break;
    case Op::kCheck: ok = r.keys(&q.keys); break;
    case Op::kWait: ok = r.keys(&q.keys) && r.i64(&q.number); break;
  }
  if (!ok || !r.done()) return std::nullopt;
  return q;
}

std::string encode_request(const Request& q) {
  Writer w;
  w.u8(static_cast<uint8_t>(q.op));
  switch (q.op) {
    case Op::kSet:
      w.str(q.keys.at(0));
      w.str(q.value);
      break;
    case Op::kGet:
    case Op::kAdd:
      w.str(q.keys.at(0));
      w.i64(q.number);
      break;
    case Op::kCheck:
    case Op::kWait:
      w.u32(static_cast<uint32_t>(q.keys.size()));
      for (const auto& k : q.keys) w.str(k);
      if (q.op == Op::kWait) w.i64(q.number);
      break;
  }
  return w.take();
}

std::string encode_ok(std::string_view result) {
  Writer w;
  w.u8(static_cast<uint8_t>(StatusCode::kOk));
  w.bytes(result.data(), result.size());
  return w.take();
}

std::string encode_error(const Status& status) {
  Writer w;
  put_status(w, status, status.message().size());
  return w.take();
}

std::optional<Status> parse_response(std::string_view payload, std::string* result) {
  Reader r(payload);
  auto status = get_status(r);
  if (!status) return std::nullopt;
  if (status->ok()) {
    result->assign(r.rest());
  } else if (!r.done()) {
    return std::nullopt;
  }
  return status;
}

std::string encode_hello(const Hello& hello) {
  Writer w;
  w.u8(kProtocolVersion);
  put_status(w, hello.status, kMaxHandshakeMessage);
  if (hello.status.ok()) {
    w.u8(hello.token_required ? 1 : 0);
    w.bytes(hello.nonce.data(), hello.nonce.size());
  }
  return w.take();
}

std::optional<Hello> parse_hello(std::string_view payload) {
  Reader r(payload);
  uint8_t version = 0;
  if (!r.u8(&version) || version != kProtocolVersion) return std::nullopt;
  Hello hello;
  auto status = get_status(r);
  if (!status) return std::nullopt;
  hello.status = *status;
  if (status->ok()) {
    uint8_t flags = 0;
    if (!r.u8(&flags) || flags > 1 || !r.bytes(hello.nonce.data(), hello.nonce.size())) {
      return std::nullopt;
    }
    hello.token_required = flags == 1;
  }
  if (!r.done()) return std::nullopt;
  return hello;
}

std::string encode_proof(const Proof& proof) {
  Writer w;
  w.u8(kProtocolVersion);
  w.bytes(proof.nonce.data(), proof.nonce.size());
  put_mac(w, proof.mac);
  w.str(std::string_view(proof.process).substr(0, kMaxProofProcess));
  return w.take();
}

std::optional<Proof> parse_proof(std::string_view payload) {
  Reader r(payload);
  uint8_t version = 0;
  Proof proof;
  if (!r.u8(&version) || version != kProtocolVersion ||
      !r.bytes(proof.nonce.data(), proof.nonce.size()) || !get_mac(r, &proof.mac) ||
      !r.str(&proof.process) || proof.process.size() > kMaxProofProcess || !r.done()) {
    return std::nullopt;
  }
  return proof;
}

std::string encode_welcome(const Welcome& welcome) {
  Writer w;
  put_status(w, welcome.status, kMaxHandshakeMessage);
  if (welcome.status.ok()) put_mac(w, welcome.mac);
  return w.take();
}

std::optional<Welcome> parse_welcome(std::string_view payload) {
  Reader r(payload);
  Welcome welcome;
  auto status = get_status(r);
  if (!status) return std::nullopt;
  welcome.status = *status;
  if (status->ok() && !get_mac(r, &welcome.mac)) return std::nullopt;
  if (!r.done()) return std::nullopt;
  return welcome;
}

StatusOr<auth::Mac> handshake_mac(std::string_view token, bool from_client, const Nonce& server,
                                  const Nonce& client) {
  std::string message = from_client ? "hpshard-store/client" : "hpshard-store/server";
  message.append(reinterpret_cast<const char*>(server.data()), server.size());
  message.append(reinterpret_cast<const char*>(client.data()), client.size());
  return auth::hmac_sha256(token, message);
}

}  // namespace hps::tcp_store
