"""Rank bodies for LogFMT-10 low-latency combine (low_latency_combine(use_logfmt=True)) on the host backend and, with
backend='cuda', on the CUDA kernels (tests/gpu/test_gpu_ll_logfmt.py): every combined row against a float64
reference that quantizes each expert output as the format does (logfmt_ref.py) and sums it with the top-k weights,
on inputs that are mostly cast, a mix of cast and BF16 chunks, and all BF16."""

import torch

import deepep_reference as ref
import logfmt_ref
from deepep_workers import BF16, Checker, all_gather, make_ll_buffer, make_ll_inputs


def _inputs(kind, rank, seed, n, hidden):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if kind == "cast":  # small values: nearly every chunk is cast
        return (torch.randn(n, hidden, generator=g) * 0.05).to(BF16)
    if kind == "mix":  # DeepEP's extra LogFMT inputs: a scale per token, some chunks cast, some not
        return (torch.randn(n, hidden, generator=g) * 0.5 * torch.rand(n, 1, generator=g)).to(BF16)
    return ref.ll_struct_x(rank, n, hidden)  # values >= 1: every chunk stays BF16


def _expert_output(x, unit, src_rank):
    """BF16 rows bf16(x * factor(unit) / 2 * (1 + src_rank / 16)): differ per expert and source rank, and, unlike
    deepep_reference.expert_output, add no offset, which would shrink the groups' dynamic range until LogFMT's
    levels were finer than BF16 itself and the quantization could not be seen."""
    return (x.float() * (ref.expert_factor(unit) / 2 * (1 + src_rank / 16))).to(BF16)


def _expert_outputs(recv_x, layout_range, rank):
    """_expert_output of every received row (recv_x BF16 [E_l, M, H]; layout_range int64 [E_l, R])."""
    out = recv_x.clone()
    e_l = recv_x.size(0)
    for e in range(e_l):
        for j in range(layout_range.size(1)):
            b, c = int(layout_range[e, j]) >> 32, int(layout_range[e, j]) & 0xFFFFFFFF
            out[e, b : b + c] = _expert_output(recv_x[e, b : b + c], rank * e_l + e, j)
    return out


def _references(x, idx, w, rank):
    """float64 [n, H]: the LogFMT reference (each expert output quantized, then weighted), the exact sum, and the sum
    of the terms' magnitudes."""
    n, K = idx.shape
    valid = (idx >= 0).double()
    units = idx.clamp(min=0)
    y = _expert_output(x.unsqueeze(1).expand(n, K, x.size(1)), units.unsqueeze(-1), rank)  # [n, K, H] BF16
    wk = (w.double() * valid).unsqueeze(-1)
    q = logfmt_ref.quantize(y)
    return (wk * q).sum(1), (wk * y.double()).sum(1), (wk * y.double().abs()).sum(1)


def _check(ck, kind, got, q_sum, exact, mags):
    got64 = got.double()
    err = (got64 - q_sum).abs()
    # BF16 output rounding and FP32 sums, except where a code sits one level off the float64 reference's (rare)
    loose = err > 2.0**-8 * q_sum.abs() + 1e-6 * mags
    ck.true(
        int(loose.sum()) <= max(1, got.numel() // 1000),
        f"{kind}: {int(loose.sum())}/{got.numel()} elements differ from the LogFMT reference beyond BF16 rounding",
    )
    ck.true(
        bool((err <= 2.0**-7 * q_sum.abs() + 0.05 * mags).all()),
        f"{kind}: an element is off the LogFMT reference by more than one level of its terms",
    )
    d = logfmt_ref.calc_diff(exact, got64)
    ck.true(d < 1e-5, f"{kind}: calc_diff against the unquantized sum {d:.3g} >= 1e-5 (DeepEP's threshold)")
    # against both references rounded as the output is: the output's own rounding cancels, the quantization does not
    to_q = float((got64 - q_sum.to(BF16).double()).abs().mean())
    to_exact = float((got64 - exact.to(BF16).double()).abs().mean())
    if kind == "cast":  # the rows were quantized, as the reference quantizes them
        ck.true(to_q < 0.01 * to_exact, f"cast: mean error {to_q:.3g} against LogFMT, {to_exact:.3g} against exact")
    if kind == "bf16":  # nothing cast: the exact BF16 combine
        ck.true(to_q == to_exact, f"bf16: rows were cast although no chunk qualifies ({to_q:.3g} vs {to_exact:.3g})")


def logfmt_body(rank, world, rpn, transport, seed, T, hidden, num_experts, num_topk, backend="host", allow_nvlink=True):
    ck = Checker(rank)
    buf = make_ll_buffer(rank, world, rpn, transport, T, hidden, num_experts, backend, allow_nvlink)
    n = T - rank % 2  # ranks with fewer tokens than the maximum too
    for round_, kind in enumerate(("cast", "mix", "bf16", "mix")):
        ck.step = f"{kind} round {round_}"
        inp = make_ll_inputs(rank, seed + round_, n, hidden, num_topk, num_experts)
        idx, w = inp["idx"], inp["w"]
        x = _inputs(kind, rank, seed + round_, n, hidden)
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, num_experts, use_fp8=False)
        sim = _expert_outputs(recv_x, handle[1], rank)
        for e in range(sim.size(0)):
            sim[e, int(recv_count[e]) :] = float("nan")  # rows past the count are never read
        hook = round_ % 2 == 1
        extra = {}
        if round_ == 2:  # into the caller's tensor, whose stale values must all be replaced
            extra["out"] = torch.full((n, hidden), 7.0, dtype=BF16)
        if round_ == 3:  # accepted with LogFMT too (its values are the BF16 combine's, tested there)
            extra["combine_wait_recv_cost_stats"] = torch.zeros(world, dtype=torch.int64)
        combined, _, recv_hook = buf.low_latency_combine(
            sim.contiguous(), idx, w, handle, use_logfmt=True, return_recv_hook=hook, **extra
        )
        if hook:
            recv_hook()
        if "out" in extra:
            ck.true(combined.data_ptr() == extra["out"].data_ptr(), "combine did not return the out= tensor")
        if ck.tensor("combined_x", combined, BF16, (n, hidden)):
            _check(ck, kind, combined, *_references(x, idx, w, rank))
    ck.step = "zero_copy refused"
    try:
        buf.low_latency_combine(sim, idx, w, handle, use_logfmt=True, zero_copy=True)
        ck.fail("use_logfmt with zero_copy was accepted")
    except ValueError as e:
        ck.true("zero_copy" in str(e) and "use_logfmt" in str(e), f"the refusal names neither argument: {e}")
    all_gather(None)  # every rank is done before any Buffer goes away
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def small_hidden_body(rank, world, hidden):
    """A LogFMT combine at a hidden size the format refuses (below its sequence bits, or over 32 chunks): the
    ValueError's text ('' if none)."""
    buf = make_ll_buffer(rank, world, 1, "shm", 8, hidden, 2 * world)
    inp = make_ll_inputs(rank, 5, 8, hidden, 2, 2 * world, holes=0)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(inp["x_rand"], inp["idx"], 8, 2 * world, use_fp8=False)
    try:
        buf.low_latency_combine(recv_x, inp["idx"], inp["w"], handle, use_logfmt=True)
    except ValueError as e:
        return str(e)
    finally:
        all_gather(None)
        buf.destroy()
    return ""
