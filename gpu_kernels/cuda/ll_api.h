// Host entry points of the CUDA low-latency kernels (ll_dispatch.cu, ll_combine.cu). Plain C++, no CUDA types.
//
// Layout of one buffer half in every rank's data region (offsets and sizes: gpu_kernels/ll_layout.h; after the
// engine's data, the flags and meta blocks of LLRegion below):
//   send  [send_off, +S)   dispatch, proxy peers: messages staged as [E][T] (expert, slot), packed per chunk;
//                          combine: the expert outputs as [E_l][R*T] rows of comb_pitch bytes (DeepEP's
//                          zero-copy buffer); without zero-copy, rows for proxy peers are staged packed per chunk
//                          in the rows of the chunk's experts: peer p's at [first * R*T + p * n * T] (n experts).
//   recv  [recv_off, +Rv)  dispatch: [R][E_l][T] messages (source, local expert, slot);
//                          combine: [E][T] rows of comb_pitch (expert, slot).
//   flags [flag_off, +4E)  int32: dispatch [E_l][R] = count + 1; combine [E] = 1 (proxy sources: stored by the
//                          receive kernel's relay, see ll_common.cuh).
// The slot of selection (t, k) is its rank among all selections of that expert in row-major (t, k) order, so
// every layout is deterministic. A dispatch message is a 16-byte header (int32 source token, int32 number of
// messages for that expert from this source, uint32 share, uint32 the call's sequence number) and the payload: BF16
// row, or FP8 row + float32 scales. Direct peers get a token's payload once: share = 0 in the message that holds it;
// the token's other messages to that rank carry no payload and share = 1 + the index of that message in [R][E_l][T].
//
// Proxy peers get data per chunk of kChunkExperts consecutive local experts: WRITE commands (<= 16 MiB each) and
// one final SIGNAL on signal stream stream_base + chunk, so a NIC moves a few large blocks, not one per expert.
// Where the peer's region is mapped (place[dst]: shm on one host), the kernels store the chunk's bytes at their
// place in it instead of in the staging area, and the WRITEs are placed: the proxies carry only their units. A chunk's
// data is packed, expert after expert, into the region its experts have in the receiver's layout (dispatch: [src][first
// .. first + n)[T]; combine: [first expert .. + n)[T]):
//   dispatch: message 0 is a table (header int32 -1, int32 total messages, 0, 0; payload int32 count per expert)
//             and the messages follow; when every slot of the chunk is taken (each count = T) there is no room
//             for it and none is sent (message 0 is then a real message, header >= 0).
//   combine:  the receiver knows the counts (its own selections), so rows come packed without a table.
// Their slots in `host_signals` only grow (the kernels keep the value they consumed last in `signal_seen`,
// device memory).
//
// Combine between two direct peers (partials, when meta_off != 0): the reduce adds a token's rows per owner rank
// (top-k order within a rank, FP32), then those per-rank sums in rank order. So an owner holding two or more of a
// direct peer's selections of one token sends their FP32 sum instead of the BF16 rows, in half the bytes (or
// less): floats [0, H/2) in the row of the token's first selection on that owner (top-k order), [H/2, H) in the
// row of its second. A single selection still travels as its BF16 row. The owner needs the receiver's expert
// indices and weights for that: each source writes them into every direct peer's meta block of this half, at
// meta_off + src * meta_stride (data region of the peer):
//   uint32 ready (1 = written; the owner zeroes it), int32 N (tokens), int32 K, unused,
//   int32 experts [N][K] (-1: none), float32 weights [N][K]   (N * K <= kMetaTokens * kMetaMaxTopk entries)
#pragma once

#include <stdint.h>

#include "gpu_kernels/cuda/kernel_errors.h"
#include "proxy/fifo.h"

namespace portep::cuda {

constexpr int kChunkExperts = 32;  // local experts per proxy chunk (the relay maps them to one warp's lanes)
constexpr int kMetaTokens = 1024;  // partial sums in combine for num_max_dispatch_tokens_per_rank up to this
constexpr int kMetaMaxTopk = 32;   // the kernels' limit on num_topk
constexpr uint64_t kMetaHeaderBytes = 16;
constexpr uint64_t kMetaStride = kMetaHeaderBytes + uint64_t(kMetaTokens) * kMetaMaxTopk * 8;  // per source

// What follows a Buffer's num_bytes of data in its region (every rank alike):
//   flags [2 halves][2 phases: dispatch, combine][num_ranks * max_local_experts] int32
//   meta  [2 halves][num_ranks sources] blocks of kMetaStride bytes (combine partials, above)
// and then the normal mode's control area (gpu_kernels/cuda/ht_api.h) at end().
struct LLRegion {
  uint64_t num_bytes = 0;
  int num_ranks = 0, max_local_experts = 0;

  constexpr uint64_t flag_slots() const { return uint64_t(num_ranks) * uint64_t(max_local_experts); }
  constexpr uint64_t flag_off(int half, int phase) const {
    return num_bytes + uint64_t(half * 2 + phase) * flag_slots() * 4;
  }
  constexpr uint64_t meta_base() const { return num_bytes + 4 * 4 * flag_slots(); }
  constexpr uint64_t meta_bytes() const { return 2 * uint64_t(num_ranks) * kMetaStride; }
  constexpr uint64_t meta_off(int half) const { return meta_base() + uint64_t(half) * num_ranks * kMetaStride; }
  constexpr uint64_t end() const { return meta_base() + meta_bytes(); }
};
static_assert(kMetaStride % 16 == 0, "meta blocks hold 16-byte aligned headers");
static_assert(LLRegion{1 << 20, 2, 144}.flag_off(1, 1) + 4 * 2 * 144 == LLRegion{1 << 20, 2, 144}.meta_base(),
              "the meta blocks follow the last flags");

// The kernels' int32 scratch in device memory, zero between calls (clean_low_latency_buffer zeroes it all), in words:
//   finish      [flag_slots + 1]  dispatch [E] / combine [E_l] counts, then the combine's receive blocks done
//   chunk_done  [R][max_chunks]   experts of a proxy chunk ready
//   proxy_begin [flag_slots]      where a proxy source's messages / rows of an expert begin in its chunk
//   dest_done   [R]               combine blocks done with a partial peer
//   seq_chain   [2]               the sequence-number chain (below)
struct LLScratch {
  int num_ranks = 0, max_local_experts = 0;

  constexpr int64_t flag_slots() const { return int64_t(LLRegion{0, num_ranks, max_local_experts}.flag_slots()); }
  constexpr int64_t max_chunks() const { return (max_local_experts + kChunkExperts - 1) / kChunkExperts; }
  constexpr int64_t chunk_done() const { return flag_slots() + 1; }
  constexpr int64_t proxy_begin() const { return chunk_done() + num_ranks * max_chunks(); }
  constexpr int64_t dest_done() const { return proxy_begin() + flag_slots(); }
  constexpr int64_t seq_chain() const { return dest_done() + num_ranks; }
  constexpr int64_t words() const { return seq_chain() + 2; }
};
static_assert(LLScratch{2, 144}.words() == 2 * 288 + 1 + 2 * 5 + 2 + 2, "scratch of 2 ranks with 144 local experts");

struct LLCommon {
  int rank, num_ranks, num_experts, num_local_experts, T, hidden;
  uint64_t send_off, recv_off, flag_off;  // this half, bytes into the data region
  uint32_t disp_bytes, comb_pitch;
  uint8_t* local;          // this rank's data region (device)
  uint8_t* const* peers;   // device array [R]: peer data region when stored into directly, else null
  uint8_t* const* place;   // device array [R]: a proxy peer's data region where the kernels store the bytes of
                           //   their WRITEs themselves (placed WRITEs, the transport's placed_writes), else null
  uint64_t* host_signals;  // device address of this rank's signal slots [R][num_streams] (host-written)
  uint64_t* signal_seen;   // device [R][num_streams]: each slot's value when a kernel last consumed it
  uint32_t num_streams, stream_base;
  const FifoView* fifos;  // device array of device-side views
  uint64_t* fifo_tails;   // device array [num_fifos]: shared cached tails
  int num_fifos;
  uint32_t* finish;                // device scratch, zero between calls: [E] (dispatch) / [E_l] (combine)
                                   //   + [E]: blocks of the combine's receive kernel done
  uint32_t* chunk_done;            // device scratch, zero between calls: [R][max_chunks] experts of a chunk ready
  uint32_t* proxy_begin;           // device [E]: where a proxy source's messages / rows of an expert begin in its chunk
  int max_chunks;                  // chunks of kChunkExperts local experts the scratch has room for, per rank
  uint32_t* dest_done;             // device scratch, zero between calls: [R] combine blocks done with a partial peer
  uint64_t meta_off, meta_stride;  // combine partials (see above); meta_off 0: every peer gets rows
  const uint32_t* peer_status;  // mapped host memory [R]: the peer watch's word for each peer (peer_status.h), or null
  uint32_t* mask;               // device [R] (1: masked) in shrink mode, else null: receive sides read (and set) it
  const uint32_t* send_mask;    // device [R]: the mask as the call began (send sides read it), or null
  uint32_t seq;                 // the call's sequence number (dispatch messages carry it), unless kSeqFromChain
  uint32_t* seq_chain;          // device [2]: per buffer half, the sequence number of the next call on it (below)
  uint32_t half;                // this buffer half (0 or 1)
  uint32_t seq_mode;            // kSeqWriteChain | kSeqFromChain bits, set per launch
  KernelError* error;           // mapped host memory [kNumErrorWords]: what the host raises (kernel_errors.h)
  uint32_t* failed;             // device [kNumErrorWords]: the reported codes (kernels test these, not the host's)
  uint64_t timeout_ns;
  int num_sms;
  void* stream;  // cudaStream_t
};

struct LLDispatchArgs {
  LLCommon c;
  const void* x;            // [N][H] bf16
  const int64_t* topk_idx;  // [N][K]
  int num_tokens, num_topk;
  bool use_fp8, round_scale, use_ue8m0;
  // receive phase outputs
  void* recv_x;               // [E_l][R*T][H] bf16 or fp8
  void* recv_scales;          // [E_l][S][R*T] float32 (S = H/128) or int32 (S = H/512, UE8M0); may be null
  int32_t* recv_count;        // [E_l]
  int32_t* src_info;          // [E_l][R*T]
  int64_t* layout_range;      // [E_l][R]
  int32_t* cumulative_stats;  // [E_l] or null
  int64_t* wait_stats;        // [R] or null (nanoseconds waited per source)
};

struct LLCombineArgs {
  LLCommon c;
  const void* x;  // [E_l][R*T][H] bf16 rows, row pitch x_pitch bytes (the send area when zero-copy)
  uint64_t x_pitch;
  bool zero_copy;
  const int32_t* src_info;      // [E_l][R*T]
  const int64_t* layout_range;  // [E_l][R]
  const int64_t* topk_idx;      // [N][K]
  const float* topk_weights;    // [N][K]
  int num_tokens, num_topk;
  void* out;  // [N][H] bf16, row pitch out_pitch bytes
  uint64_t out_pitch;
  int64_t* wait_stats;     // [R] or null
  bool use_logfmt;         // rows travel as LogFMT-10 (gpu_kernels/logfmt.h), this rank's too; c.meta_off is 0
  bool own_rows_in_input;  // set by ll_combine: rows for this rank are read from x, not copied
};

// Each returns the launch's cudaError_t (0 = success); kernels run asynchronously on c.stream. phases: the send
// phase, the receive phase (the hook), or both in one launch.
constexpr int kPhaseSend = 1, kPhaseRecv = 2;
int ll_dispatch(const LLDispatchArgs& a, int phases);
int ll_combine(const LLCombineArgs& a, int phases);

// The sequence-number chain. A call launched as a cached CUDA graph (below) has fixed parameters, so its sequence
// number cannot be one: it reads it on the GPU from seq_chain[half] (kSeqFromChain), which the Buffer's previous
// call left there. Every eager launch that sends (kSeqWriteChain: thread 0 of block 0, as the kernel begins) stores
// the number of the call after it in seq_chain[half ^ 1], the word of the half that call uses; in stream order
// the two words never race, as the kernel reads only its own half's word (calls of one Buffer on streams that do
// not wait for each other share its scratch as well: a graph call may then read an old number, which the receivers
// report as out of step). Launches under stream capture neither read nor write
// the chain (their replays would rewrite it), and the host launches a graph only where an eager launch of this
// Buffer wrote the chain last, for the call's half and the host's number of the call (LLPlanTable::launch,
// ll_plan.h): a graph-launched call carries the number a kernel launch would have.
constexpr uint32_t kSeqWriteChain = 1, kSeqFromChain = 2;

// A Buffer's LL launches as instantiated one-kernel CUDA graphs, one per distinct parameter block (graph_cache.h):
// a graph launch costs the host about half a kernel launch. Null under HIP (no cache: kernel launches only).
struct LLGraphs;
LLGraphs* ll_graphs_create();
void ll_graphs_destroy(LLGraphs* graphs);
// Both phases in one launch of the call's graph (kSeqFromChain set by the caller); on an error nothing was queued.
// kGraphDeclined: not launched, nothing wrong (another GPU is current than the cache's): launch a kernel instead.
constexpr int kGraphDeclined = -1;
int ll_dispatch_graphed(LLGraphs* graphs, const LLDispatchArgs& a);
int ll_combine_graphed(LLGraphs* graphs, const LLCombineArgs& a);
// Graphs launched, built and re-parameterised by one cache; zeros without one.
struct LLGraphCounts {
  uint64_t launches = 0, builds = 0, updates = 0;
};
LLGraphCounts ll_graph_counts(const LLGraphs* graphs);
// Whether `stream` (cudaStream_t) is being captured into a CUDA graph; the query's error otherwise.
int stream_capturing(void* stream, bool* capturing);
int load_ll_dispatch_kernels();
int load_ll_combine_kernels();

// Device FIFOs for kernels: mapped host entries/tail/error flag, device head; host views for the proxies,
// a device array of device views and a device array of shared cached tails for kernels.
struct DeviceFifoSet {
  int count = 0;
  FifoView* host_views = nullptr;    // host array [count]
  FifoView* device_views = nullptr;  // device array [count]
  uint64_t* device_tails = nullptr;  // device array [count], zeroed
};
int alloc_device_fifo_set(int count, uint32_t capacity, DeviceFifoSet* out);
int free_device_fifo_set(DeviceFifoSet* set);

// Copies between device pointers / host on the default stream and waits (setup of small device arrays).
int copy_to_device(void* dst, const void* src, uint64_t bytes);
int device_alloc_zeroed(void** p, uint64_t bytes);
int device_free(void* p);
// A non-blocking stream of the current device. CUDA puts each new stream on the next of its hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS), so one created right after the proxies' copy streams shares no queue with them.
int stream_create(void** stream);
int host_alloc_mapped(void** host, void** device, uint64_t bytes);
int host_free_mapped(void* host);

}  // namespace portep::cuda
