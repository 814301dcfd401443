"""The MoE layer of moe_layer.py through DeepEP V2's API (portep.ElasticBuffer): a top-k gate, a few experts per
rank; dispatch -> expert compute -> combine in V2's plain layout, then in its expanded layout (one row per (token,
local expert), each expert's rows contiguous) with fixed worst-case shapes (do_cpu_sync=False, what a CUDA graph
captures), both checked against a float64 reference.

    torchrun --nproc-per-node 2 examples/moe_layer_v2.py

CPU: the host backend over a gloo group. With a GPU (torch.cuda.is_available()): backend 'cuda', one GPU per
rank, over an NCCL group. Prints OK on every rank, or raises.
"""

import portep
import torch
import torch.distributed as dist

from moe_layer import (
    HIDDEN,
    TOP_K,
    T,
    check,
    check_is_not_vacuous,
    finish,
    setup,
)  # the same layer, tokens and float64 reference as V1's example


def main():
    rank, world, dev, E, mine, n, x, topk_idx, topk_w, ref, bound = setup()
    cuda = dev.type == "cuda"
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

        check_is_not_vacuous(combined, ref, bound)
    buf.destroy()
    finish(rank, world, f"V2 API, {buf.device.type} tensors, {n} tokens, {E} experts, top-{TOP_K}")


if __name__ == "__main__":
    main()
