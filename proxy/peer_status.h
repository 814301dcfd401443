// A peer's status as the peer watch sees it (peer_watch.h), in words host code and kernels share: kernels read a
// mirror of these in mapped host memory. Plain C++, no dependencies.
#pragma once

#include <stdint.h>

namespace portep {

enum PeerStatus : uint32_t { kPeerOk = 0, kPeerRefused = 1, kPeerFailed = 2, kPeerLeft = 3, kPeerGone = 4 };
enum StatusEvent : uint32_t { kEventRefused = 0, kEventFailed = 1, kEventLeft = 2, kNumStatusEvents = 3 };

// A wait on a peer in that status may stop once what the peer sent before had time to arrive (its status can
// overtake its last data).
constexpr uint64_t kPeerGraceNs = 250000000;

}  // namespace portep
