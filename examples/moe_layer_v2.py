"""The MoE layer of moe_layer.py through DeepEP V2's API (portep.ElasticBuffer): a top-k gate, a few experts per
rank; dispatch -> expert compute -> combine in V2's plain layout, then in its expanded layout (one row per (token,
local expert), each expert's rows contiguous) with fixed worst-case shapes (do_cpu_sync=False, what a CUDA graph
captures), both checked against a float64 reference.

    torchrun --nproc-per-node 2 examples/moe_layer_v2.py

CPU: the host backend over a gloo group. With a GPU (torch.cuda.is_available()): backend 'cuda', one GPU per
rank, over an NCCL group. Prints OK on every rank, or raises.
"""

import os

import portep
import torch
import torch.distributed as dist

HIDDEN, EXPERTS_PER_RANK, TOP_K, T = 512, 4, 2, 64  # T: most tokens a rank sends (num_max_tokens_per_rank)


def moe_reference(x, gate, experts):
    """This rank's tokens through the whole layer in float64 (every rank builds every expert from one seed)."""
    scores = torch.softmax(x.double() @ gate.weight.double().t(), dim=1)
    w, idx = torch.topk(scores, TOP_K, dim=1)
    w = w / w.sum(1, keepdim=True)
    y = torch.stack([x.double() @ e.weight.double().t() for e in experts])  # [E, N, H]
    picked = w.unsqueeze(2) * y[idx, torch.arange(x.size(0)).unsqueeze(1)]  # [N, K, H]
    return picked.sum(1), picked.abs().sum(1), idx, w.float()


def check(name, got, ref, bound):
    """BF16 tolerance, in float64: the weighted expert outputs, the partials and the result are each rounded to BF16
    once (unit roundoff 2^-8), so an element may be off by 3 * 2^-8 of sum_k |w_k| |y_k|; allow a little more."""
    err = (got.double().cpu() - ref).abs()
    bad = err > 2**-6 * bound + 1e-6
    if bad.any():
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} elements differ (max error {err.max():.3g})")


def main():
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
    x, topk_idx, topk_w = x.to(dev), idx_cpu.to(dev), w_cpu.to(dev)

    buf = portep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=T,
        hidden=HIDDEN,
        num_topk=TOP_K,
        explicitly_destroy=True,
        backend="cuda" if cuda else "host",
    )
    with torch.no_grad():
        # ---- plain layout: each token once per rank; recv_topk_idx holds local expert ids, -1 elsewhere ----
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx, topk_w, num_experts=E)
        y = torch.zeros(recv_x.size(0), HIDDEN, device=dev)
        for e, expert in enumerate(mine):
            sel = recv_idx == e
            w = (recv_w * sel).sum(1, keepdim=True)  # V2's combine applies no weights: the experts do
            y += w * expert(recv_x.float()) * sel.any(1, keepdim=True)
        combined, _, _ = buf.combine(y.to(torch.bfloat16), handle)
        check("plain layout", combined, ref, bound)

        # ---- expanded layout, fixed shapes: expert e's rows are [psum[e] - count[e], psum[e]) ----
        recv_x, _, recv_w, handle, _ = buf.dispatch(
            x, topk_idx, topk_w, num_experts=E, do_expand=True, expert_alignment=8, do_cpu_sync=False
        )
        ends = handle.psum_num_recv_tokens_per_expert.cpu()  # each expert's aligned start plus its count
        counts = handle.num_unaligned_recv_tokens_per_expert.cpu()
        y = torch.zeros(recv_x.size(0), HIDDEN, device=dev)  # worst-case rows; padding rows stay 0
        for e, expert in enumerate(mine):
            rows = slice(int(ends[e] - counts[e]), int(ends[e]))
            y[rows] = recv_w[rows, None] * expert(recv_x[rows].float())
        combined, _, _ = buf.combine(y.to(torch.bfloat16), handle)
        check("expanded layout", combined, ref, bound)

        try:  # the check is not vacuous: a result with one token's rows swapped for another's must fail it
            check("swapped", combined.roll(1, 0), ref, bound)
            raise RuntimeError("the check accepted a wrong result")
        except AssertionError:
            pass
    buf.destroy()
    dist.barrier()
    print(f"rank {rank}/{world} ({buf.device.type} tensors, {n} tokens, {E} experts, top-{TOP_K}): OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
