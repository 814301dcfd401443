"""EP benchmark: get_dispatch_layout, HT dispatch/combine and LL dispatch/combine through portep.Buffer, with DeepEP's
byte conventions (docs/design.md §8, Benchmarks and byte counting), and gloo's all_to_all_single of the same rows
from the same run as the baseline (with the index_select pack a user would need). Host backend: every rank is a
process on this host.

Bytes: HT dispatch = rows received (self included) x hidden x 2 (BF16) or x (1 + 4/128) (FP8 with scales);
HT combine = the same rows x hidden x 2. LL dispatch = valid (token, expert) selections x (H + H/128*4 + 16);
LL combine = the same selections x 2H.
"""

import time

from .spawn import run_ranks
from .stats import median, table


def _timed(fn, iterations):
    import torch
    import torch.distributed as dist

    out, times = None, []
    for _ in range(iterations):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t0
        t = torch.tensor([elapsed])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective op is as slow as its slowest rank
        times.append(float(t))
    return out, median(times)


def _inputs(rank, tokens, hidden, topk, experts, seed):
    import torch

    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=g) + 1
    idx = torch.topk(scores, topk, dim=1).indices
    weights = torch.rand(tokens, topk, generator=g)
    return x, idx, weights


def _baseline_a2a(x, is_token_in_rank, world):
    """The same HT dispatch as a user would do it with all_to_all_single (index_select pack + transfer)."""
    import torch
    import torch.distributed as dist

    counts = is_token_in_rank.sum(0)
    send = torch.cat([x.index_select(0, torch.nonzero(is_token_in_rank[:, d])[:, 0]) for d in range(world)])
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    recv = torch.empty(int(recv_counts.sum()), x.size(1), dtype=x.dtype)
    dist.all_to_all_single(recv, send, recv_counts.tolist(), counts.tolist())
    return recv


def _rank_body(rank, world, rpn, transport, ht_tokens, ll_tokens, hidden, topk, ht_experts, ll_experts, iterations):
    import torch
    import torch.distributed as dist

    import portep

    torch.set_num_threads(1)  # ranks share this host's cores
    res = {}
    buf = portep.Buffer(dist.group.WORLD, 3 << 30, 0, num_ranks_per_node=rpn, transport=transport,
                        explicitly_destroy=True)
    x, idx, w = _inputs(rank, ht_tokens, hidden, topk, ht_experts, 1)
    layout, res["layout"] = _timed(lambda: buf.get_dispatch_layout(idx, ht_experts), iterations)
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    kw = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
              num_tokens_per_expert=per_expert)
    d, res["ht_dispatch"] = _timed(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw), iterations)
    recv_rows = d[0].size(0)
    _, res["ht_combine"] = _timed(lambda: buf.combine(d[0], d[4], topk_weights=d[2]), iterations)
    x_fp8 = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.ones(ht_tokens, hidden // 128)
    _, res["ht_dispatch_fp8"] = _timed(lambda: buf.dispatch((x_fp8, scales), topk_idx=idx, topk_weights=w, **kw),
                                       iterations)
    _, res["a2a"] = _timed(lambda: _baseline_a2a(x, in_rank, world), iterations)
    buf.destroy()
    res["ht_bytes"] = recv_rows * hidden * 2

    T = ll_tokens
    ll_bytes = portep.Buffer.get_low_latency_rdma_size_hint(T, hidden, world, ll_experts)
    buf = portep.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True,
                        num_ranks_per_node=rpn, transport=transport, explicitly_destroy=True)
    xl, idxl, wl = _inputs(rank, T, hidden, topk, ll_experts, 2)
    state = {}

    def ll_dispatch():
        state["d"] = buf.low_latency_dispatch(xl, idxl, T, ll_experts, use_fp8=True)
        return state["d"]

    ll_dispatch()
    recv_bf16 = torch.zeros(state["d"][0][0].shape, dtype=torch.bfloat16)
    _, res["ll_dispatch"] = _timed(ll_dispatch, iterations)
    _, res["ll_combine"] = _timed(lambda: (ll_dispatch(), buf.low_latency_combine(recv_bf16, idxl, wl, state["d"][2])),
                                  iterations)
    buf.destroy()
    selections = int((idxl >= 0).sum())
    res["ll_dispatch_bytes"] = selections * (hidden + hidden // 128 * 4 + 16)
    res["ll_combine_bytes"] = selections * hidden * 2
    return res


def run(ranks=4, ranks_per_node=None, transport="shm", ht_tokens=4096, ll_tokens=128, hidden=7168, topk=8,
        ht_experts=256, ll_experts=288, iterations=3, printer=print):
    rpn = ranks_per_node or ranks
    printer(f"portep EP benchmark: host backend, {ranks} ranks ({rpn} per node), transport {transport}; "
            f"HT {ht_tokens} tokens, LL {ll_tokens} tokens, hidden {hidden}, top-{topk}, experts {ht_experts} (HT) / "
            f"{ll_experts} (LL); median of {iterations} runs of the slowest rank; baseline: gloo all_to_all_single "
            f"with the index_select pack, same run")
    out = run_ranks(_rank_body, ranks, args=(rpn, transport, ht_tokens, ll_tokens, hidden, topk, ht_experts,
                                             ll_experts, iterations), timeout=1800)
    r0 = out[0]
    ht_bytes = r0["ht_bytes"]  # DeepEP prints each rank's received bytes
    a2a = r0["a2a"]

    def gbs(nbytes, seconds):
        return f"{nbytes / seconds / 1e9:.2f}"

    rows = [
        ["get_dispatch_layout", f"{r0['layout'] * 1e3:.2f}", "-", "-", "-"],
        ["HT dispatch BF16", f"{r0['ht_dispatch'] * 1e3:.1f}", gbs(ht_bytes, r0["ht_dispatch"]), f"{a2a * 1e3:.1f}",
         gbs(ht_bytes, a2a)],
        ["HT dispatch FP8", f"{r0['ht_dispatch_fp8'] * 1e3:.1f}",
         gbs(ht_bytes * (1 + 4 / 128) / 2, r0["ht_dispatch_fp8"]), "-", "-"],
        ["HT combine BF16", f"{r0['ht_combine'] * 1e3:.1f}", gbs(ht_bytes, r0["ht_combine"]), "-", "-"],
        ["LL dispatch FP8", f"{r0['ll_dispatch'] * 1e3:.1f}", gbs(r0["ll_dispatch_bytes"], r0["ll_dispatch"]), "-", "-"],
        ["LL dispatch + combine", f"{r0['ll_combine'] * 1e3:.1f}",
         gbs(r0["ll_dispatch_bytes"] + r0["ll_combine_bytes"], r0["ll_combine"]), "-", "-"],
    ]
    printer("")
    printer(table(["operation", "portep ms", "GB/s (DeepEP bytes, rank 0)", "baseline a2a ms", "baseline GB/s"], rows))
    return out
