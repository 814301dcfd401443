// Host entry points of the CUDA normal-mode (HT) kernels: ht_notify.cu, ht_dispatch.cu, ht_combine.cu. Plain
// C++, no CUDA types. Peers are reached directly (stores into their buffers through CUDA IPC: one node, NVLink)
// or through the proxies (rows staged in this rank's buffer, WRITE + SIGNAL commands through the device FIFOs;
// every peer of another node, e.g. one GPU per node).
//
// Every op (dispatch or combine) is two launches on the caller's stream:
//   1. notify (one block): advances this Buffer's HT epoch e (device memory, so graph replays advance it too) and
//      writes this rank's slot in every rank's control area, then waits for every rank's slot of this op:
//      - count mode (dispatch without a handle): the slot carries this rank's tokens per destination rank, per
//        channel for that destination and the destination's experts' selections; every rank derives the
//        handle's prefix matrices, and where its rows begin in each destination's area (dest_first);
//      - offset mode (cached dispatch, combine): the slot tells its reader where the reader's rows begin in the
//        writer's area and how many rows that area holds, from the handle the writer has.
//      The receive counts also go to mapped host memory for a CPU that sizes the outputs (a ticket names the
//      op). Since each rank starts an op only after its previous op's kernels finished, passing notify also
//      means no rank still reads what the op's stores will overwrite.
//   2. data: per channel c (a contiguous token range) block 2c sends and block 2c + 1 receives (dispatch) or
//      reduces (combine). Rows go to final positions in the destination's area; per (source, channel) the
//      receiver learns how far they arrived: a direct source stores a tail word (epoch << 32 | rows so far)
//      after its rows, a proxy source's rows travel in WRITEs of kHTChunkRows rows (the last may be short),
//      each batch of them followed by a SIGNAL, so the rows in place are min(units * kHTChunkRows, rows).
//      Rows a rank sends itself never leave its GPU.
//
// Control area, in every rank's data region at ctrl_off (offsets from there, same on all ranks):
//   slots [2 epoch parities][R source] x kHTSlotBytes: uint64 flag (epoch), int64 offset, int64 area_rows,
//     int32 count[kHTMaxRanks] (the source's tokens per destination rank), int32 channel[kHTMaxChannels] (its
//     tokens per channel for this rank), int32 expert[kHTMaxLocalExperts] (its selections of this rank's experts)
//   dispatch tails [R source][kHTMaxChannels] uint64, combine tails [R source][kHTMaxChannels] uint64
//   outgoing slots [2 epoch parities][R destination] x kHTSlotBytes (what a proxy WRITE carries to that
//     destination's slot)
// Receive area at recv_off: dispatch: records from source s from row rows_before(s) (the receiver's prefix over
//   sources); a record is [int32 source token, 0, 0, 0][x bytes][scales S x 4][pad to 8 bytes][top-k ids K x
//   int64][top-k weights K x f32], padded to 16 bytes. Combine: contributions from rank d from row
//   sum_{d' < d} sent[d'] (the receiver's own tokens per destination), each [BF16 row][K x f32] padded to 16 bytes.
// Staging area at stage_off (proxy peers only): dispatch: records for d from row sum_{d' < d} sent[d']; combine:
//   contributions in the receive order of dispatch (source blocks ascending).
// Signal streams (proxy path), from stream_base: notify, dispatch channel c at 1 + c, combine channel c at
//   1 + kHTMaxChannels + c.
#pragma once

#include <stdint.h>

#include "ll_api.h"

namespace portep::cuda {

constexpr int kHTMaxRanks = 8;  // ranks one rank exchanges with (one NVLink domain, or one GPU per node)
constexpr int kHTMaxChannels = 64;
constexpr int kHTMaxLocalExperts = 1024;
constexpr int kHTChunkRows = 32;  // rows per proxy WRITE
constexpr uint64_t kHTSlotBytes = 24 + 4 * (kHTMaxRanks + kHTMaxChannels + kHTMaxLocalExperts) + 8;
constexpr uint64_t kHTTailBytes = 8ull * kHTMaxRanks * kHTMaxChannels;
constexpr uint64_t kHTCtrlBytes = 4 * kHTMaxRanks * kHTSlotBytes + 2 * kHTTailBytes;
constexpr uint32_t kHTNumStreams = 1 + 2 * kHTMaxChannels;
constexpr uint32_t kErrTooManyRecv = 5;  // LLError code: more rows than num_worst_tokens (src = rows received)

struct HTHostCounts {  // mapped host memory, written by a notify kernel that has a ticket
  uint64_t ticket;     // written last: the fields below belong to the notify of this ticket
  int64_t num_recv;
  int64_t max_recv_any;  // the most rows any rank receives
  int64_t max_send_any;  // the most rows any rank sends (staged for proxy peers)
  int64_t self_begin, self_rows;  // where this rank's rows to itself begin among its received rows, how many
  int32_t expert[kHTMaxLocalExperts];  // this rank's local experts: selections received, not aligned
};

struct HTCommon {
  int rank, num_ranks, num_channels;
  uint8_t* local;         // this rank's data region
  uint8_t* const* peers;  // device array [R]: data regions stored into directly (this rank's own included), or
                          // null for a peer reached through the proxies
  uint64_t ctrl_off, recv_off, recv_bytes, stage_off, stage_bytes;
  uint64_t* epoch;        // device: ops so far
  int64_t* dest_first;    // device [R]: where this rank's rows begin in each rank's receive area (notify output)
  int64_t* dest_rows;     // device [R]: rows each rank's receive area must hold (notify output)
  HTHostCounts* host;     // device address of the mapped host counts
  LLError* error;
  uint64_t timeout_ns;
  // the proxy path
  const FifoView* fifos;  // device array of device-side views
  uint64_t* fifo_tails;   // device array [num_fifos]: shared cached tails
  int num_fifos;
  uint64_t* host_signals;  // device address of this rank's signal slots [R][num_streams] (host-written)
  uint64_t* signal_seen;   // device [R][num_streams]: each slot's units when a kernel last consumed them
  uint32_t num_streams, stream_base;
  void* stream;
};

struct HTNotifyArgs {
  HTCommon c;
  bool count_mode;                 // dispatch without a handle; else offset mode
  bool combine;                    // offset mode: for a combine (else a cached dispatch)
  const bool* is_token_in_rank;    // [N][R] (count mode)
  const int32_t* tokens_per_expert;  // [E] (count mode)
  int num_tokens, num_experts;
  // count mode: outputs (the handle's matrices); offset mode: inputs from the handle
  int32_t* rank_prefix;            // [R][R] inclusive over sources (count mode only)
  int32_t* channel_prefix;         // [R][C] inclusive over channels, this rank's sends
  int32_t* recv_channel_prefix;    // [R][C] exclusive over channels, rows from each source (count mode only)
  const int32_t* recv_prefix;      // offset mode: [R] (stride recv_prefix_stride) rows from sources 0..s, inclusive
  int recv_prefix_stride;
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
  const int32_t* recv_prefix;    // [R] (stride recv_prefix_stride): rows from sources 0..s to this rank, inclusive
  int recv_prefix_stride;
  const int32_t* channel_prefix, * recv_channel_prefix;
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
  const int32_t* recv_prefix;     // as in HTDispatchArgs
  int recv_prefix_stride;
  const int32_t* channel_prefix, * recv_channel_prefix, * send_head;
  int num_tokens, hidden, num_topk;
  uint16_t* out;                  // [N][H] bf16
  float* out_weights;             // [N][K] or null
};

// Each returns the launch's cudaError_t (0 = success).
int ht_notify(const HTNotifyArgs& a);
int ht_dispatch(const HTDispatchArgs& a);
int ht_combine(const HTCombineArgs& a);

}  // namespace portep::cuda
