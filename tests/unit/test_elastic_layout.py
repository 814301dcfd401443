"""portep.elastic.layout (where V2's received tokens go) on arrival rows with V2's padding mixed in, as a dispatch
without CPU sync gets them: the layout of the real rows must be the one a plain loop over them gives (order by
scale-up group then global index, or global index alone; per-expert counts; expanded rows per expert in that order,
each expert's block aligned), the padding rows must come last holding -1, and the expanded rows' slot map must be the
inverse of the slots' row map."""

import pytest
import torch

from portep.elastic.layout import receive_layout, worst_case_expanded_rows


def _arrivals(seed, R=37, K=5, E_l=6, T=50, world=4, padding=0):
    """(global_index [M] int32, local_topk_idx [M, K] int64) in a random arrival order, `padding` rows of garbage
    global index and all -1 ids mixed in."""
    g = torch.Generator().manual_seed(seed)
    sources = torch.randperm(world * T, generator=g)[:R]
    idx = torch.full((R, K), -1, dtype=torch.int64)
    for i in range(R):
        n = int(torch.randint(1, min(K, E_l) + 1, (1,), generator=g))
        idx[i, torch.randperm(K, generator=g)[:n]] = torch.randperm(E_l, generator=g)[:n]
    gidx = torch.cat([sources.int(), torch.randint(0, 10**6, (padding,), generator=g, dtype=torch.int32)])
    idx = torch.cat([idx, torch.full((padding, K), -1, dtype=torch.int64)])
    perm = torch.randperm(R + padding, generator=g)
    return gidx[perm], idx[perm]


def _reference(gidx, idx, T, S, E_l, alignment, grouped):
    real = [i for i in range(gidx.numel()) if (idx[i] >= 0).any()]
    key = [((int(gidx[i]) // T % S) if grouped else 0, int(gidx[i])) for i in real]
    rows = [i for _, i in sorted(zip(key, real))]
    K = idx.size(1)
    counts = [sum(int((idx[i] == e).sum()) for i in rows) for e in range(E_l)]
    expanded = torch.full((len(rows), K), -1, dtype=torch.int64)
    start = 0
    for e in range(E_l):
        n = 0
        for out, i in enumerate(rows):
            for k in range(K):
                if idx[i, k] == e:
                    expanded[out, k] = start + n
                    n += 1
        start += -(-counts[e] // alignment) * alignment
    return rows, counts, expanded, start


@pytest.mark.parametrize("padding", [0, 1, 23])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("cpu_sync", [True, False], ids=["exact-X", "worst-X"])
def test_receive_layout_of_real_rows_with_padding_mixed_in(padding, grouped, alignment, cpu_sync):
    T, S, E_l, world = 50, 2, 6, 4
    gidx, idx = _arrivals(7 + padding, T=T, E_l=E_l, world=world, padding=padding)
    M, K = idx.shape
    rows, counts, expanded, X = _reference(gidx, idx, T, S, E_l, alignment, grouped)
    worst = X if cpu_sync else worst_case_expanded_rows(world, T, K, E_l, alignment)
    lay = receive_layout(gidx, idx, T, S, E_l, alignment, True, group_by_scaleup=grouped, expanded_rows=worst)
    R = len(rows)
    order = torch.arange(M) if lay.order is None else lay.order
    assert order[:R].tolist() == rows
    assert lay.global_index[:R].tolist() == [int(gidx[i]) for i in rows]
    assert (lay.global_index[R:] == -1).all() and (lay.local_topk_idx[R:] == -1).all()
    assert torch.equal(lay.local_topk_idx[:R], idx[rows])
    assert lay.num_unaligned_per_expert.tolist() == counts
    assert torch.equal(lay.expanded_row[:R], expanded) and (lay.expanded_row[R:] == -1).all()
    assert (lay.highest_local_slot[R:] == -1).all()
    assert lay.num_expanded_rows == worst and worst >= X
    groups = [sum(1 for i in rows if int(gidx[i]) // T % S == s) for s in range(S)]
    assert lay.psum_per_scaleup_rank.tolist() == torch.cumsum(torch.tensor(groups), 0).tolist()
    slot_of_row = torch.full((lay.num_expanded_rows,), -1, dtype=torch.int64)
    for i in range(R):
        for k in range(K):
            if expanded[i, k] >= 0:
                slot_of_row[expanded[i, k]] = i * K + k
    assert torch.equal(lay.expanded_slot, slot_of_row)
