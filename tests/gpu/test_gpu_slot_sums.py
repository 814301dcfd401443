"""V2 combine's final sum on the GPU (gpu_kernels/cuda/slot_sums.cu) bit for bit against the same sum on the CPU (the
host loop over the same arithmetic, itself checked against a torch loop in tests/unit/test_elastic_reduce.py), at
DeepSeek-V3's prefill shape and a small one, with zero to two biases; a row index past the rows gives NaN rows;
and the kernel captured in a CUDA graph and replayed on new inputs. Needs a GPU."""

import pytest
import torch

from ci_expect import gpu_skip_reason
from portep import native
from portep.elastic.reduce import sum_slots

needs_gpu = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or native.cuda_devices()[0] == 0 or not torch.cuda.is_available(),
    reason=gpu_skip_reason(1),
)


def _inputs(seed, T, K, H, C, num_biases):
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-12, 26, (C, H), generator=g).double()
    rows = (torch.randn(C, H, generator=g, dtype=torch.float64) * torch.exp2(exponents)).to(torch.bfloat16)
    rows[torch.rand(C, H, generator=g) < 0.1] = -0.0
    row_of_slot = torch.randint(0, max(C, 1), (T, K), generator=g)
    row_of_slot[torch.rand(T, K, generator=g) < 0.35] = -1
    row_of_slot[: min(T, 3)] = -1
    biases = tuple(torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(num_biases))
    for b in biases:
        b[torch.rand(T, H, generator=g) < 0.3] = -0.0
    return rows, row_of_slot, biases


def _bits(t):
    return t.view(torch.int16).cpu()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_biases", [0, 1, 2])
@pytest.mark.parametrize(
    "T,K,H,C", [(4096, 8, 7168, 4096 * 8), (37, 6, 24, 90), (5, 8, 4096, 0), (0, 8, 4096, 0), (0, 4, 256, 7)]
)
def test_cuda_sum_slots_matches_the_host_bitwise(T, K, H, C, num_biases):
    rows, row_of_slot, biases = _inputs(T + K + num_biases, T, K, H, C, num_biases)
    if C == 0:
        row_of_slot.fill_(-1)
    want = sum_slots(rows, row_of_slot, biases)
    got = sum_slots(rows.cuda(), row_of_slot.cuda(), tuple(b.cuda() for b in biases))
    torch.cuda.synchronize()
    assert got.is_cuda and got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.gpu
@needs_gpu
def test_cuda_sum_slots_turns_a_token_with_a_bad_row_into_nan():
    rows, row_of_slot, _ = _inputs(5, 6, 4, 64, 10, 0)
    row_of_slot[2, 1] = 10  # one past the rows
    got = sum_slots(rows.cuda(), row_of_slot.cuda()).float().cpu()
    assert torch.isnan(got[2]).all()
    good = torch.tensor([t != 2 for t in range(6)])
    row_of_slot[2] = -1
    want = sum_slots(rows, row_of_slot).float()
    assert torch.equal(got[good], want[good])


@pytest.mark.gpu
@needs_gpu
def test_cuda_sum_slots_replays_in_a_cuda_graph():
    rows, row_of_slot, biases = _inputs(9, 300, 8, 512, 2000, 2)
    static = [rows.cuda(), row_of_slot.cuda(), tuple(b.cuda() for b in biases)]
    sum_slots(*static)  # the kernel loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sum_slots(*static)
    for seed in (10, 11):
        new_rows, new_idx, new_biases = _inputs(seed, 300, 8, 512, 2000, 2)
        static[0].copy_(new_rows)
        static[1].copy_(new_idx)
        for s, b in zip(static[2], new_biases):
            s.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(sum_slots(new_rows, new_idx, new_biases)))
