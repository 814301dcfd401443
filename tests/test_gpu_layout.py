"""get_dispatch_layout's CUDA kernel against the host backend's layout on the same inputs. Needs a GPU."""

import types

import pytest
import torch

from portep import host_ht, native

needs_gpu = pytest.mark.skipif(not native.build_info()["cuda_built"] or native.cuda_devices()[0] == 0
                               or not torch.cuda.is_available(), reason="needs the CUDA kernels built and a CUDA GPU")


def cuda_layout(topk_idx, num_experts, num_ranks, ranks_per_node):
    N, K = topk_idx.shape
    dev = topk_idx.device
    per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    nodes = num_ranks // ranks_per_node
    per_node = torch.empty(nodes, dtype=torch.int32, device=dev) if nodes > 1 else None
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty(N, num_ranks, dtype=torch.bool, device=dev)
    native.cuda_dispatch_layout(topk_idx.data_ptr(), N, K, num_experts, num_ranks, ranks_per_node,
                                per_rank.data_ptr(), 0 if per_node is None else per_node.data_ptr(),
                                per_expert.data_ptr(), in_rank.data_ptr(), torch.cuda.current_stream().cuda_stream)
    return per_rank, per_node, per_expert, in_rank


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens,topk,experts,ranks,per_node,seed", [
    (4096, 8, 256, 2, 2, 0), (333, 6, 64, 8, 2, 1), (1000, 8, 512, 16, 8, 2), (257, 4, 16384, 16, 4, 3),
    (0, 8, 64, 8, 8, 4)])
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
