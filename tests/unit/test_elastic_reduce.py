"""portep.elastic.reduce (ElasticBuffer's combine arithmetic) against a plain slot loop written from DeepEP V2's
rule: start from fp32(bias0) + fp32(bias1), add at every slot k = 0..K-1 the contribution keyed there or +0.0, round
once; with node partials, first sum each node's rank partials the same way (from +0.0) and round. The data holds
-0.0 biases, -0.0 rows, tokens without contributions and FP32 sums that round, so order and signs matter; padding
rows (what a combine without CPU sync gets back past the real rows) carry slots of real tokens and must be ignored."""

import pytest
import torch

from portep.elastic.handle import Route
from portep.elastic.reduce import reduce_at_source, sum_slots
from portep.elastic.wire import CombineColumns


def _case(seed, N=40, K=6, H=32, ranks=8):
    g = torch.Generator().manual_seed(seed)
    slot_rank = torch.randint(0, ranks, (N, K), generator=g)
    slot_rank[torch.rand(N, K, generator=g) < 0.3] = -1
    slot_rank[:3] = -1  # tokens nobody returns anything for
    token, slot = [], []
    for t in range(N):
        for q in sorted(set(slot_rank[t].tolist()) - {-1}):
            token.append(t)
            slot.append(max(k for k in range(K) if slot_rank[t, k] == q))
    C = len(token)
    exponents = torch.randint(-10, 25, (C, H), generator=g).double()
    rows = (torch.randn(C, H, generator=g, dtype=torch.float64) * torch.exp2(exponents)).to(torch.bfloat16)
    rows[torch.rand(C, H, generator=g) < 0.1] = -0.0
    bias = [torch.randn(N, H, generator=g).to(torch.bfloat16) for _ in range(2)]
    for b in bias:
        b[torch.rand(N, H, generator=g) < 0.3] = -0.0
    weights = torch.rand(C, K, generator=g)
    return slot_rank, torch.tensor(token), torch.tensor(slot), rows, bias, weights


def _with_padding(token, slot, rows, weights, seed, extra=9):
    """The contributions with `extra` padding rows mixed in (random slots of real tokens, large values): (token,
    slot, rows, weights, arrived [C + extra] bool)."""
    g = torch.Generator().manual_seed(seed + 100)
    C = token.numel()
    at = torch.randperm(C + extra, generator=g)
    arrived = torch.ones(C + extra, dtype=torch.bool)
    arrived[at[C:]] = False
    out_token = torch.empty(C + extra, dtype=torch.int64)
    out_slot = torch.empty_like(out_token)
    out_rows = torch.full((C + extra, rows.size(1)), 2.0**20, dtype=torch.bfloat16)
    out_weights = torch.full((C + extra, weights.size(1)), 7.0)
    out_token[at[:C]], out_slot[at[:C]], out_rows[at[:C]], out_weights[at[:C]] = token, slot, rows, weights
    out_token[at[C:]] = token[torch.randint(0, max(C, 1), (extra,), generator=g)] if C else 0
    out_slot[at[C:]] = slot[torch.randint(0, max(C, 1), (extra,), generator=g)] if C else 0
    return out_token, out_slot, out_rows, out_weights, arrived


def _reference(slot_rank, token, slot, rows, bias, node_ranks):
    N, K = slot_rank.shape
    at = {(int(t), int(k)): rows[i] for i, (t, k) in enumerate(zip(token, slot))}
    if node_ranks is not None:
        merged = {}
        for t in range(N):
            nodes = {}
            for k in range(K):
                if (t, k) in at:
                    nodes.setdefault(int(slot_rank[t, k]) // node_ranks, []).append(k)
            for keys in nodes.values():
                acc = torch.zeros(rows.size(1))
                for k in range(min(keys), max(keys) + 1):  # the node's slots in order, +0.0 between its rows
                    acc += at[(t, k)].float() if k in keys else torch.zeros(rows.size(1))
                merged[(t, max(keys))] = acc.to(torch.bfloat16)
        at = merged
    out = torch.empty(N, rows.size(1), dtype=torch.bfloat16)
    for t in range(N):
        acc = bias[0][t].float() + bias[1][t].float() if len(bias) == 2 else bias[0][t].float() if bias else None
        acc = torch.zeros(rows.size(1)) if acc is None else acc
        for k in range(K):
            acc = acc + (at[(t, k)].float() if (t, k) in at else torch.zeros(rows.size(1)))
        out[t] = acc.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("num_bias", [0, 1, 2])
@pytest.mark.parametrize("node_ranks", [None, 2, 4])
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("padding", [False, True])
def test_reduce_at_source_is_the_slot_loop(num_bias, node_ranks, seed, padding):
    slot_rank, token, slot, rows, bias, weights = _case(seed)
    expected = _reference(slot_rank, token, slot, rows, bias[:num_bias], node_ranks)
    bias = bias[:num_bias]
    N, K = slot_rank.shape
    cols = CombineColumns(K)
    route = Route(None, None, slot_rank, K, 64, 0, padding)
    arrived = torch.ones(token.numel(), dtype=torch.bool)
    sent = (token, slot, rows, weights)
    if padding:
        token, slot, rows, weights, arrived = _with_padding(token, slot, rows, weights, seed)
    nodes = None if node_ranks is None else (8 // node_ranks, node_ranks)
    got, got_w = reduce_at_source(rows, cols.encode(token, slot, weights), arrived, cols, route, bias, nodes, True)
    token, slot, rows, weights = sent
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # signs of zeros included
    for t in range(N):
        for k in range(K):
            if slot_rank[t, k] < 0:
                assert got_w[t, k] == 0
            else:
                last = max(j for j in range(K) if slot_rank[t, j] == slot_rank[t, k])
                i = [n for n in range(token.numel()) if token[n] == t and slot[n] == last][0]
                assert got_w[t, k] == weights[i, k]


def test_a_minus_zero_sum_turns_positive_only_where_a_slot_adds_plus_zero():
    slot_rank = torch.tensor([[0, 1], [0, -1]])
    token, slot = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    rows = torch.full((3, 4), -0.0, dtype=torch.bfloat16)
    bias = [torch.full((2, 4), -0.0, dtype=torch.bfloat16)]
    route = Route(None, None, slot_rank, 2, 64, 0, False)
    cols = CombineColumns(2)
    arrived = torch.ones(3, dtype=torch.bool)
    got, _ = reduce_at_source(rows, cols.encode(token, slot, None), arrived, cols, route, bias, None, False)
    assert torch.signbit(got[0]).all()  # -0 + -0 + -0: every slot had a row
    assert not torch.signbit(got[1]).any()  # slot 1 of token 1 adds +0.0


def test_sum_slots_adds_in_slot_order_with_plus_zero_for_missing_slots():
    rows = torch.tensor([[1.0], [2.0**24], [-(2.0**24)], [-0.0]], dtype=torch.bfloat16)
    # 2**24 + 1 rounds to 2**24 in FP32: slot order decides whether the 1 survives
    got = sum_slots(rows, torch.tensor([[1, 0, 2], [2, 0, 1]]))
    assert got.dtype == torch.bfloat16 and got.flatten().tolist() == [0.0, 1.0]
    minus_zero = torch.full((2, 1), -0.0, dtype=torch.bfloat16)
    got = sum_slots(rows, torch.tensor([[3, 3], [3, -1]]), (minus_zero,))
    assert torch.signbit(got[0]).all() and not torch.signbit(got[1]).any()
    five = torch.full((2, 1), 5.0, dtype=torch.bfloat16)
    empty = sum_slots(rows[:0], torch.full((2, 2), -1), (five, minus_zero))
    assert empty.flatten().tolist() == [5.0, 5.0]


def _slot_loop(rows, row_of_slot, biases):
    """The rule written as a loop of torch FP32 operations."""
    T, K = row_of_slot.shape
    acc = torch.zeros(T, rows.size(1)) if not biases else biases[0].float()
    if len(biases) == 2:
        acc = acc + biases[1].float()
    for t in range(T):
        for k in range(K):
            if row_of_slot[t, k] >= 0:
                acc[t] = acc[t] + rows[row_of_slot[t, k]].float()
        if (row_of_slot[t] < 0).any():
            acc[t] = acc[t] + 0.0
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("num_biases", [0, 1, 2])
def test_sum_slots_matches_the_rule_bit_for_bit(num_biases):
    g = torch.Generator().manual_seed(61 + num_biases)
    T, K, H, C = 37, 8, 24, 90
    exponents = torch.randint(-12, 26, (C, H), generator=g).double()
    rows = (torch.randn(C, H, generator=g, dtype=torch.float64) * torch.exp2(exponents)).to(torch.bfloat16)
    rows[torch.rand(C, H, generator=g) < 0.1] = -0.0
    row_of_slot = torch.randint(0, C, (T, K), generator=g)
    row_of_slot[torch.rand(T, K, generator=g) < 0.35] = -1
    row_of_slot[:2] = -1
    biases = tuple(torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(num_biases))
    for b in biases:
        b[torch.rand(T, H, generator=g) < 0.3] = -0.0
    got, want = sum_slots(rows, row_of_slot, biases), _slot_loop(rows, row_of_slot, biases)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # the bits, signs of zeros included


def test_sum_slots_refuses_a_row_past_the_rows_naming_the_token():
    rows = torch.ones(3, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"token 1 names a row outside \[-1, 3\)"):
        sum_slots(rows, torch.tensor([[0, 2], [3, -1]]))
    with pytest.raises(ValueError, match="bias0: 4 entries, exactly 8 needed"):
        sum_slots(rows, torch.tensor([[0, 2], [1, -1]]), (torch.ones(1, 4, dtype=torch.bfloat16),))
