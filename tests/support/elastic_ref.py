"""A reference for ElasticBuffer (DeepEP V2's dispatch and combine), written from the semantics in
../shared/reference/deepep-v2-api.md with plain per-token loops, independent of portep.elastic's index arithmetic.

Every rank's inputs come from (seed, rank), so each rank rebuilds all of them and computes what it must receive.
Combine inputs are a function of (token's global index, slot, channel, salt) (expert_rows), so each source knows
what every rank will send back for its tokens."""

import torch

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def make_inputs(
    rank,
    seed,
    n_tokens,
    hidden,
    num_topk,
    num_experts,
    fp8,
    sf_kind="float",
    masked=0.15,
    nodes=None,
    skew=False,
    world=None,
):
    """One rank's dispatch inputs: x BF16 [N, hidden] (or FP8 data and sf [N, P]), topk_idx [N, K] int64 (distinct
    experts, some -1), topk_weights [N, K] float32 (0 where -1). nodes: (node count, ranks per node, allowed nodes per
    token) limits each token's experts to that many nodes. skew: every expert on rank 0, except one slot of rank 0's
    first token on rank 1 (rank 1 receives one token, the others none; needs world)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    N = n_tokens[rank]
    x = (torch.randn(N, hidden, generator=g) * (1 + torch.arange(N)[:, None] % 7)).to(BF16)
    scores = torch.rand(N, num_experts, generator=g)
    if nodes is not None:
        num_nodes, per_node, allowed = nodes
        per_node_experts = num_experts // num_nodes
        for t in range(N):
            keep = torch.randperm(num_nodes, generator=g)[:allowed]
            banned = torch.ones(num_nodes, dtype=torch.bool)
            banned[keep] = False
            scores[t].view(num_nodes, per_node_experts)[banned] = -1.0
    if skew:
        scores[:, num_experts // world :] = -2.0  # rank 0's experts only
        if rank == 0 and N:
            scores[0, num_experts // world] = 5.0  # one slot on rank 1
    idx = scores.topk(num_topk, dim=1).indices
    idx[torch.rand(N, num_topk, generator=g) < masked] = -1
    if skew:
        idx[scores.gather(1, idx.clamp(min=0)) < -1] = -1
        if rank == 0 and N and not bool((idx[0] == num_experts // world).any()):
            idx[0, 0] = num_experts // world  # (the random mask took it)
    if nodes is not None:
        idx[scores.gather(1, idx.clamp(min=0)) < 0] = -1
    weights = torch.rand(N, num_topk, generator=g) + 0.25
    weights[idx < 0] = 0
    out = {"x": x, "topk_idx": idx, "topk_weights": weights, "sf": None}
    if fp8:
        P = (hidden + 127) // 128 if sf_kind == "float" else 3
        out["x"] = (x.float() / 8).to(FP8)
        if sf_kind == "float":
            out["sf"] = torch.rand(N, P, generator=g) + 0.5
        else:  # packed UE8M0 exponents as int32, given column-major (any strides are accepted)
            packed = torch.randint(-(2**31), 2**31 - 1, (P, N), generator=g, dtype=torch.int64).to(torch.int32)
            out["sf"] = packed.t()
    return out


def bias_tensors(rank, seed, count, num_tokens, hidden):
    """None, one or two BF16 [N, hidden] biases."""
    if count == 0:
        return None
    g = torch.Generator().manual_seed(seed * 7919 + rank + 17)
    items = tuple(torch.randn(num_tokens, hidden, generator=g).to(BF16) for _ in range(count))
    return items[0] if count == 1 else items


def expert_rows(global_index, num_topk, hidden, salt=0):
    """[K, hidden] BF16: what the expert of slot k returns for the token of this global index (distinct per token,
    slot and channel)."""
    k = torch.arange(num_topk, dtype=torch.float64)[:, None]
    h = torch.arange(hidden, dtype=torch.float64)[None, :]
    v = torch.sin(global_index * 0.7310 + k * 1.37 + h * 0.0191 + salt * 0.5) + 0.01 * (global_index % 13)
    v = v * torch.exp2(((global_index * 7 + k * 5 + h * 3) % 9 - 4).to(torch.float64))
    # Even slots hold +-2**24 in most channels, with signs alternating between them: a token's contributions cancel
    # in FP32 only in the right order (2**24 + 1 rounds to 2**24), so a wrong summation order shows in BF16.
    big = (k.long() % 2 == 0) & ((global_index + h.long()) % 3 != 0)
    sign = 1 - 2 * ((k.long() // 2 + h.long()) % 2)
    v = torch.where(big, sign * 2.0**24, v)
    return v.to(BF16)


class Expected:
    """What rank `rank` receives from everyone's inputs (all_inputs[s] from make_inputs)."""

    def __init__(self, all_inputs, rank, max_tokens, num_experts, scaleup, alignment, grouped=True):
        """grouped: rows ordered by source scale-up rank first (V2 without deterministic), else by global index."""
        world = len(all_inputs)
        self.E_l = num_experts // world
        self.K = all_inputs[0]["topk_idx"].size(1)
        keyed = []
        for s, inp in enumerate(all_inputs):
            for t, row in enumerate(inp["topk_idx"].tolist()):
                if any(e >= 0 and e // self.E_l == rank for e in row):
                    keyed.append(((s % scaleup if grouped else 0, s * max_tokens + t), s, t))
        keyed.sort()
        self.sources = [(s, t) for _, s, t in keyed]
        self.global_index = [g for (_, g), _, _ in keyed]
        R, K = len(keyed), self.K
        x0 = all_inputs[0]["x"]
        self.x = torch.zeros(R, x0.size(1), dtype=x0.dtype)
        sf0 = all_inputs[0]["sf"]
        self.sf = None if sf0 is None else torch.zeros(R, sf0.size(1), dtype=sf0.dtype)
        self.topk_idx = torch.full((R, K), -1, dtype=torch.int64)
        self.weights = torch.zeros(R, K)
        self.last_slot = []
        for i, (s, t) in enumerate(self.sources):
            inp = all_inputs[s]
            self.x[i] = inp["x"][t]
            if self.sf is not None:
                self.sf[i] = inp["sf"][t]
            self.weights[i] = inp["topk_weights"][t]
            local = [k for k, e in enumerate(inp["topk_idx"][t].tolist()) if e >= 0 and e // self.E_l == rank]
            for k in local:
                self.topk_idx[i, k] = int(inp["topk_idx"][t, k]) - rank * self.E_l
            self.last_slot.append(max(local))
        self.counts = [int((self.topk_idx == e).sum()) for e in range(self.E_l)]
        self.aligned = [(c + alignment - 1) // alignment * alignment for c in self.counts]
        per_group = [sum(1 for _, s, _ in keyed if s % scaleup == j) for j in range(scaleup)]
        self.psum_scaleup = [sum(per_group[: j + 1]) for j in range(scaleup)]
        self.scaleup_of = [s % scaleup for s, _ in self.sources]
        self.expanded_row = torch.full((R, K), -1, dtype=torch.int64)
        start = 0
        for e in range(self.E_l):
            n = 0
            for i in range(R):
                for k in range(K):
                    if self.topk_idx[i, k] == e:
                        self.expanded_row[i, k] = start + n
                        n += 1
            start += self.aligned[e]
        self.num_expanded = start

    @property
    def num_rows(self):
        return len(self.sources)


def combine_input_rows(global_index, local_topk_idx, hidden, salt):
    """[R, hidden] BF16: each received token's local partial (its local slots' expert_rows summed in slot order in
    FP32 from +0, rounded), as a V2 user computes it for a non-expanded combine."""
    R, K = local_topk_idx.shape
    out = torch.empty(R, hidden, dtype=BF16)
    for i in range(R):
        rows = expert_rows(int(global_index[i]), K, hidden, salt)
        acc = torch.zeros(hidden)
        for k in range(K):
            if local_topk_idx[i, k] >= 0:
                acc += rows[k].float()
        out[i] = acc.to(BF16)
    return out


def expected_combine(inp, rank, max_tokens, num_experts, world, bias, salt, expand, multi, node_ranks):
    """[N, hidden] BF16 that rank `rank` gets back for its tokens (V2's order, docs/api.md): contributions per rank
    (their partial, keyed by the rank's last slot), or per slot for an expanded combine without multiple reduction;
    with node_ranks, each node's rank partials summed first (keyed by the node's last slot); then fp32(bias0) +
    fp32(bias1) plus the contributions in ascending key order, rounded once."""
    E_l = num_experts // world
    idx = inp["topk_idx"]
    N, K = idx.shape
    hidden = inp["x"].size(1)
    biases = () if bias is None else (bias,) if torch.is_tensor(bias) else bias
    out = torch.empty(N, hidden, dtype=BF16)
    for t in range(N):
        rows = expert_rows(rank * max_tokens + t, K, hidden, salt)
        owner = {k: int(e) // E_l for k, e in enumerate(idx[t].tolist()) if e >= 0}
        if expand and not multi:
            contrib = {k: rows[k] for k in owner}
        else:
            contrib = {}
            for q in sorted(set(owner.values())):
                slots = [k for k in sorted(owner) if owner[k] == q]
                acc = torch.zeros(hidden)
                for k in slots:
                    acc += rows[k].float()
                contrib[max(slots)] = acc.to(BF16)
            if node_ranks is not None:
                per_node = {}
                for key in sorted(contrib):
                    per_node.setdefault(owner[key] // node_ranks, []).append(key)
                merged = {}
                for keys in per_node.values():
                    acc = torch.zeros(hidden)
                    for key in keys:
                        acc += contrib[key].float()
                    merged[max(keys)] = acc.to(BF16)
                contrib = merged
        acc = torch.zeros(hidden)
        if biases:
            acc = biases[0][t].float() + (biases[1][t].float() if len(biases) == 2 else 0)
            acc = acc.clone()
        for k in range(K):
            acc += contrib[k].float() if k in contrib else torch.zeros(hidden)
        out[t] = acc.to(BF16)
    return out


def exact_combine(inp, rank, max_tokens, bias, salt):
    """([N, hidden] float64 exact sum of bias and every selected slot's expert row, [N, hidden] float64 sum of the
    terms' magnitudes), to bound the rounded results."""
    idx = inp["topk_idx"]
    N, K = idx.shape
    hidden = inp["x"].size(1)
    biases = () if bias is None else (bias,) if torch.is_tensor(bias) else bias
    out = torch.zeros(N, hidden, dtype=torch.float64)
    mag = torch.zeros(N, hidden, dtype=torch.float64)
    for b in biases:
        out += b.double()
        mag += b.double().abs()
    for t in range(N):
        rows = expert_rows(rank * max_tokens + t, K, hidden, salt).double()
        for k, e in enumerate(idx[t].tolist()):
            if e >= 0:
                out[t] += rows[k]
                mag[t] += rows[k].abs()
    return out, mag


def within_rounding(got, exact, magnitude, levels):
    """Whether got (BF16) is exact up to `levels` roundings to BF16 of sums no larger than magnitude."""
    return bool(((got.double() - exact).abs() <= magnitude * levels * 2.0**-8 + 1e-30).all())
