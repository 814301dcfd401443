"""An MoE layer over portep.Buffer: a top-k gate, a few experts per rank, normal-mode dispatch -> expert compute
-> combine, then the same layer through the low-latency path, both checked against a float64 reference.

    torchrun --nproc-per-node 2 examples/moe_layer.py

CPU: the host backend over a gloo group. With a GPU (torch.cuda.is_available()): backend 'cuda', one GPU per
rank, over an NCCL group. Prints OK on every rank, or raises.
"""

import os

import portep  # first: with PORTEP_GPU_PROXY_COPIES=1 it sets CUDA_DEVICE_MAX_CONNECTIONS (portep/config.py)
import torch
import torch.distributed as dist

HIDDEN, EXPERTS_PER_RANK, TOP_K, T = 512, 4, 2, 64  # T: most tokens a rank sends in one LL call


def moe_reference(x, gate, experts):
    """This rank's tokens through the whole layer in float64 (every rank builds every expert from one seed)."""
    scores = torch.softmax(x.double() @ gate.weight.double().t(), dim=1)
    w, idx = torch.topk(scores, TOP_K, dim=1)
    w = w / w.sum(1, keepdim=True)
    y = torch.stack([x.double() @ e.weight.double().t() for e in experts])  # [E, N, H]
    picked = w.unsqueeze(2) * y[idx, torch.arange(x.size(0)).unsqueeze(1)]  # [N, K, H]
    return picked.sum(1), picked.abs().sum(1), idx, w.float()  # result, its error bound's scale, routing


def check(name, got, ref, bound):
    """BF16 tolerance, in float64: the expert outputs and the result are each rounded to BF16 once (unit roundoff
    2^-8), so an element may be off by 2 * 2^-8 of sum_k |w_k| |y_k|; allow twice that."""
    err = (got.double().cpu() - ref).abs()
    bad = err > 2**-6 * bound + 1e-6
    if bad.any():
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} elements differ (max error {err.max():.3g})")


def setup():
    """The process group (NCCL with a GPU, else gloo), this rank's experts and tokens, and the float64 reference:
    (rank, world, device, num_experts, mine (this rank's experts), n, x, topk_idx, topk_w, ref, bound)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    E, E_l = EXPERTS_PER_RANK * world, EXPERTS_PER_RANK

    torch.manual_seed(0)  # the same gate and experts on every rank; this rank keeps experts [rank*E_l, +E_l)
    gate = torch.nn.Linear(HIDDEN, E, bias=False)
    experts = [torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(E)]
    mine = [e.to(dev) for e in experts[rank * E_l : (rank + 1) * E_l]]
    g = torch.Generator().manual_seed(100 + rank)
    n = T - 8 * (rank % 3)  # ranks send different numbers of tokens
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        ref, bound, idx_cpu, w_cpu = moe_reference(x, gate, experts)
    return rank, world, dev, E, mine, n, x.to(dev), idx_cpu.to(dev), w_cpu.to(dev), ref, bound


def main():
    rank, world, dev, E, mine, n, x, topk_idx, topk_w, ref, bound = setup()
    cuda = dev.type == "cuda"

    hint = max(
        portep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(HIDDEN * 2, world),
        portep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(HIDDEN * 2, world),
    )
    ll_bytes = portep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, world, E)
    buf = portep.Buffer(
        dist.group.WORLD,
        hint,
        ll_bytes,
        low_latency_mode=True,
        explicitly_destroy=True,
        backend="cuda" if cuda else "host",
        timeout_s=60,
    )
    with torch.no_grad():
        # ---- normal mode: each token once to every rank that holds one of its experts ----
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_w,
        )
        y = torch.zeros(recv_x.size(0), HIDDEN, device=dev)
        for e, expert in enumerate(mine):  # recv_idx: local expert ids, -1 where another rank's expert
            sel = recv_idx == e
            rows = sel.any(1)
            w = (recv_w * sel).sum(1, keepdim=True)
            y[rows] += w[rows] * expert(recv_x[rows].float())
        combined, _, _ = buf.combine(y.to(torch.bfloat16), handle)  # sums each token's rows from every rank
        check("normal mode", combined, ref, bound)

        # ---- low-latency mode: one message per (token, expert), expert-major on the receiver ----
        buf.clean_low_latency_buffer(T, HIDDEN, E)  # both modes may share the buffer (README)
        recv, count, ll_handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        out = torch.zeros_like(recv)  # [E_l, world * T, HIDDEN]; the first count[e] rows of expert e are valid
        for e, expert in enumerate(mine):
            c = int(count[e])
            out[e, :c] = expert(recv[e, :c].float()).to(torch.bfloat16)
        ll_combined, _, _ = buf.low_latency_combine(out, topk_idx, topk_w, ll_handle)  # weighted sum per token
        check("low-latency mode", ll_combined, ref, bound)

        check_is_not_vacuous(ll_combined, ref, bound)
    buf.destroy()
    finish(rank, world, f"{buf.backend} backend, {n} tokens, {E} experts, top-{TOP_K}")


def check_is_not_vacuous(result, ref, bound):
    """A result with one token's rows swapped for another's must fail check()."""
    try:
        check("swapped", result.roll(1, 0), ref, bound)
    except AssertionError:
        return
    raise RuntimeError("the check accepted a wrong result")


def finish(rank, world, what):
    dist.barrier()
    print(f"rank {rank}/{world} ({what}): OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
