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
//        handle's prefix matrices;
//      - otherwise (cached dispatch, combine) the slot carries only its flag: the handle already has the counts.
//      The receive counts also go to mapped host memory for a CPU that sizes the outputs (a ticket names the
//      op). Since each rank starts an op only after its previous op's kernels finished, passing notify also
//      means no rank still reads a ring this op's stores will overwrite.
//   2. data: per channel c (a contiguous token range) block 2c sends and block 2c + 1 receives (dispatch) or
//      reduces (combine); with forwarding, three blocks per channel (see below). Rows travel through a ring per
//      (channel, sender, receiver) of ring_rows rows (the op's ring_rows, a multiple of kHTChunkRows, at least
//      kHTMinRingRows): the i-th row of a channel from s to d sits in slot i % ring_rows. The receiver learns how
//      far rows arrived (tail) and the sender how far they were consumed (head):
//      - direct peer: the sender stores rows into the receiver's ring, then a tail word epoch << 32 | rows so far;
//        the receiver stores a head word epoch << 32 | rows consumed into the sender's control area;
//      - proxy peer: the sender stages rows in the same slot of its own ring for d, then WRITEs of kHTChunkRows
//        rows (the last may be short; a WRITE never wraps since both are multiples of kHTChunkRows), each batch
//        followed by a SIGNAL, so the rows in place are min(units * kHTChunkRows, rows); the receiver returns
//        one 16-byte WRITE per kHTChunkRows rows consumed (a credit) and a SIGNAL, on the credit stream, so the
//        sender may reuse a staged slot once the WRITE that copied it landed and was read.
//      A sender writes row i only when the reader consumed row i - ring_rows. Rows a rank sends itself never
//      leave its GPU (they go straight to the outputs). A proxy peer whose region is mapped here (place[d]) gets
//      its rows and slots stored straight into its receive and control areas instead of staged, and the WRITEs
//      are placed.
//
// Forwarding (several nodes of several GPUs each, L = ranks_per_node): a token goes once to each same-node
// destination (direct) and once to each other node that has any destination, to that node's forwarder for this
// rank: the rank there with this rank's local index (through the proxies). The data kernels then run a third
// block per channel, the forwarder (block 3c + 2; the sender is 3c, the receiver or reducer 3c + 1):
//   - dispatch: it serves the sources of other nodes with its local index a chunk at a time, in turn, each when its
//     rows are in place (never waiting on one source): it reads their rows from its proxy rings and stores each into
//     a forward ring [forwarder l][channel] at each local destination the row's node mask names, with header
//     (source token, node mask, source rank, index among that source's rows of the channel to that destination);
//     the receivers place rows by that header, so the sources' rows may interleave in a forward ring;
//   - combine: each rank sends its rows of other nodes' tokens to the forwarder of their source (same node), in its
//     receive order, through the same forward rings; the forwarder sums each token's rows in FP32 (local ranks
//     ascending) and returns one partial row [f32 H][f32 K] per token through the proxies; the source's reducer
//     adds bias, same-node rows (ranks ascending), then partials (nodes ascending), as the host backend does.
//   Forward rings use tail and head words as direct rings do. Every wait is for arrivals or for room. The dispatch
//   forwarder waits only while no source has rows in place (so no sender waits on it for room meanwhile) and the
//   receivers and the combine's sender serve every ring at once; the other blocks serve their sources in an order
//   every rank shares (ascending). So no wait is circular.
//
// Where all of this sits (the control area's slots, tails, heads and scratch; the receive and staging areas'
// rings; the rows' fields; the signal streams), every offset and size: ht_layout.h, the one table, next to the
// code that computes it.
#pragma once

#include <stdint.h>

#include "gpu_kernels/cuda/ht_layout.h"
#include "gpu_kernels/cuda/ll_api.h"

namespace portep::cuda {

constexpr int kHTEpochWords = 2;  // HTCommon::epoch

struct HTHostCounts {  // mapped host memory, written by a notify kernel that has a ticket
  uint64_t ticket;     // written last: the fields below belong to the notify of this ticket
  int64_t num_recv;
  int64_t self_begin, self_rows;       // where this rank's rows to itself begin among its received rows, how many
  int64_t forward_rows;                // forwarding: rows this rank receives from other nodes to forward
  int32_t expert[kHTMaxLocalExperts];  // this rank's local experts: selections received, not aligned
};

struct HTCommon {
  int rank, num_ranks, num_channels;
  int ranks_per_node;     // L; forwarding when 1 < L < num_ranks
  uint8_t* local;         // this rank's data region
  uint8_t* const* peers;  // device array [R]: data regions stored into directly (this rank's own included), or
                          // null for a peer reached through the proxies
  uint8_t* const* place;  // device array [R]: a proxy peer's region where the kernels store their WRITEs' bytes
                          // themselves (placed WRITEs), else null
  uint64_t ctrl_off, recv_off, stage_off;  // the control, receive and staging areas (ht_layout.h)
  HTCtrl ctrl;                             // the control area's table: ht_ctrl(num_ranks, ranks_per_node)
  uint64_t* epoch;     // device [kHTEpochWords]: ops so far; whether this op's data kernel does nothing (set by
                       // notify)
  HTHostCounts* host;  // device address of the mapped host counts
  const uint32_t* peer_status;  // as LLCommon's
  KernelError* error;           // as LLCommon's
  uint32_t* failed;
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
  bool count_mode;                   // dispatch without a handle; else the slots carry only their flags
  const bool* is_token_in_rank;      // [N][R] (count mode)
  const int32_t* tokens_per_expert;  // [E] (count mode)
  int num_tokens, num_experts;
  // count mode: outputs (the handle's matrices)
  int32_t* recv_rank_prefix;     // [R] inclusive over sources: rows from sources 0..s to this rank
  int32_t* rank_prefix;          // one node only (else null): [R][R] inclusive over sources, every destination
  int32_t* channel_prefix;       // [R][C] inclusive over channels, this rank's sends
  int32_t* recv_channel_prefix;  // [R][C] exclusive over channels, rows from each source
  // count mode with forwarding (else null), Nn = R / L nodes; "served source" of node n: rank n * L + this local
  int32_t* node_channel_prefix;  // [Nn][C] inclusive over channels: this rank's tokens to each node (shared by
                                 // the notify kernel as its node counts)
  int32_t* fwd_channel_prefix;   // [Nn][C] exclusive over channels: rows from node n's served source
  int32_t* fwd_rank_prefix;      // [Nn] inclusive over nodes: rows from each node's served source
  int64_t max_recv;              // rows the outputs can hold (num_worst_tokens), 0: no limit
  uint64_t ticket;               // != 0: publish the counts in host memory under this number (the CPU waits)
};

struct HTDispatchArgs {
  HTCommon c;
  const uint8_t* x;              // [N][row_bytes]
  const float* scales;           // [N][S] 4-byte scales (float32 or packed int32), contiguous; may be null
  const int64_t* topk_idx;       // [N][K] global expert ids; may be null
  const float* topk_weights;     // [N][K]; may be null
  const bool* is_token_in_rank;  // [N][R]
  const int32_t* recv_prefix;    // [R] (stride recv_prefix_stride): rows from sources 0..s to this rank, inclusive
  int recv_prefix_stride;
  const int32_t *channel_prefix, *recv_channel_prefix;
  int num_tokens, row_bytes, num_scales, num_topk, num_local_experts;
  uint32_t ring_rows;        // rows per ring (ht_layout.h)
  int64_t max_recv;          // rows of the outputs
  uint8_t* recv_x;           // [max_recv][row_bytes]
  float* recv_scales;        // [max_recv][S] or null
  int64_t* recv_topk_idx;    // [max_recv][K] local ids or -1; may be null
  float* recv_topk_weights;  // [max_recv][K]; may be null
  int32_t* recv_src_idx;     // [max_recv] or null (cached dispatch, forwarding)
  int32_t* send_head;        // [N][R] or null (cached dispatch, forwarding)
  // forwarding
  const int32_t *fwd_channel_prefix, *fwd_rank_prefix;  // as in HTNotifyArgs
  int32_t* recv_src_meta;  // [max_recv][2]: source node, its node mask for this node; null: cached
  int32_t* nvl_head;       // [nvl_rows][kHTNvlHeadColumns]: per row from another node, its index among the
  int64_t nvl_rows;        //   source's rows of the channel to each local rank, or -1; null: cached
};

struct HTCombineArgs {
  HTCommon c;
  const uint16_t* x;              // [num_recv][H] bf16
  const float* topk_weights;      // [num_recv][K] or null
  const uint16_t *bias0, *bias1;  // [N][H] bf16 or null
  const bool* is_token_in_rank;   // [N][R]
  const int32_t* recv_prefix;     // as in HTDispatchArgs
  int recv_prefix_stride;
  const int32_t* recv_channel_prefix;
  const int32_t *fwd_channel_prefix, *fwd_rank_prefix, *nvl_head;  // forwarding: as dispatch made them
  int num_tokens, hidden, num_topk;
  uint32_t ring_rows;  // rows per ring (ht_layout.h)
  uint16_t* out;       // [N][H] bf16
  float* out_weights;  // [N][K] or null
};

// Each returns the launch's cudaError_t (0 = success).
int ht_notify(const HTNotifyArgs& a);
int ht_dispatch(const HTDispatchArgs& a);
int ht_combine(const HTCombineArgs& a);
int load_ht_notify_kernels();
int load_ht_dispatch_kernels();
int load_ht_combine_kernels();

}  // namespace portep::cuda
