// Host "kernels" that drive a Channel the way GPU kernels will: many producer threads pushing WRITE and
// SIGNAL commands to random peers, a receiver-side checker that validates data at the instant each signal
// becomes visible, and a write+signal ping-pong for latency. Used by tests and by the channel benchmark.
//
// Memory layout in each rank's data region, with S = slot bytes (max message rounded up to 16), N ranks,
// P producers, M messages per producer:
//   send area  [0, N*P*M*S)            message m from producer p to dst d at ((p*N + d)*M + m) * S
//   recv area  [N*P*M*S, 2*N*P*M*S)    message m of stream (src, p)   at recv_base + ((src*P + p)*M + m) * S
// Producer p uses stream p towards every destination; message bytes are a hash of (seed, src, p, dst, m, i).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "proxy/channel.h"

namespace portep {

struct TrafficPlan {
  int producers = 4;
  int messages_per_producer = 1000;
  uint32_t max_message_bytes = 256;
  uint32_t signal_every = 8;  // a signal follows a write with probability 1/signal_every
  uint64_t seed = 1;
};

uint64_t traffic_region_bytes(const TrafficPlan& p, int num_ranks);

struct ProducerResult {
  uint64_t commands = 0;
  double push_seconds = 0;   // until the last command was pushed
  double total_seconds = 0;  // until quiet() returned: everything delivered
};

// Runs plan.producers threads on this rank, then quiet(). Throws on any producer or proxy error.
ProducerResult run_producers(Channel& ch, const TrafficPlan& plan);

struct CheckResult {
  uint64_t observations = 0;  // signal increases observed (each one verified on the spot)
  uint64_t messages_checked = 0;
  uint64_t violations = 0;  // messages not (fully) in place when a signal covering them was visible
  uint64_t streams_final = 0;
  std::string first_violation;
};

// Watches every (src, producer) slot of this rank until all streams are final or timeout_s passes (then
// throws). Verifies each newly covered message the moment its signal is seen, and everything at the end.
CheckResult run_checker(Channel& ch, const TrafficPlan& plan, double timeout_s);

// Round trips of `bytes`-byte write+signal between this rank and peer on stream 0. `base` is the count of
// slot (peer, stream 0) read by the caller before a barrier that both ranks pass before calling (reading it
// here could race with the peer's first message). The initiator returns one latency (ns) per iteration; the
// responder returns an empty vector.
std::vector<double> run_pingpong(Channel& ch, int peer, bool initiator, int iterations, uint32_t bytes, uint64_t base,
                                 double timeout_s);

}  // namespace portep
