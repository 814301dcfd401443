"""EP benchmark: get_dispatch_layout, HT dispatch/combine and LL dispatch/combine through portep.Buffer, and DeepEP
V2's dispatch/combine through portep.ElasticBuffer on the same tokens, with DeepEP's byte conventions (docs/design.md
§8, Benchmarks and byte counting), and gloo's all_to_all_single of the same rows from the same run as the baseline
(with the index_select pack a user would need). Host backend: every rank is a process on this host.

Bytes: HT dispatch = rows received (self included) x hidden x 2 (BF16) or x (1 + 4/128) (FP8 with scales);
HT combine = the same rows x hidden x 2; V2's dispatch and combine are counted as HT's BF16 ones. LL dispatch = valid
(token, expert) selections x (H + H/128*4 + 16); LL combine = the same selections x 2H.
"""

import os
import time

from .report import Table
from .spawn import run_ranks

EMULATION = "host backend: a CPU emulation of the protocols over shared memory, not GPU speed"
NOTE = (
    f"{EMULATION}. Every rank is a process on this machine's CPUs; the figures compare portep versions on one "
    "machine, and portep with gloo's all_to_all_single of the same rows (with the index_select pack a user would "
    "need) measured in the same run."
)


def default_ranks():
    """One rank per core, 2 to 4: more ranks than cores measure the scheduler."""
    return max(2, min(4, os.cpu_count() or 2))


def _timed(fn, what, iterations, warmup, progress):
    """fn's output and one sample per iteration: ms from a barrier to the slowest rank's return."""
    import torch
    import torch.distributed as dist

    out, times = None, []
    for i in range(warmup + iterations):
        if progress:
            progress(f"ep: {what}, " + ("warm-up" if i < warmup else f"iteration {i - warmup + 1}/{iterations}"))
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t0
        t = torch.tensor([elapsed])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective op is as slow as its slowest rank
        if i >= warmup:
            times.append(float(t) * 1e3)
    return out, times


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


def _rank_body(
    rank,
    world,
    rpn,
    transport,
    ht_tokens,
    ll_tokens,
    hidden,
    topk,
    ht_experts,
    ll_experts,
    iterations,
    warmup,
    progress,
):
    import torch
    import torch.distributed as dist

    import portep

    progress = progress if rank == 0 else None
    timed = lambda fn, what: _timed(fn, what, iterations, warmup, progress)  # noqa: E731
    torch.set_num_threads(1)  # ranks share this host's cores
    if progress:
        progress(f"ep: {world} ranks up; making the HT Buffer")
    res = {}
    buf = portep.Buffer(
        dist.group.WORLD, 3 << 30, 0, num_ranks_per_node=rpn, transport=transport, explicitly_destroy=True
    )
    x, idx, w = _inputs(rank, ht_tokens, hidden, topk, ht_experts, 1)
    layout, res["layout"] = timed(lambda: buf.get_dispatch_layout(idx, ht_experts), "get_dispatch_layout")
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    kw = dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    d, res["ht_dispatch"] = timed(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw), "HT dispatch BF16")
    recv_rows = d[0].size(0)
    _, res["ht_combine"] = timed(lambda: buf.combine(d[0], d[4], topk_weights=d[2]), "HT combine BF16")
    x_fp8 = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.ones(ht_tokens, hidden // 128)
    _, res["ht_dispatch_fp8"] = timed(
        lambda: buf.dispatch((x_fp8, scales), topk_idx=idx, topk_weights=w, **kw), "HT dispatch FP8"
    )
    _, res["a2a"] = timed(lambda: _baseline_a2a(x, in_rank, world), "baseline gloo all_to_all_single")
    buf.destroy()
    res["ht_bytes"] = recv_rows * hidden * 2
    res.update(_v2_rows(rank, rpn, transport, x, idx, w, ht_experts, timed, progress))

    T = ll_tokens
    if progress:
        progress("ep: making the LL Buffer")
    ll_bytes = portep.Buffer.get_low_latency_rdma_size_hint(T, hidden, world, ll_experts)
    buf = portep.Buffer(
        dist.group.WORLD,
        0,
        ll_bytes,
        low_latency_mode=True,
        num_ranks_per_node=rpn,
        transport=transport,
        explicitly_destroy=True,
    )
    xl, idxl, wl = _inputs(rank, T, hidden, topk, ll_experts, 2)
    state = {}

    def ll_dispatch():
        state["d"] = buf.low_latency_dispatch(xl, idxl, T, ll_experts, use_fp8=True)
        return state["d"]

    ll_dispatch()
    recv_bf16 = torch.zeros(state["d"][0][0].shape, dtype=torch.bfloat16)
    _, res["ll_dispatch"] = timed(ll_dispatch, "LL dispatch FP8")
    _, res["ll_combine"] = timed(
        lambda: (ll_dispatch(), buf.low_latency_combine(recv_bf16, idxl, wl, state["d"][2])), "LL dispatch + combine"
    )
    buf.destroy()
    selections = int((idxl >= 0).sum())
    res["ll_dispatch_bytes"] = selections * (hidden + hidden // 128 * 4 + 16)
    res["ll_combine_bytes"] = selections * hidden * 2
    return res


def _v2_rows(rank, rpn, transport, x, idx, w, experts, timed, progress):
    """DeepEP V2's ElasticBuffer on the same tokens: dispatch, cached dispatch and combine (weights back)."""
    import torch.distributed as dist

    import portep

    if progress:
        progress("ep: making the V2 ElasticBuffer")
    T, H = x.shape
    buf = portep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=T,
        hidden=H,
        num_topk=idx.size(1),
        num_ranks_per_node=rpn,
        transport=transport,
        explicitly_destroy=True,
    )
    res = {"v2_bytes": buf.num_bytes}
    d, res["v2_dispatch"] = timed(lambda: buf.dispatch(x, idx, w, num_experts=experts), "V2 dispatch BF16")
    _, res["v2_cached"] = timed(lambda: buf.dispatch(x, handle=d[3]), "V2 cached dispatch BF16")
    _, res["v2_combine"] = timed(lambda: buf.combine(d[0], d[3], topk_weights=d[2]), "V2 combine BF16")
    buf.destroy()
    return res


def memory_table(tokens, hidden, topk):
    """MiB per rank at DeepEP's internode shapes (8 ranks per node): a V1 Buffer sized by DeepEP's hints next to
    the V2 ElasticBuffer's get_buffer_size_hint, on the CUDA backend (its rings do not grow with the tokens) and
    on the host backend (it lays out a whole dispatch)."""
    from portep.elastic.sizing import cuda_buffer_bytes, host_buffer_bytes, v1_buffer_bytes

    t = Table(
        f"ep: memory per rank, {tokens} tokens, hidden {hidden}, top-{topk}, FP8 dispatch sizing, 8 ranks per node",
        "MiB",
        "Computed, not measured: V1 = num_nvl_bytes + num_rdma_bytes from DeepEP's size hints (the larger of the "
        "dispatch and combine configs); V2 = ElasticBuffer.get_buffer_size_hint, which is what an ElasticBuffer "
        "sized by its MoE settings allocates (one V1 Buffer of that many bytes). V2's hints are 2 MiB aligned, as "
        "V2 defines them: where V1's bytes decide, V2's row is V1's rounded up to the next 2 MiB.",
    )
    mib = 1 << 20
    for ranks in (8, 16, 32, 64):
        t.add(f"{ranks} ranks: V1 Buffer (DeepEP's hints)", [v1_buffer_bytes(ranks, hidden) / mib])
        t.add(f"{ranks} ranks: V2 ElasticBuffer, CUDA backend", [cuda_buffer_bytes(ranks, 8, hidden, topk, True) / mib])
        host = host_buffer_bytes(ranks, 8, tokens, hidden, topk, True)
        t.add(f"{ranks} ranks: V2 ElasticBuffer, host backend", [host / mib])
    return t


def run(
    report,
    ranks=default_ranks(),
    ranks_per_node=None,
    transport="shm",
    ht_tokens=4096,
    ll_tokens=128,
    hidden=7168,
    topk=8,
    ht_experts=256,
    ll_experts=288,
    iterations=10,
    warmup=1,
):
    rpn = ranks_per_node or ranks
    shape = (
        f"{ranks} ranks ({rpn} per node), transport {transport}; HT {ht_tokens} tokens, LL {ll_tokens} tokens, "
        f"hidden {hidden}, top-{topk}, {ht_experts} (HT) / {ll_experts} (LL) experts"
    )
    report.say(f"ep: {shape}; {EMULATION}")
    report.progress(f"ep: starting {ranks} rank processes (each imports torch and portep)")
    out = run_ranks(
        _rank_body,
        ranks,
        args=(
            rpn,
            transport,
            ht_tokens,
            ll_tokens,
            hidden,
            topk,
            ht_experts,
            ll_experts,
            iterations,
            warmup,
            report.progress,
        ),
        timeout=1800,
    )
    r0 = out[0]
    ht_bytes = r0["ht_bytes"]  # DeepEP prints each rank's received bytes
    t = Table(
        f"ep: host backend, {ranks} ranks, HT {ht_tokens} / LL {ll_tokens} tokens, hidden {hidden}",
        "ms",
        f"{NOTE} Each sample is one call, from a barrier to the slowest rank's return; {warmup} untimed "
        "warm-up call(s) before each op. GB/s: rank 0's bytes as DeepEP counts them, at the "
        "median.",
    )
    t.add("get_dispatch_layout", r0["layout"])
    t.add("HT dispatch BF16", r0["ht_dispatch"], ht_bytes)
    t.add("baseline: gloo all_to_all_single + pack, HT BF16 rows", r0["a2a"], ht_bytes)
    t.add("HT dispatch FP8", r0["ht_dispatch_fp8"], ht_bytes * (1 + 4 / 128) / 2)
    t.add("HT combine BF16", r0["ht_combine"], ht_bytes)
    t.add("LL dispatch FP8", r0["ll_dispatch"], r0["ll_dispatch_bytes"])
    t.add("LL dispatch + combine", r0["ll_combine"], r0["ll_dispatch_bytes"] + r0["ll_combine_bytes"])
    t.add("V2 ElasticBuffer dispatch BF16", r0["v2_dispatch"], ht_bytes)
    t.add("V2 ElasticBuffer cached dispatch BF16", r0["v2_cached"], ht_bytes)
    t.add("V2 ElasticBuffer combine BF16 (weights back)", r0["v2_combine"], ht_bytes)
    report.add(t)
    report.add(memory_table(ht_tokens, hidden, topk))
    return out
