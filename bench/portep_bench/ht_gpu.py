"""Normal-mode (HT) dispatch/combine on GPUs of one node through portep.Buffer(backend='cuda'), DeepEP's test
shape (4096 tokens per rank, hidden 7168, top-8, 256 experts) and byte counting, next to NCCL all_to_all_single
from the same run (the transfer alone, and with the index_select pack a user would add).

Bytes as DeepEP's test_intranode.py: rows received (this rank's own included) x row bytes; FP8 rows count
hidden + hidden/128*4; combine counts the BF16 rows it sends back. Times are medians of CUDA events around each
call, which waits for the GPU (rank 0). As in DeepEP's tuning runs, dispatch and combine reuse a handle (cached
dispatch: no CPU wait); the non-cached dispatch, which waits on the CPU for the count exchange, is reported too.
Each figure names the SMs it used (config.num_sms: half send, half receive)."""

from .ll_gpu import _timed, ll_inputs
from .spawn import run_ranks
from .stats import table

DEEPEP = {"dispatch BF16": 345.0, "dispatch FP8": 245.0, "combine": 408.0, "layout": 52.0}  # 24 SMs, gpu-machine.md


def ht_inputs(rank, N, H, K, E):
    """ll_inputs' seeded tokens, top-k and weights, plus the FP8 cast (per 128 channels) with column-major scales,
    as DeepEP's tests pass them."""
    import torch

    x, idx, w = ll_inputs(rank + 100, N, H, K, E)
    amax = x.float().view(N, H // 128, 128).abs().amax(-1).clamp(min=1e-4)
    x_fp8 = (x.float().view(N, H // 128, 128) * (448.0 / amax).unsqueeze(-1)).view(N, H).to(torch.float8_e4m3fn)
    return x, idx, w, (x_fp8, (amax / 448.0).T.contiguous().T)


def _portep_times(buf, x, idx, w, fp8, E, num_sms, iterations):
    import portep

    cfg = portep.Config(num_sms, 6, 256, 6, 256)
    lay = buf.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], num_tokens_per_expert=lay[2],
                is_token_in_rank=lay[3], topk_idx=idx, topk_weights=w, config=cfg)
    recv = buf.dispatch(x, **args)
    handle = recv[4]
    y = recv[0]
    for _ in range(5):
        buf.dispatch(x, handle=handle, config=cfg)
        buf.combine(y, handle, config=cfg)
        buf.dispatch(fp8, handle=handle, config=cfg)
    return {"rows": y.size(0),
            "dispatch BF16": _timed(lambda: buf.dispatch(x, handle=handle, config=cfg), iterations),
            "dispatch FP8": _timed(lambda: buf.dispatch(fp8, handle=handle, config=cfg), iterations),
            "combine": _timed(lambda: buf.combine(y, handle, config=cfg), iterations),
            "dispatch BF16, non-cached": _timed(lambda: buf.dispatch(x, **args), iterations)}


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


def _rank_body(rank, world, N, H, K, E, iterations, sms_list, nvl_bytes):
    import torch
    import torch.distributed as dist

    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())  # PORTEP_TEST_SHARE_GPU=1: ranks share one GPU
    nccl = dist.new_group(backend="nccl") if torch.cuda.device_count() >= world else None
    x, idx, w, fp8 = ht_inputs(rank, N, H, K, E)
    buf = portep.Buffer(dist.group.WORLD, nvl_bytes, 0, num_ranks_per_node=world, explicitly_destroy=True,
                        backend="cuda")
    for _ in range(5):
        buf.get_dispatch_layout(idx, E)
    results = {"layout": _timed(lambda: buf.get_dispatch_layout(idx, E), iterations)}
    for sms in sms_list:
        results[sms] = _portep_times(buf, x, idx, w, fp8, E, sms, iterations)
    torch.cuda.synchronize()
    buf.destroy()
    shared = torch.cuda.device_count() < world  # NCCL refuses two ranks on one GPU
    results["NCCL"] = None if shared else _nccl_times(x, idx, world, E, iterations, nccl)
    return results


def run(ranks=2, tokens=4096, hidden=7168, topk=8, experts=256, iterations=20, sms_list=(24, 8, 16, 32),
        printer=print):
    import os

    import torch

    if torch.cuda.device_count() < ranks and os.environ.get("PORTEP_TEST_SHARE_GPU") != "1":
        raise RuntimeError(f"the GPU HT benchmark needs {ranks} GPUs, this machine has {torch.cuda.device_count()}")
    import portep

    # sized as DeepEP's README asks (its Config's hint, 24 SMs); portep's rings take whatever it holds
    nvl_bytes = max(portep.Config(24, s, 256, 6, 128).get_nvl_buffer_size_hint(hidden * 2, ranks) for s in (24, 10))
    out = run_ranks(_rank_body, ranks, args=(tokens, hidden, topk, experts, iterations, tuple(sms_list), nvl_bytes),
                    timeout=600)
    r0 = out[0]
    nccl = r0["NCCL"]
    printer(f"HT, EP{ranks}, {tokens} tokens per rank, hidden {hidden}, top-{topk}, {experts} experts; rank 0, medians "
            f"of {iterations} calls with CUDA events around each; GB/s counted as DeepEP does (rows received x row "
            f"bytes, own rows included); num_nvl_bytes {nvl_bytes} (DeepEP's size hint for 24 SMs)")
    rows = []
    for sms in sms_list:
        r = r0[sms]
        bf16 = r["rows"] * hidden * 2
        fp8 = r["rows"] * (hidden + hidden // 128 * 4)
        for key, nbytes in (("dispatch BF16", bf16), ("dispatch FP8", fp8), ("combine", bf16),
                            ("dispatch BF16, non-cached", bf16)):
            t = r[key]
            ref = DEEPEP.get(key)
            nccl_cell = "-" if key == "dispatch FP8" else ("n/a (ranks share one GPU)" if nccl is None else
                                                            f"{nccl['transfer']:.1f} / {nccl['pack + transfer']:.1f}")
            rows.append([key, sms, f"{t:.1f}", f"{nbytes / t / 1e3:.1f}", nccl_cell,
                         "-" if ref is None or sms != 24 else f"{ref:.1f}"])
    rows.append(["get_dispatch_layout", "-", f"{r0['layout']:.1f}", "-", "-", f"{DEEPEP['layout']:.1f}"])
    printer(table(["op", "SMs", "us", "GB/s", "NCCL BF16 us (transfer / pack+transfer)", "DeepEP V1 us"], rows))
    return out
