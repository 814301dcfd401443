"""get_dispatch_layout's CUDA kernel against the host backend's layout on the same inputs. Needs a GPU."""

import types

import pytest
import torch

from ci_expect import gpu_skip_reason
from portep import native
from portep.backends.host import ht as host_ht
from portep.backends.cuda.kernel_errors import KernelErrors

needs_gpu = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or native.cuda_devices()[0] == 0 or not torch.cuda.is_available(),
    reason=gpu_skip_reason(1),
)


def cuda_layout(topk_idx, num_experts, num_ranks, ranks_per_node, errors=None):
    N, K = topk_idx.shape
    errors = errors or KernelErrors(native, topk_idx.device)
    dev = topk_idx.device
    per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    nodes = num_ranks // ranks_per_node
    per_node = torch.empty(nodes, dtype=torch.int32, device=dev) if nodes > 1 else None
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty(N, num_ranks, dtype=torch.bool, device=dev)
    native.cuda_dispatch_layout(
        topk_idx,
        N,
        K,
        num_experts,
        num_ranks,
        ranks_per_node,
        per_rank,
        per_node,
        per_expert,
        in_rank,
        torch.cuda.current_stream().cuda_stream,
        0,
        errors.words,
        errors.records,
    )
    return per_rank, per_node, per_expert, in_rank


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "tokens,topk,experts,ranks,per_node,seed",
    [
        (4096, 8, 256, 2, 2, 0),
        (333, 6, 64, 8, 2, 1),
        (1000, 8, 512, 16, 8, 2),
        (257, 4, 16384, 16, 4, 3),
        (0, 8, 64, 8, 8, 4),
    ],
)
def test_cuda_layout_matches_host_backend(tokens, topk, experts, ranks, per_node, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.topk(torch.rand(tokens, experts, generator=g), topk, dim=1).indices
    idx[torch.rand(tokens, topk, generator=g) < 0.1] = -1
    eng = types.SimpleNamespace(num_ranks=ranks, ranks_per_node=per_node, num_nodes=ranks // per_node)
    want = host_ht.dispatch_layout(eng, idx, experts)
    got = cuda_layout(idx.cuda(), experts, ranks, per_node)
    torch.cuda.synchronize()
    for name, w, h in zip(["per_rank", "per_node", "per_expert", "is_token_in_rank"], want, got):
        if w is None:
            assert h is None, name
        else:
            assert torch.equal(h.cpu(), w), name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("bad", [256, 1 << 40, -2], ids=["num_experts", "huge", "below_-1"])
def test_cuda_layout_reports_out_of_range_experts(bad):
    """An entry outside [-1, num_experts) is left out of every count and reported as a notice naming it (no host
    synchronization in the kernel); the layout of the other entries is the host backend's with it set to -1."""
    g = torch.Generator().manual_seed(11)
    tokens, topk, experts, ranks = 4096, 8, 256, 2
    idx = torch.topk(torch.rand(tokens, experts, generator=g), topk, dim=1).indices
    idx[777, 3] = bad
    errors = KernelErrors(native, torch.device("cuda"))
    got = cuda_layout(idx.cuda(), experts, ranks, ranks, errors)
    torch.cuda.synchronize()
    code, message = errors.take_notice()
    assert errors.name(code) == "bad_expert" and f"token 777, top-k column 3, value {bad}" in message, message
    clean = idx.clone()
    clean[777, 3] = -1
    eng = types.SimpleNamespace(num_ranks=ranks, ranks_per_node=ranks, num_nodes=1)
    want = host_ht.dispatch_layout(eng, clean, experts)
    for name, w, h in zip(["per_rank", "per_node", "per_expert", "is_token_in_rank"], want, got):
        assert (h is None) if w is None else torch.equal(h.cpu(), w), name
    cuda_layout(clean.cuda(), experts, ranks, ranks, errors)  # re-armed: a clean call reports nothing
    torch.cuda.synchronize()
    assert errors.take_notice() is None
    errors.free()
