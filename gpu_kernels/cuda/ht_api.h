// Host entry points of the CUDA normal-mode (HT) kernels between ranks that store into each other's memory
// (one node, NVLink through CUDA IPC): ht_notify.cu, ht_dispatch.cu, ht_combine.cu. Plain C++, no CUDA types.
//
// Every op (dispatch or combine) is two launches on the caller's stream:
//   1. notify (one block): advances this Buffer's HT epoch e (device memory, so graph replays advance it too),
//      writes this rank's counts into every rank's notify slot (dispatch; a combine or cached dispatch writes
//      only the flag), waits for every rank's slot of epoch e, and derives the handle's prefix matrices and the
//      receive counts (also published in mapped host memory for the CPU, which sizes the outputs from them).
//      Since each rank starts an op only after its previous op's kernels finished, passing notify also means no
//      rank still reads what the op's stores will overwrite.
//   2. data: per channel c (a contiguous token range), block 2c sends and block 2c + 1 receives (dispatch) or
//      reduces (combine). Stores go straight into the peer's data area at final positions; per (source,
//      channel) a tail word (epoch << 32 | rows stored so far) follows them, so receivers copy while the
//      senders still store. Rows for this rank itself never touch the buffer.
//
// Control area, in every rank's data region at ctrl_off (offsets from there, same on all ranks):
//   notify slots [R source] x kHTSlotBytes: uint64 flag (epoch), int32 count[kHTMaxRanks] (the source's tokens
//     per destination rank), int32 channel[kHTMaxChannels] (the source's tokens per channel for this rank),
//     int32 expert[kHTMaxLocalExperts] (the source's selections of this rank's local experts)
//   dispatch tails [R source][kHTMaxChannels] uint64, combine tails [R source][kHTMaxChannels] uint64
// Data area at data_off: dispatch: records from source s at row rpm[s-1][me] (rank_prefix_matrix); a record is
//   [int32 source token, 0, 0, 0][x bytes][scales S x 4][top-k ids K x int64][top-k weights K x f32], padded to
//   16 bytes. Combine: contributions from rank d at row sum_{d' < d} count[me][d'], each [BF16 row][K x f32].
#pragma once

#include <stdint.h>

#include "ll_api.h"

namespace portep::cuda {

constexpr int kHTMaxRanks = 8;  // ranks that store into each other (one NVLink domain)
constexpr int kHTMaxChannels = 64;
constexpr int kHTMaxLocalExperts = 1024;
constexpr uint64_t kHTSlotBytes = 8 + 4 * (kHTMaxRanks + kHTMaxChannels + kHTMaxLocalExperts) + 8;
constexpr uint64_t kHTTailBytes = 8ull * kHTMaxRanks * kHTMaxChannels;
constexpr uint64_t kHTCtrlBytes = kHTMaxRanks * kHTSlotBytes + 2 * kHTTailBytes;
constexpr uint32_t kErrTooManyRecv = 5;  // LLError code: more rows than num_worst_tokens (src = rows received)

struct HTHostCounts {  // mapped host memory, written by a notify kernel that has a ticket
  uint64_t ticket;     // written last: the fields below belong to the notify of this ticket
  int64_t num_recv;
  int64_t max_recv_any;  // the most rows any rank receives (the data area must hold them)
  int32_t expert[kHTMaxLocalExperts];  // this rank's local experts: selections received, not aligned
};

struct HTCommon {
  int rank, num_ranks, num_channels;
  uint8_t* local;         // this rank's data region
  uint8_t* const* peers;  // device array [R]: every rank's data region (this rank's own included)
  uint64_t ctrl_off, data_off, data_bytes;
  uint64_t* epoch;        // device: ops so far
  HTHostCounts* host;     // device address of the mapped host counts
  LLError* error;
  uint64_t timeout_ns;
  void* stream;
};

struct HTNotifyArgs {
  HTCommon c;
  bool exchange;                   // dispatch without a handle: exchange counts; else only the barrier
  const bool* is_token_in_rank;    // [N][R]
  const int32_t* tokens_per_expert;  // [E] (exchange)
  int num_tokens, num_experts;
  // outputs (exchange): the handle's matrices
  int32_t* rank_prefix;            // [R][R] inclusive over sources
  int32_t* channel_prefix;         // [R][C] inclusive over channels, this rank's sends
  int32_t* recv_channel_prefix;    // [R][C] exclusive over channels, rows from each source
  int64_t max_recv;                // rows the outputs can hold (num_worst_tokens), 0: no limit
  uint64_t ticket;                 // != 0: publish the counts in host memory under this number (the CPU waits)
};

struct HTDispatchArgs {
  HTCommon c;
  const uint8_t* x;           // [N][row_bytes]
  const float* scales;        // [N][S] 4-byte scales (float32 or packed int32), contiguous; may be null
  const int64_t* topk_idx;    // [N][K] global expert ids; may be null
  const float* topk_weights;  // [N][K]; may be null
  const bool* is_token_in_rank;  // [N][R]
  const int32_t* rank_prefix, * channel_prefix, * recv_channel_prefix;
  int num_tokens, row_bytes, num_scales, num_topk, num_local_experts;
  int64_t max_recv;           // rows of the outputs
  uint8_t* recv_x;            // [max_recv][row_bytes]
  float* recv_scales;         // [max_recv][S] or null
  int64_t* recv_topk_idx;     // [max_recv][K] local ids or -1; may be null
  float* recv_topk_weights;   // [max_recv][K]; may be null
  int32_t* recv_src_idx;      // [max_recv] or null (cached dispatch)
  int32_t* send_head;         // [N][R] or null (cached dispatch)
};

struct HTCombineArgs {
  HTCommon c;
  const uint16_t* x;              // [num_recv][H] bf16
  const float* topk_weights;      // [num_recv][K] or null
  const uint16_t* bias0, * bias1;  // [N][H] bf16 or null
  const bool* is_token_in_rank;   // [N][R]
  const int32_t* rank_prefix, * channel_prefix, * recv_channel_prefix, * send_head;
  int num_tokens, hidden, num_topk;
  uint16_t* out;                  // [N][H] bf16
  float* out_weights;             // [N][K] or null
};

// Each returns the launch's cudaError_t (0 = success).
int ht_notify(const HTNotifyArgs& a);
int ht_dispatch(const HTDispatchArgs& a);
int ht_combine(const HTCombineArgs& a);

}  // namespace portep::cuda
