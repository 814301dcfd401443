"""Normal-mode (HT) dispatch/combine on GPUs of one node through portep.Buffer(backend='cuda'), DeepEP's test
shape (4096 tokens per rank, hidden 7168, top-8, 256 experts) and byte counting, next to NCCL all_to_all_single
from the same run (the transfer alone, and with the index_select pack a user would add).

Bytes as DeepEP's test_intranode.py: rows received (this rank's own included) x row bytes; FP8 rows count
hidden + hidden/128*4; combine counts the BF16 rows it sends back. Times are medians of CUDA events around each
call, which waits for the GPU (rank 0). As in DeepEP's tuning runs, dispatch and combine reuse a handle (cached
dispatch: no CPU wait); the non-cached dispatch, which waits on the CPU for the count exchange, is reported too.
Each figure names the SMs it used (config.num_sms: half send, half receive)."""

from .ll_gpu import _timed, ll_inputs
from .report import MissingHardware, Table
from .spawn import run_ranks


NOTE = (
    "GPUs of one node: the ranks' kernels store into each other's buffers over NVLink (with "
    "PORTEP_TEST_SHARE_GPU=1 the ranks time-slice one GPU: correctness, not speed). Rank 0; samples in us, CUDA "
    "events around each call, which waits for the GPU."
)

DEEPEP = {"dispatch BF16": 345.0, "dispatch FP8": 245.0, "combine": 408.0, "layout": 52.0}  # 24 SMs, gpu-machine.md


def ht_inputs(rank, N, H, K, E):
    """ll_inputs' seeded tokens, top-k and weights, plus the FP8 cast (per 128 channels) with column-major scales,
    as DeepEP's tests pass them."""
    x, idx, w = ll_inputs(rank + 100, N, H, K, E)
    x_fp8, scales = fp8_per_128(x)
    return x, idx, w, (x_fp8, scales.T.contiguous().T)


def fp8_per_128(x):
    """x (BF16 [N, H]) cast to float8_e4m3fn with a float32 scale per 128 channels ([N, H // 128], row-major)."""
    import torch

    N, H = x.shape
    amax = x.float().view(N, H // 128, 128).abs().amax(-1).clamp(min=1e-4)
    x_fp8 = (x.float().view(N, H // 128, 128) * (448.0 / amax).unsqueeze(-1)).view(N, H).to(torch.float8_e4m3fn)
    return x_fp8, amax / 448.0


def deepep_nvl_bytes(hidden, ranks, num_sms=24):
    """num_nvl_bytes as DeepEP's README sizes a Buffer for BF16 rows of `hidden` (its Config's hint for num_sms, the
    larger of two NVL chunk sizes); portep's rings take whatever it holds."""
    import portep

    return max(portep.Config(num_sms, s, 256, 6, 128).get_nvl_buffer_size_hint(hidden * 2, ranks) for s in (24, 10))


def _portep_times(buf, x, idx, w, fp8, E, num_sms, iterations):
    import portep

    cfg = portep.Config(num_sms, 6, 256, 6, 256)
    lay = buf.get_dispatch_layout(idx, E)
    args = dict(
        num_tokens_per_rank=lay[0],
        num_tokens_per_rdma_rank=lay[1],
        num_tokens_per_expert=lay[2],
        is_token_in_rank=lay[3],
        topk_idx=idx,
        topk_weights=w,
        config=cfg,
    )
    recv = buf.dispatch(x, **args)
    handle = recv[4]
    y = recv[0]
    for _ in range(5):
        buf.dispatch(x, handle=handle, config=cfg)
        buf.combine(y, handle, config=cfg)
        buf.dispatch(fp8, handle=handle, config=cfg)
    return {
        "rows": y.size(0),
        "dispatch BF16": _timed(lambda: buf.dispatch(x, handle=handle, config=cfg), iterations),
        "dispatch FP8": _timed(lambda: buf.dispatch(fp8, handle=handle, config=cfg), iterations),
        "combine": _timed(lambda: buf.combine(y, handle, config=cfg), iterations),
        "dispatch BF16, non-cached": _timed(lambda: buf.dispatch(x, **args), iterations),
    }


def _nccl_times(x, idx, world, E, iterations, group):
    import torch
    import torch.distributed as dist

    N, H = x.shape
    E_l = E // world
    in_rank = torch.zeros(N, world, dtype=torch.bool, device=x.device)
    in_rank.scatter_(1, idx // E_l, True)
    counts = in_rank.sum(0).cpu()
    recv_counts = torch.empty(world, dtype=counts.dtype, device=x.device)
    dist.all_to_all_single(recv_counts, counts.to(x.device), group=group)
    recv_counts = recv_counts.cpu()
    rows = torch.cat([torch.nonzero(in_rank[:, d])[:, 0] for d in range(world)])
    send = torch.empty(int(counts.sum()), H, dtype=x.dtype, device=x.device)
    recv = torch.empty(int(recv_counts.sum()), H, dtype=x.dtype, device=x.device)
    sizes_in, sizes_out = recv_counts.tolist(), counts.tolist()

    def transfer():
        dist.all_to_all_single(recv, send, sizes_in, sizes_out, group=group)

    def pack_and_transfer():
        torch.index_select(x, 0, rows, out=send)
        transfer()

    for _ in range(5):
        pack_and_transfer()
    return {"transfer": _timed(transfer, iterations), "pack + transfer": _timed(pack_and_transfer, iterations)}


def _rank_body(rank, world, N, H, K, E, iterations, sms_list, nvl_bytes, progress):
    import torch
    import torch.distributed as dist

    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())  # PORTEP_TEST_SHARE_GPU=1: ranks share one GPU
    nccl = dist.new_group(backend="nccl") if torch.cuda.device_count() >= world else None
    x, idx, w, fp8 = ht_inputs(rank, N, H, K, E)
    buf = portep.Buffer(
        dist.group.WORLD, nvl_bytes, 0, num_ranks_per_node=world, explicitly_destroy=True, backend="cuda"
    )
    say = progress if rank == 0 else (lambda what: None)
    for _ in range(5):
        buf.get_dispatch_layout(idx, E)
    say("gpu-ht: get_dispatch_layout")
    results = {"layout": _timed(lambda: buf.get_dispatch_layout(idx, E), iterations)}
    for sms in sms_list:
        say(f"gpu-ht: {sms} SMs: dispatch BF16, FP8, combine, non-cached dispatch")
        results[sms] = _portep_times(buf, x, idx, w, fp8, E, sms, iterations)
    torch.cuda.synchronize()
    buf.destroy()
    shared = torch.cuda.device_count() < world  # NCCL refuses two ranks on one GPU
    if not shared:
        say("gpu-ht: baseline, NCCL all_to_all_single of the same rows")
    results["NCCL"] = None if shared else _nccl_times(x, idx, world, E, iterations, nccl)
    return results


def run(report, ranks=2, tokens=4096, hidden=7168, topk=8, experts=256, iterations=20, sms_list=(24, 8, 16, 32)):
    import os

    import torch

    if torch.cuda.device_count() < ranks and os.environ.get("PORTEP_TEST_SHARE_GPU") != "1":
        raise MissingHardware(f"gpu-ht needs {ranks} GPUs, this machine has {torch.cuda.device_count()}")
    nvl_bytes = deepep_nvl_bytes(hidden, ranks)
    shape = f"EP{ranks}, {tokens} tokens per rank, hidden {hidden}, top-{topk}, {experts} experts"
    report.say(f"gpu-ht: {shape}; num_nvl_bytes {nvl_bytes} (DeepEP's size hint for 24 SMs); {NOTE}")
    report.progress(f"gpu-ht: starting {ranks} rank processes")
    out = run_ranks(
        _rank_body,
        ranks,
        args=(tokens, hidden, topk, experts, iterations, tuple(sms_list), nvl_bytes, report.progress),
        timeout=600,
    )
    for t in ht_tables(out[0], shape, hidden, iterations, sms_list):
        report.add(t)
    return out


def ht_tables(r0, shape, hidden, iterations, sms_list):
    """One table per SM count, each with the same run's NCCL rows; get_dispatch_layout in the first."""
    note = (
        f"{NOTE} {iterations} calls per row; dispatch and combine reuse a handle (cached dispatch, no CPU wait) as "
        "in DeepEP's tuning runs, the non-cached dispatch waits on the CPU for the count exchange. GB/s at the "
        "median, counted as DeepEP does (rows received x row bytes, own rows included)."
    )
    nccl = r0["NCCL"]
    tables = []
    for sms in sms_list:
        r = r0[sms]
        bf16 = r["rows"] * hidden * 2
        fp8 = r["rows"] * (hidden + hidden // 128 * 4)
        t = Table(f"gpu-ht: {sms} SMs, {shape}", "us", note, extra_columns=("DeepEP V1 us (quoted)",))
        for key, nbytes in (
            ("dispatch BF16", bf16),
            ("dispatch FP8", fp8),
            ("combine", bf16),
            ("dispatch BF16, non-cached", bf16),
        ):
            ref = DEEPEP.get(key) if sms == 24 else None
            t.add(key, r[key], nbytes, {"DeepEP V1 us (quoted)": "-" if ref is None else f"{ref:.1f}"})
        if not tables:
            t.add("get_dispatch_layout", r0["layout"], extra={"DeepEP V1 us (quoted)": f"{DEEPEP['layout']:.1f}"})
        if nccl is None:
            t.line("no NCCL baseline: the ranks share one GPU, which NCCL refuses")
        else:
            t.add("baseline: NCCL all_to_all_single, BF16 rows (transfer)", nccl["transfer"], bf16)
            t.add(
                "baseline: NCCL all_to_all_single, BF16 rows (index_select pack + transfer)",
                nccl["pack + transfer"],
                bf16,
            )
        tables.append(t)
    return tables
