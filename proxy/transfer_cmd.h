// TransferCmd: the 16-byte command a producer (GPU kernel or host thread) hands to a proxy.
// Plain C++ usable from host code and from CUDA/HIP device code. Packed with explicit shifts and masks;
// never bit-fields, whose layout is compiler-defined.
//
// Bit table (lo = first 8 bytes in memory, hi = next 8 bytes; little-endian words):
//
//   word  bits     width  field         meaning
//   lo    [0,4)      4    opcode        CmdOp; 0 is reserved for "empty slot", so a valid record is never zero
//   lo    [4,8)      4    flags         CmdFlag bits (combine phase, LL buffer half, final signal, placed)
//   lo    [8,21)    13    dst_rank      destination rank, < 8192
//   lo    [21,46)   25    size          bytes for WRITE (<= 16 MiB); unused (0) otherwise
//   lo    [46,64)   18    stream        stream tag: LL local expert or HT channel, < 262144
//   hi    [0,32)    32    remote_off16  remote byte offset / 16 into the destination's data region
//   hi    [32,64)   32    local_off16   local byte offset / 16 into the source's data region
//
// Offsets are 16-byte aligned and reach 2^32 * 16 B = 64 GiB. QUIET and BARRIER carry a ticket in
// remote_off16 so the issuer can tell when that exact command has been handled.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PORTEP_HD __host__ __device__ __forceinline__
#else
#define PORTEP_HD inline
#endif

namespace portep {

enum CmdOp : uint32_t {
  kOpEmpty = 0,
  kOpWrite = 1,    // copy size bytes from local_off to dst's remote_off; counts one unit on its stream
  kOpSignal = 2,   // add the stream's units since the previous signal to dst's signal slot of that stream
  kOpQuiet = 3,    // proxy waits until everything it posted has completed, then acknowledges the ticket
  kOpBarrier = 4,  // all ranks: quiet, then exchange barrier messages through the transport
  kOpNop = 5,      // acknowledged without side effects (used by tests and benchmarks of the channel)
  kOpMaxValid = 5,
};

enum CmdFlag : uint32_t {
  kFlagCombine = 1u << 0,  // combine phase (vs dispatch) of an LL/HT exchange
  kFlagHalf = 1u << 1,     // LL buffer half 1 (vs 0)
  kFlagFinal = 1u << 2,    // SIGNAL: also add kSignalFinalMark so the receiver knows the stream ended
  // WRITE: the producer already stored the bytes at remote_off in dst's region (mapped into it: the transport's
  // peer_region, where props().placed_writes); the proxy moves nothing and carries only the write's unit, so the
  // receiver still learns of it through the stream's signal, in order, as of any other write.
  kFlagPlaced = 1u << 3,
};

struct TransferCmd {
  uint64_t lo;
  uint64_t hi;
};
static_assert(sizeof(TransferCmd) == 16, "one 128-bit store publishes a command");

struct CmdFields {
  uint32_t op;
  uint32_t flags;
  uint32_t dst_rank;
  uint32_t size;
  uint32_t stream;
  uint64_t remote_off;  // bytes, multiple of 16
  uint64_t local_off;   // bytes, multiple of 16
};

namespace cmd_bits {
constexpr int kOpShift = 0, kOpBits = 4;
constexpr int kFlagsShift = 4, kFlagsBits = 4;
constexpr int kRankShift = 8, kRankBits = 13;
constexpr int kSizeShift = 21, kSizeBits = 25;
constexpr int kStreamShift = 46, kStreamBits = 18;
constexpr int kOffAlignShift = 4;  // offsets stored divided by 16
constexpr int kOffBits = 32;
static_assert(kStreamShift + kStreamBits == 64, "lo word is fully used");
PORTEP_HD constexpr uint64_t mask(int bits) { return bits >= 64 ? ~0ull : ((1ull << bits) - 1); }
}  // namespace cmd_bits

// Limits that the encoder refuses to exceed (all above UCCL-EP's 256 ranks / 16 MiB-1 / 1023 experts).
constexpr uint32_t kMaxRanks = 1u << cmd_bits::kRankBits;                                        // 8192
constexpr uint32_t kMaxCmdBytes = 16u << 20;                                                     // 16 MiB per command
constexpr uint32_t kMaxStreams = 1u << cmd_bits::kStreamBits;                                    // 262144
constexpr uint64_t kMaxOffset = (1ull << (cmd_bits::kOffBits + cmd_bits::kOffAlignShift)) - 16;  // 64 GiB - 16
constexpr uint32_t kOffsetAlign = 1u << cmd_bits::kOffAlignShift;
constexpr uint64_t kSignalFinalMark = 1ull << 32;  // added by a final signal on top of its unit count

enum CmdEncodeStatus : int {
  kEncodeOk = 0,
  kEncodeBadOp,
  kEncodeBadFlags,
  kEncodeRankTooLarge,
  kEncodeSizeTooLarge,
  kEncodeStreamTooLarge,
  kEncodeOffsetTooLarge,
  kEncodeOffsetMisaligned,
};

// Checks every field against its width; returns kEncodeOk and fills *out, or an error and leaves *out alone.
PORTEP_HD int cmd_encode(const CmdFields& f, TransferCmd* out) {
  using namespace cmd_bits;
  if (f.op == kOpEmpty || f.op > kOpMaxValid) return kEncodeBadOp;
  if (f.flags > mask(kFlagsBits)) return kEncodeBadFlags;
  if (f.dst_rank >= kMaxRanks) return kEncodeRankTooLarge;
  if (f.size > kMaxCmdBytes) return kEncodeSizeTooLarge;
  if (f.stream >= kMaxStreams) return kEncodeStreamTooLarge;
  if (f.remote_off > kMaxOffset || f.local_off > kMaxOffset) return kEncodeOffsetTooLarge;
  if ((f.remote_off | f.local_off) & (kOffsetAlign - 1)) return kEncodeOffsetMisaligned;
  out->lo = (uint64_t(f.op) << kOpShift) | (uint64_t(f.flags) << kFlagsShift) | (uint64_t(f.dst_rank) << kRankShift) |
            (uint64_t(f.size) << kSizeShift) | (uint64_t(f.stream) << kStreamShift);
  out->hi = (f.remote_off >> kOffAlignShift) | ((f.local_off >> kOffAlignShift) << kOffBits);
  return kEncodeOk;
}

PORTEP_HD CmdFields cmd_decode(const TransferCmd& c) {
  using namespace cmd_bits;
  CmdFields f;
  f.op = uint32_t((c.lo >> kOpShift) & mask(kOpBits));
  f.flags = uint32_t((c.lo >> kFlagsShift) & mask(kFlagsBits));
  f.dst_rank = uint32_t((c.lo >> kRankShift) & mask(kRankBits));
  f.size = uint32_t((c.lo >> kSizeShift) & mask(kSizeBits));
  f.stream = uint32_t((c.lo >> kStreamShift) & mask(kStreamBits));
  f.remote_off = (c.hi & mask(kOffBits)) << kOffAlignShift;
  f.local_off = (c.hi >> kOffBits) << kOffAlignShift;
  return f;
}

inline const char* cmd_encode_status_text(int status) {
  switch (status) {
    case kEncodeOk:
      return "ok";
    case kEncodeBadOp:
      return "opcode must be one of WRITE, SIGNAL, QUIET, BARRIER, NOP";
    case kEncodeBadFlags:
      return "flags must fit in 4 bits";
    case kEncodeRankTooLarge:
      return "dst_rank must be < 8192";
    case kEncodeSizeTooLarge:
      return "size must be <= 16 MiB (16777216 bytes) per command";
    case kEncodeStreamTooLarge:
      return "stream must be < 262144";
    case kEncodeOffsetTooLarge:
      return "offset must be <= 64 GiB - 16 (68719476720 bytes)";
    case kEncodeOffsetMisaligned:
      return "offsets must be multiples of 16 bytes";
  }
  return "unknown encode status";
}

}  // namespace portep
