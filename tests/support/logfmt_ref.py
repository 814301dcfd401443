"""An independent reference of LogFMT-10 (docs/logfmt.md; portep's row layout in gpu_kernels/logfmt.h), written from
the format's description in float64 with torch: per-group metadata, the per-chunk cast decision, the codes and signs,
the bit packing, and the decoded values. Tests compare the native encoder and decoder with it."""

import torch

GROUP, LEVELS, MAX_CODE, RANGE, BLOCK, BLOCK_BYTES = 128, 510, 511, 32.0, 16, 20


def chunk_of(hidden):
    return 1024 if hidden % 1024 == 0 else 512


def _bits_to_float(bits):
    """int32 BF16 bit patterns (0..0xffff) -> float64 values."""
    return bits.to(torch.int16).view(torch.bfloat16).double()


def analyse(x):
    """x: BF16 [..., H]. Returns (meta int32 [..., 2G] as amax, amin bit pairs, cast bool [..., chunks], codes int64
    [..., H] (0 in BF16 chunks), signs int64 [..., H], lmin / step float64 [..., G])."""
    H = x.size(-1)
    lead = x.shape[:-1]
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    mag, signs = bits & 0x7FFF, (bits >> 15) & 1
    g_mag = mag.view(*lead, H // GROUP, GROUP)
    nan = g_mag > 0x7F80
    amax = torch.where(nan, 0, g_mag).amax(-1)
    amin = torch.where(nan, 0x7F80, g_mag).amin(-1)
    lmax = torch.log2(_bits_to_float(amax))
    lmin = torch.where(amin == 0, lmax - RANGE, torch.maximum(torch.log2(_bits_to_float(amin)), lmax - RANGE))
    ok = (lmax < 0) & (lmin < lmax)
    cast = ok.view(*lead, -1, chunk_of(H) // GROUP).all(-1)
    step = (lmax - lmin) / LEVELS
    a = _bits_to_float(g_mag)
    s, lo = step[..., None], lmin[..., None]
    u = torch.log2(a) / s + 2 - torch.log2((1 + torch.exp2(s)) / 2) / s - lo / s
    u = torch.nan_to_num(u, nan=0.0, neginf=0.0)
    codes = torch.floor(torch.clamp(u, min=0)).clamp(max=MAX_CODE).to(torch.int64).view(*lead, H)
    codes = torch.where(cast.repeat_interleave(chunk_of(H), dim=-1), codes, 0)
    meta = torch.stack([amax, amin], -1).view(*lead, -1)
    return meta, cast, codes, signs.to(torch.int64), lmin, step


def decode_codes(codes, signs, lmin, step):
    """The float64 values of codes [..., H] (groups' lmin / step [..., G])."""
    s = step.repeat_interleave(GROUP, dim=-1)
    lo = lmin.repeat_interleave(GROUP, dim=-1)
    v = torch.where(codes == 0, torch.zeros_like(s), torch.exp2((codes - 1).double() * s + lo))
    return torch.where(signs == 1, -v, v)


def quantize(x):
    """What a receiver decodes for BF16 rows x [..., H], float64: cast chunks quantized, the others x itself."""
    meta, cast, codes, signs, lmin, step = analyse(x)
    q = decode_codes(codes, signs, lmin, step)
    keep = ~cast.repeat_interleave(chunk_of(x.size(-1)), dim=-1)
    return torch.where(keep, x.double(), q)


def parse_row(row, H):
    """A row's bytes (uint8 tensor) -> (meta int32 [2G] with sign bits cleared, seq, cast [chunks] from the metadata,
    codes [H], signs [H], bf16 chunks' bytes {chunk: uint8 tensor}), unpacking the bit layout independently."""
    raw = bytes(row.tolist())
    G = H // GROUP
    halves = [int.from_bytes(raw[2 * i : 2 * i + 2], "little") for i in range(2 * G)]
    seq = sum(((h >> 15) & 1) << i for i, h in enumerate(halves[:32]))
    meta = torch.tensor([h & 0x7FFF for h in halves], dtype=torch.int32)
    amax, amin = meta[0::2], meta[1::2]
    lmax = torch.log2(_bits_to_float(amax))
    lmin = torch.where(amin == 0, lmax - RANGE, torch.maximum(torch.log2(_bits_to_float(amin)), lmax - RANGE))
    cast = ((lmax < 0) & (lmin < lmax)).view(-1, chunk_of(H) // GROUP).all(1)
    codes, signs, plain = [0] * H, [0] * H, {}
    at, chunk = 4 * G, chunk_of(H)
    for c, is_cast in enumerate(cast.tolist()):
        if not is_cast:
            plain[c] = row[at : at + 2 * chunk]
            at += 2 * chunk
            continue
        for b in range(chunk // BLOCK):
            word = int.from_bytes(raw[at : at + BLOCK_BYTES], "little")  # the block as one 160-bit integer
            for k in range(BLOCK):
                codes[c * chunk + b * BLOCK + k] = (word >> (9 * k)) & 0x1FF
                signs[c * chunk + b * BLOCK + k] = (word >> (144 + k)) & 1
            at += BLOCK_BYTES
    return meta, seq, cast, torch.tensor(codes), torch.tensor(signs), plain


def calc_diff(x, y):
    """DeepEP's similarity measure (deep_ep.utils): 1 - 2 sum((x+1)(y+1)) / sum((x+1)^2 + (y+1)^2), float64."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
