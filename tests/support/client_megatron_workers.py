"""Per-rank body of test_client_megatron.py: an MoE layer driven the way NVIDIA Megatron-core's fused_a2a drives
DeepEP V1's normal mode (written from that behaviour, not copied), on portep's host backend (CPU tensors, gloo).

The call pattern reproduced: a module-level cached Buffer(group, num_nvl_bytes, 0) sized from
Buffer.get_dispatch_config / get_combine_config and their get_nvl_buffer_size_hint (Buffer.set_num_sms(24) first);
a FusedDispatch autograd.Function whose forward is get_dispatch_layout + dispatch (previous_event an
EventOverlap(EventHandle())) and whose backward is a combine of the gradients with topk_weights; a FusedCombine
autograd.Function whose forward is a combine and whose backward is a cached dispatch (handle=). Between them each
rank applies its local experts (one float32 [H, H] weight each) weighted by the received top-k probabilities.

Checked, on every rank, against an independent float64 reference of the whole layer over all ranks' gathered
inputs (torch.autograd in float64): the layer's output, the gradients of x, of token_probs and of each local
expert's weight; plus the per-expert receive counts, and that the output check fails against a reference with two
experts' weights swapped (the check discriminates).
"""

import torch
import torch.distributed as dist

import deep_ep
from deep_ep import Buffer
from deep_ep.utils import EventHandle, EventOverlap
from deepep_workers import Checker, all_gather

BF16 = torch.bfloat16

# Tolerances of the comparison with the float64 reference. The transport is BF16 both ways (expert outputs, the
# output gradient and the x gradient are rounded to BF16, 8 significant bits): a relative Frobenius error of a few
# 1e-3 is expected; REL_TOL and MAX_TOL (the largest element error relative to the reference's largest magnitude)
# leave a margin while staying far below what a wrong expert, weight or route gives (DISCRIMINATE_MIN).
REL_TOL = 2e-2
MAX_TOL = 3e-2
DISCRIMINATE_MIN = 0.2

# ---------------------------------------------------------------------------------------------------------------
# The client: a cached buffer and the two autograd Functions, as Megatron-core's fused_a2a uses DeepEP.

_buffer = None


def get_buffer(group, hidden_bytes):
    """The module-level Buffer, (re)created when missing, of another group or smaller than the configs' hint."""
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
    if _buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes:
        # explicitly_destroy (a DeepEP keyword) only so the worker can release it deterministically at its end.
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
    return _buffer


def release_buffer():
    """Destroys the cached Buffer (the worker's last call)."""
    global _buffer
    if _buffer is not None:
        _buffer.destroy()
    _buffer = None


class FusedDispatch(torch.autograd.Function):
    """Forward: layout + dispatch; backward: combine of the received rows' and probabilities' gradients."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group):
        previous_event = EventOverlap(EventHandle())
        buffer = get_buffer(group, x.size(1) * max(x.element_size(), 2))
        (
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            previous_event,
        ) = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event, async_finish=False, allocate_on_comm_stream=False
        )
        recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle, after_event = (
            buffer.dispatch(
                x,
                topk_idx=token_indices,
                topk_weights=token_probs.float(),
                num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert,
                previous_event=previous_event,
                async_finish=False,
                allocate_on_comm_stream=False,
            )
        )
        ctx.group = group
        ctx.handle = handle
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buffer = get_buffer(ctx.group, grad_output.size(1) * max(grad_output.element_size(), 2))
        grad_x, grad_token_probs, after_event = buffer.combine(
            grad_output.contiguous(),
            ctx.handle,
            topk_weights=grad_token_probs.float(),
            previous_event=None,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
        return grad_x, None, grad_token_probs, None, None


class FusedCombine(torch.autograd.Function):
    """Forward: combine of the expert outputs; backward: cached dispatch of the output gradient."""

    @staticmethod
    def forward(ctx, x, group, handle):
        buffer = get_buffer(group, x.size(1) * max(x.element_size(), 2))
        combined_x, _, after_event = buffer.combine(
            x, handle=handle, async_finish=False, previous_event=None, allocate_on_comm_stream=False
        )
        ctx.handle = handle
        ctx.group = group
        return combined_x

    @staticmethod
    def backward(ctx, grad_output):
        buffer = get_buffer(ctx.group, grad_output.size(1) * max(grad_output.element_size(), 2))
        grad_x, _, _, _, _, after_event = buffer.dispatch(
            grad_output.contiguous(),
            handle=ctx.handle,
            previous_event=None,
            async_finish=False,
            allocate_on_comm_stream=False,
        )
        return grad_x, None, None


# ---------------------------------------------------------------------------------------------------------------
# The layer and its inputs


def make_inputs(rank, seed, n, hidden, num_experts, topk):
    """This rank's leaves: x BF16 [n, hidden], token_probs float32 [n, topk] (both requiring grad), token_indices
    int64 [n, topk] of distinct experts with some -1 holes, the local experts' float32 [hidden, hidden] weights and
    the fixed output weighting G of the loss. Nothing is zero (G, x, probabilities, weights)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    e_l = num_experts // dist.get_world_size()
    x = torch.randn(n, hidden, generator=gen).to(BF16).requires_grad_()
    scores = torch.rand(n, num_experts, generator=gen)
    idx = torch.topk(scores, topk, dim=-1, sorted=False).indices
    holes = n // 8
    idx[torch.randint(0, n, (holes,), generator=gen), torch.randint(0, topk, (holes,), generator=gen)] = -1
    probs = (torch.rand(n, topk, generator=gen) + 0.1).requires_grad_()
    weights = [(torch.randn(hidden, hidden, generator=gen) / hidden**0.5).requires_grad_() for _ in range(e_l)]
    g = torch.rand(n, hidden, generator=gen) + 0.5
    g = torch.where(torch.rand(n, hidden, generator=gen) < 0.5, -g, g)
    return {"x": x, "idx": idx.to(deep_ep.topk_idx_t).contiguous(), "probs": probs, "weights": weights, "G": g}


def local_experts(recv_x, recv_idx, recv_probs, weights):
    """Each received row through the local experts it selected, weighted by its probabilities; BF16 for combine."""
    out = torch.zeros(recv_x.size(0), recv_x.size(1), dtype=torch.float32)
    xf = recv_x.float()
    for e, w in enumerate(weights):
        p = (recv_probs * (recv_idx == e)).sum(dim=1, keepdim=True)
        out = out + p * (xf @ w)
    return out.to(BF16)


def moe_layer(inp, num_experts, group):
    """Dispatch, local experts, combine, and the loss's backward; returns the output and the per-expert counts."""
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = FusedDispatch.apply(
        inp["x"].contiguous(), inp["idx"], inp["probs"], num_experts, group
    )
    expert_out = local_experts(recv_x, recv_idx, recv_probs, inp["weights"])
    out = FusedCombine.apply(expert_out, group, handle)
    (out.float() * inp["G"]).sum().backward()
    return out.detach(), tokens_per_expert


# ---------------------------------------------------------------------------------------------------------------
# The float64 reference


def reference(gathered, num_experts, swap=None):
    """out and gradients of the whole layer over all ranks' tokens in float64: out[t] = sum_k p[t,k] *
    (x[t] @ W[idx[t,k]]) over idx >= 0, loss = sum(out * G). swap: two global experts whose weights trade places.
    Returns per-rank lists of out, grad x, grad probs and the per-expert list of grad W."""
    xs = [g["x"].double() for g in gathered]
    sizes = [t.size(0) for t in xs]
    x = torch.cat(xs).requires_grad_()
    p = torch.cat([g["probs"].double() for g in gathered]).requires_grad_()
    idx = torch.cat([g["idx"] for g in gathered])
    w = torch.cat([torch.stack(g["weights"]).double() for g in gathered]).requires_grad_()
    perm = list(range(num_experts))
    if swap is not None:
        perm[swap[0]], perm[swap[1]] = swap[1], swap[0]
    w_used = w[torch.tensor(perm)]
    out = torch.zeros_like(x)
    for k in range(idx.size(1)):
        sel = idx[:, k]
        y = torch.einsum("th,thj->tj", x, w_used[sel.clamp(min=0)])
        out = out + (p[:, k] * (sel >= 0))[:, None] * y
    (out * torch.cat([g["G"].double() for g in gathered])).sum().backward()
    return {
        "out": list(out.detach().split(sizes)),
        "gx": list(x.grad.split(sizes)),
        "gp": list(p.grad.split(sizes)),
        "gw": list(w.grad.unbind(0)),
    }


def rel_errors(got, exp):
    """(Frobenius error / Frobenius norm of exp, largest element error / largest |exp|), in float64."""
    d = got.double() - exp
    return float(d.norm() / exp.norm()), float(d.abs().max() / exp.abs().max())


def check_close(ck, name, got, exp, dtype):
    """got has exp's shape and this dtype, and is close to exp relative to exp's scale."""
    if not ck.tensor(name, got, dtype, exp.shape):
        return
    rel, mx = rel_errors(got, exp)
    ck.true(rel < REL_TOL and mx < MAX_TOL, f"{name}: relative error {rel:.3g} (max {mx:.3g}) vs the float64 reference")


# ---------------------------------------------------------------------------------------------------------------
# The worker


def _check_iteration(ck, rank, world, inp, out, tokens_per_expert, num_experts):
    """Compares one iteration's output and gradients with the float64 reference over all ranks' gathered inputs."""
    e_l = num_experts // world
    mine = {"x": inp["x"].detach(), "idx": inp["idx"], "probs": inp["probs"].detach(), "G": inp["G"]}
    mine["weights"] = [w.detach() for w in inp["weights"]]
    gathered = all_gather(mine)
    ref = reference(gathered, num_experts)

    all_idx = torch.cat([g["idx"] for g in gathered])
    exp_counts = [int((all_idx == rank * e_l + e).sum()) for e in range(e_l)]
    ck.true(
        tokens_per_expert.tolist() == exp_counts,
        f"tokens per local expert {tokens_per_expert.tolist()} != {exp_counts}",
    )
    check_close(ck, "out", out, ref["out"][rank], BF16)
    check_close(ck, "x.grad", inp["x"].grad, ref["gx"][rank], BF16)
    check_close(ck, "token_probs.grad", inp["probs"].grad, ref["gp"][rank], torch.float32)
    for e, w in enumerate(inp["weights"]):
        check_close(
            ck, f"W[{e}].grad (global expert {rank * e_l + e})", w.grad, ref["gw"][rank * e_l + e], torch.float32
        )

    # Discrimination: the same check against a reference with two experts' weights swapped must fail. The two
    # experts are the ones this rank's tokens select most, so its own rows are affected.
    counts = torch.bincount(inp["idx"][inp["idx"] >= 0], minlength=num_experts)
    swap = tuple(torch.topk(counts, 2).indices.tolist())
    rel, _ = rel_errors(out, reference(gathered, num_experts, swap=swap)["out"][rank])
    ck.true(rel > DISCRIMINATE_MIN, f"out is within {rel:.3g} of a reference with experts {swap} swapped")


def megatron_body(rank, world, seed, n, hidden, experts_per_rank, topk, iterations=2):
    """Runs the layer `iterations` times (fresh inputs each time, the cached Buffer reused) and checks each."""
    ck = Checker(rank)
    Buffer.set_num_sms(24)
    group = dist.group.WORLD
    num_experts = experts_per_rank * world
    first = None
    for it in range(iterations):
        ck.step = f"iteration {it}"
        inp = make_inputs(rank, seed + it, n, hidden, num_experts, topk)
        out, tokens_per_expert = moe_layer(inp, num_experts, group)
        if first is None:
            first = _buffer
        ck.true(_buffer is first, "the cached Buffer was recreated for the same group and size")
        _check_iteration(ck, rank, world, inp, out, tokens_per_expert, num_experts)
    release_buffer()
    return {"failures": ck.failures, "checks": ck.num_checks}
