#include "core/comm/peer_failure.h"

#include "core/common/env.h"

namespace hps {

std::string reason_to_send(std::string_view why) {
  if (why.size() <= kPeerReasonBytes) return std::string(why);
  constexpr std::string_view kCut = "...";
  std::string sent(why.substr(0, utf8_prefix_bytes(why, kPeerReasonBytes - kCut.size())));
  sent += kCut;
  return sent;
}

std::string reason_received(std::string_view bytes) {
  std::string reason(bytes.substr(0, kPeerReasonBytes));
  const bool utf8 = is_utf8(reason);
  for (char& ch : reason) {
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte == 0x7f || (byte >= 0x80 && !utf8)) ch = '?';
  }
  return reason;
}

std::string peer_failed_text(std::string_view peer, std::string_view reason) {
  std::string text(peer);
  text += " failed an earlier operation";
  if (!reason.empty()) {
    text += " (its error: ";
    text += reason;
    text += ")";
  }
  return text;
}

std::string peer_aborted_text(std::string_view peer) {
  return std::string(peer) + " aborted the communicator";
}

}  // namespace hps
