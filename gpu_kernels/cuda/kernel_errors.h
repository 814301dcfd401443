// What the CUDA kernels report to the host, and how (plain C++: the bindings export the codes and names, so the
// Python side holds no copy of them).
//
// Two kinds, each one device word (which kernels test) and one record in mapped host memory (which the host reads):
//   failures (failed[0], error[0]): the call's results are invalid and the Buffer stays failed: later data kernels
//     do nothing and every later call raises. The first failure wins.
//   notices (failed[1], error[1]): the call dropped part of its input but everything else is sound (an out-of-range
//     expert index, rows past num_worst_tokens); the host raises it once and re-arms the notice word, and the
//     Buffer stays usable. The first notice since the host last re-armed wins.
#pragma once

#include <stdint.h>

#include "proxy/transfer_cmd.h"  // PORTEP_HD

namespace portep::cuda {

struct KernelError {  // one record of mapped host memory; code 0 = none
  uint32_t code;
  uint32_t rank, src, index;  // the reporting rank, and two code-specific fields (see kKernelErrors)
  int64_t value;              // a code-specific value (bad_expert: the topk_idx entry)
  uint64_t unused;
};
static_assert(sizeof(KernelError) == 32, "the host reads the records as 32-byte blocks");

constexpr uint32_t kErrWaitTimeout = 1, kErrFifoTimeout = 2, kErrSlotOverflow = 3, kErrBadExpert = 4,
                   kErrTooManyRecv = 5, kErrPeerDown = 6, kErrOutOfStep = 7;
constexpr int kNumErrorWords = 2;  // failed[] entries and error[] records: [0] failures, [1] notices

struct KernelErrorInfo {
  uint32_t code;
  const char* name;
  bool notice;
  const char* what;   // what happened
  const char* where;  // how the fields read ({src}, {index}, {value}, {status}: index as a peer status, replaced by
                      // the host)
};
constexpr KernelErrorInfo kKernelErrors[] = {
    {kErrWaitTimeout, "wait_timeout", false, "a signal did not arrive within the timeout",
     "peer rank {src}, index {index}"},
    {kErrFifoTimeout, "fifo_timeout", false, "a FIFO to the proxies had no room within the timeout",
     "rank {src}, stream {index}"},
    {kErrSlotOverflow, "slot_overflow", false,
     "an expert got more selections than num_max_dispatch_tokens_per_rank (duplicate experts in a token's topk_idx?)",
     "token {src}, expert {index}"},
    {kErrBadExpert, "bad_expert", true,
     "topk_idx holds an expert index outside [-1, num_experts); that selection was dropped",
     "token {src}, top-k column {index}, value {value}"},
    {kErrTooManyRecv, "too_many_recv", true,
     "a dispatch received more tokens than num_worst_tokens; the rows past it were dropped",
     "{src} rows received, num_worst_tokens={index}"},
    {kErrPeerDown, "peer_down", false, "a peer will not answer", "peer rank {src} {status}"},
    {kErrOutOfStep, "out_of_step", false, "a peer's data belongs to another call: the ranks are out of step",
     "peer rank {src} sent its call #{index}"},
};

PORTEP_HD constexpr bool is_notice(uint32_t code) { return code == kErrBadExpert || code == kErrTooManyRecv; }

}  // namespace portep::cuda
