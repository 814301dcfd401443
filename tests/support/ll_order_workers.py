"""Rank body for the LL combine's arithmetic order (tests/host/test_deepep_ll.py): every backend must give these bits,
and the CUDA backend's partial sums between direct peers need exactly this order."""

import torch
import torch.distributed as dist

import deepep_reference as ref
import portep
from deepep_workers import BF16, Checker, make_ll_inputs


def reference_combine(x, idx, w, E_l, grouped, rank):
    """FP32, each product and sum rounded on its own (separate torch ops), of the test experts' outputs
    (ref.expert_output: a factor per expert, an offset per expert and source rank, this rank). grouped: per owner
    rank the rows in top-k order, then those sums in rank order; else all rows in top-k order."""
    N, H = x.shape
    out = torch.empty(N, H, dtype=BF16)
    for t in range(N):
        acc = torch.zeros(H, dtype=torch.float32)
        experts = [int(e) for e in idx[t]]
        owners = sorted({e // E_l for e in experts if e >= 0}) if grouped else [None]
        for owner in owners:
            part = torch.zeros(H, dtype=torch.float32)
            for k, e in enumerate(experts):
                if e >= 0 and (owner is None or e // E_l == owner):
                    part = part + w[t, k] * ref.expert_output(x[t], e, rank).float()
            acc = acc + part
        out[t] = acc.to(BF16)
    return out


def combine_order_body(rank, world, rpn, transport, seed, T, H, E, K):
    ck = Checker(rank)
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = portep.Buffer(
        dist.group.WORLD,
        0,
        nbytes,
        low_latency_mode=True,
        num_ranks_per_node=rpn,
        transport=transport,
        explicitly_destroy=True,
        backend="host",
    )
    inp = make_ll_inputs(rank, seed, T, H, K, E)
    x, idx = inp["x_rand"], inp["idx"]
    # weights of alternating sign that nearly cancel: the result is small against its terms, so the order of the
    # FP32 sums shows in the BF16 bits
    g = torch.Generator().manual_seed(seed * 31 + rank)
    w = torch.tensor([1.0, -1.0] * K)[:K] * (1 + 0.01 * torch.rand(T, K, generator=g))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    E_l = E // world
    outputs = ref.ll_expert_outputs(recv_x, handle[1], rank)
    combined = buf.low_latency_combine(outputs, idx, w, handle)[0]
    grouped = reference_combine(x, idx, w, E_l, True, rank)
    ck.equal("combined_x vs per-owner-rank sums in rank order", combined, grouped)
    # elements where summing all rows in top-k order gives other bits (the test asserts some rank has any, so
    # that the check above can tell the two orders apart)
    plain = reference_combine(x, idx, w, E_l, False, rank)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks, "order_sensitive": int((grouped != plain).sum())}
