// How a rank that ended its group tells its peers why, and how they say it: the same words
// over shared memory (its control block) and TCP (a farewell on its control connections).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace hps {

// The most bytes of a failed rank's message its peers get.
inline constexpr size_t kPeerReasonBytes = 383;

// `why` as it is sent: whole when it fits kPeerReasonBytes, else cut at a UTF-8 character's
// start and ending in "..." (there was more).
std::string reason_to_send(std::string_view why);
// Bytes another process sent as its reason: at most kPeerReasonBytes of them, control bytes
// (and bytes past ASCII unless the whole is UTF-8) replaced by '?'.
std::string reason_received(std::string_view bytes);

// "rank 1 failed an earlier operation (its error: ...)" with `peer` "rank 1" (RankNames);
// without the parenthesis when `reason` is empty.
std::string peer_failed_text(std::string_view peer, std::string_view reason);
// "rank 1 aborted the communicator"
std::string peer_aborted_text(std::string_view peer);

}  // namespace hps
