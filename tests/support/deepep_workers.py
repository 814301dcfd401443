"""Per-rank bodies of the DeepEP V1 acceptance tests (module-level so multiprocessing spawn can import them).

Each body builds a portep.Buffer on the host backend (CPU tensors, gloo group), makes DeepEP V1 calls and checks
the results against the independent references of deepep_reference.py. Checks do not stop at the first failure:
they are collected with the rank and the step and returned, so one spawned run reports everything it found; the
tests assert the lists are empty. Every rank makes the same sequence of Buffer calls whatever the checks find, so
a failed check never leaves a peer waiting.
"""

import hashlib

import torch
import torch.distributed as dist

import deepep_reference as ref
import portep

MiB = 1 << 20
HT_NVL_BYTES = 256 * MiB
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def topk_idx_t():
    return getattr(portep, "topk_idx_t", torch.int64)


def all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return repr(v)


class Checker:
    """Collects failed checks as 'rank R [step] message' strings."""

    MAX_FAILURES = 40

    def __init__(self, rank):
        self.rank = rank
        self.step = ""
        self.failures = []
        self.num_checks = 0

    def fail(self, msg):
        if len(self.failures) < self.MAX_FAILURES:
            self.failures.append(f"rank {self.rank} [{self.step}] {msg}")
        elif len(self.failures) == self.MAX_FAILURES:
            self.failures.append(f"rank {self.rank}: ... more failures dropped")

    def true(self, cond, msg):
        self.num_checks += 1
        if not cond:
            self.fail(msg)
        return bool(cond)

    def no_kernel_failure(self, gpu_buffer):
        """After a CUDA Buffer's last op: a kernel that failed (a wait that timed out) leaves garbage outputs, and the
        Buffer raises it only at its next call; report it here as what it is (with the proxies' state)."""
        torch.cuda.synchronize()
        failure = None
        try:
            gpu_buffer.runtime.check_error()
        except RuntimeError as e:
            failure = str(e)
        return self.true(failure is None, f"after the last op: {failure}")

    def tensor(self, name, got, dtype=None, shape=None):
        """got is a tensor of this dtype and shape."""
        self.num_checks += 1
        if not torch.is_tensor(got):
            self.fail(f"{name}: expected a tensor, got {type(got).__name__}")
            return False
        ok = True
        if dtype is not None and got.dtype != dtype:
            self.fail(f"{name}: dtype {got.dtype}, expected {dtype}")
            ok = False
        if shape is not None and tuple(got.shape) != tuple(shape):
            self.fail(f"{name}: shape {tuple(got.shape)}, expected {tuple(shape)}")
            ok = False
        return ok

    def equal(self, name, got, exp):
        """Exact equality (dtype, shape, values; float8 compared bytewise)."""
        if not self.tensor(name, got, exp.dtype, exp.shape):
            return False
        a, b = got, exp
        if a.dtype == FP8:
            a, b = ref.dense(a).view(torch.uint8), ref.dense(b).view(torch.uint8)
        if torch.equal(a, b):
            return True
        ne = a != b
        first = tuple(ne.nonzero()[0].tolist()) if ne.dim() else ()
        ga = got[first].float().item() if got.dtype == FP8 else got[first].item()
        eb = exp[first].float().item() if exp.dtype == FP8 else exp[first].item()
        self.fail(
            f"{name}: {int(ne.sum())}/{a.numel()} elements differ; first at {list(first)}: got {_fmt(ga)}, "
            f"expected {_fmt(eb)}"
        )
        return False

    def combined(self, name, got, ref64, abs64, num_terms, what, context):
        """got (BF16) is ref64 rounded to BF16, allowing an FP32 accumulation of num_terms terms (abs64: the sum of
        the terms' magnitudes); a mismatch also names the first element and context(its row)."""
        bad = ref.combine_mismatch(got, ref64, abs64, num_terms)
        if self.true(not bool(bad.any()), f"{name}: {int(bad.sum())}/{bad.numel()} elements are not {what}"):
            return True
        i, j = bad.nonzero()[0].tolist()
        self.fail(f"  first at [{i}, {j}]: got {got[i, j].item()}, expected {ref64[i, j].item():.6g} ({context(i)})")
        return False

    def diff_below(self, name, got, exp, limit):
        d = ref.calc_diff(got, exp)
        return self.true(d < limit, f"{name}: calc_diff {d:.3g} >= {limit:g}")


def _check_same_hashes(ck, hashes):
    """hashes: one {component: digest} per identical run; every component must be the same in every run."""
    differ = [k for k in hashes[0] if len({h[k] for h in hashes}) > 1]
    ck.true(not differ, f"{len(hashes)} identical runs gave different results for: {', '.join(differ)}")


# ===============================================================================================================
# High-throughput (normal) mode


def make_ht_inputs(
    rank, seed, n, hidden, k, num_experts, avoid_rank=None, avoid_ranks=(), topk_groups=None, ranks_per_node=None
):
    """avoid_rank, avoid_ranks: no token selects an expert of those ranks (their receive sides are empty);
    topk_groups: each token's experts lie on at most that many nodes of ranks_per_node ranks (DeepEP's grouped
    routing: the nodes of the highest group scores)."""
    torch.manual_seed(seed + rank)
    x = torch.randn(n, hidden, dtype=torch.float32).to(BF16)
    scores = torch.randn(n, num_experts).abs() + 1
    e_l = num_experts // dist.get_world_size()
    for r in ([avoid_rank] if avoid_rank is not None else []) + list(avoid_ranks):
        scores[:, r * e_l : (r + 1) * e_l] = 0
    if topk_groups:
        nodes = dist.get_world_size() // ranks_per_node
        groups = scores.view(n, nodes, num_experts // nodes).amax(-1)
        keep = torch.zeros(n, nodes, dtype=torch.bool).scatter_(
            1, torch.topk(groups, topk_groups, dim=-1).indices, True
        )
        scores = scores * keep.repeat_interleave(num_experts // nodes, dim=1)
    idx = torch.topk(scores, k, dim=-1, sorted=False).indices
    if topk_groups:  # fewer nonzero scores than k: the zeros picked are not of the token's nodes
        idx = torch.where(scores.gather(1, idx) > 0, idx, -1)
    holes = max(1, n // 8)
    if n:
        idx[torch.randint(0, n, (holes,)), torch.randint(0, k, (holes,))] = -1
    if n >= 16:
        idx[torch.randint(0, n, (2,))] = -1  # two tokens routed nowhere
    w = torch.randn(n, k, dtype=torch.float32)
    x_fp8, s = ref.per_token_cast_to_fp8(x)
    return {
        "x": x,
        "x_const": torch.ones(n, hidden, dtype=BF16) * (rank + 1),  # never all zeros (rank 0 included)
        "idx": idx.to(topk_idx_t()).contiguous(),
        "w": w,
        "w_const": torch.ones(n, k, dtype=torch.float32) * (rank + 1),
        "x_fp8": x_fp8,
        "s": s,
        "s_cm": s.T.contiguous().T,  # column-major scales, as DeepEP's tests pass them
        "b0": torch.ones(n, hidden, dtype=BF16),
        "b1": torch.randn(n, hidden, dtype=torch.float32).to(BF16),
    }


def _check_ht_dispatch(ck, out, rd, exp_x, with_topk, num_nodes, world, rank, is_in_local, kind):
    """Checks one non-cached dispatch result against the reference rd (ht_dispatch_ref) and the expected rows."""
    if not ck.true(
        isinstance(out, tuple) and len(out) == 6,
        f"dispatch returned {type(out).__name__} "
        f"of length {len(out) if isinstance(out, tuple) else '-'}, expected a 6-tuple",
    ):
        return False
    recv_x, recv_idx, recv_w, lst, handle, _ = out
    m = rd["num_recv"]
    assert m == int(rd["counts"][:, rank].sum()), "test bug: the reference's row count disagrees with its counts"
    if kind == "fp8":
        if ck.true(isinstance(recv_x, tuple) and len(recv_x) == 2, "FP8 recv_x is not an (x, scales) tuple"):
            ck.equal("recv_x[0] (FP8 payload)", recv_x[0], exp_x[0])
            ck.equal("recv_x[1] (scales)", recv_x[1], exp_x[1])
            if torch.is_tensor(recv_x[1]):
                ck.true(recv_x[1].is_contiguous(), "received FP8 scales are not contiguous [num_recv, S]")
    else:
        ck.equal("recv_x", recv_x, exp_x)
    ck.true(
        isinstance(lst, list) and all(isinstance(v, int) for v in lst),
        f"num_recv_tokens_per_expert_list is not a list of ints: {type(lst).__name__} {lst!r:.200}",
    )
    ck.true(lst == rd["per_expert_list"], f"num_recv_tokens_per_expert_list {lst} != {rd['per_expert_list']}")
    if with_topk:
        ck.equal("recv_topk_idx", recv_idx, rd["recv_topk_idx"].to(topk_idx_t()))
        ck.equal("recv_topk_weights", recv_w, rd["recv_topk_weights"])
    else:
        ck.true(recv_idx is None and recv_w is None, "recv_topk_idx/recv_topk_weights must be None without top-k")
    if not ck.true(isinstance(handle, tuple), f"handle is a {type(handle).__name__}, not a tuple"):
        return False
    prefix = None
    if num_nodes == 1:
        if ck.true(len(handle) == 6, f"intranode handle has {len(handle)} elements, expected 6"):
            rpm = handle[0]
            if ck.tensor("handle[0] rank_prefix_matrix", rpm, torch.int32, (world, world)):
                ck.equal(
                    "handle[0] rank_prefix_matrix[:, rank]",
                    rpm[:, rank].contiguous(),
                    rd["rank_prefix_matrix"][:, rank].contiguous(),
                )
                ck.equal("handle[0] rank_prefix_matrix (full)", rpm, rd["rank_prefix_matrix"])
            ck.equal("handle[3] recv_src_idx", handle[3], rd["src_token"].to(torch.int32))
            ck.equal("handle[4] is_token_in_rank", handle[4], is_in_local)
            prefix = rpm[:, rank] if torch.is_tensor(rpm) and rpm.shape == (world, world) else None
    else:
        if ck.true(len(handle) == 10, f"internode handle has {len(handle)} elements, expected 10"):
            ck.equal("handle[0] is_token_in_rank", handle[0], is_in_local)
            if ck.equal("handle[-4] recv_gbl_rank_prefix_sum", handle[-4], rd["gbl_rank_prefix_sum"]):
                prefix = handle[-4]
    if kind == "const" and prefix is not None and torch.is_tensor(recv_x) and recv_x.dim() == 2:
        # DeepEP's check_data: the block of source i, located through the handle's prefix, holds i + 1 everywhere.
        begin = 0
        for i in range(world):
            end = int(prefix[i])
            blk = recv_x[begin:end]
            if blk.numel():
                ck.true(
                    bool((blk.float() == i + 1).all()),
                    f"rows [{begin}, {end}) located by the handle are not all {i + 1}",
                )
            begin = end
    return True


def _check_ht_combine(ck, out, x_seen, is_in, bias, with_topk, w_ref, x_orig=None):
    """combined_x against the float64 sum, over the ranks that got each token, of their expert outputs
    (ref.ht_expert_outputs: a factor per receiving rank, an offset per receiving and source rank) plus the biases:
    every element must be the BF16 rounding of it. x_seen: the rows the receivers saw (FP8: dequantized); x_orig:
    the rows before the FP8 cast, for a looser check of what the cast costs. w_ref: combined_topk_weights' float64
    reference."""
    if not ck.true(isinstance(out, tuple) and len(out) == 3, "combine did not return a 3-tuple"):
        return
    combined, cw, _ = out
    n, h = x_seen.shape
    rank = dist.get_rank()
    if ck.tensor("combined_x", combined, BF16, (n, h)):
        ref64, abs64 = ref.ht_combine_expert_ref(x_seen, is_in, rank, bias)
        ck.combined(
            "combined_x",
            combined,
            ref64,
            abs64,
            is_in.size(1) + 2,
            "the BF16 rounding of the receiving ranks' expert outputs (plus bias)",
            lambda i: f"token sent to ranks {is_in[i].nonzero().flatten().tolist()}",
        )
        if x_orig is not None and n:
            orig64 = ref.ht_combine_expert_ref(x_orig, is_in, rank, bias)[0]
            ck.diff_below("combined_x vs the same experts on the original (pre-FP8) x", combined, orig64, 5e-4)
    if with_topk:
        if ck.tensor("combined_topk_weights", cw, torch.float32, tuple(w_ref.shape)):
            d = ref.calc_diff(cw, w_ref)
            err = (cw.double() - w_ref).abs().max().item() if cw.numel() else 0.0
            ck.true(
                d < 1e-9 and err <= 1e-5 * (1 + (w_ref.abs().max().item() if w_ref.numel() else 0)),
                f"combined_topk_weights: calc_diff {d:.3g}, max abs error {err:.3g}",
            )
    else:
        ck.true(cw is None, "combined_topk_weights must be None when no topk_weights are combined")


def make_ht_buffer(rank, rpn, transport, backend="host", nvl_bytes=HT_NVL_BYTES):
    """A normal-mode Buffer; backend='cuda' gives one on this rank's GPU, wrapped so that CPU-tensor checks run
    unchanged (gpu_ht_adapter)."""
    if backend == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    buf = portep.Buffer(
        dist.group.WORLD,
        nvl_bytes,
        0,
        low_latency_mode=False,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=60,
        explicitly_destroy=True,
        backend=backend,
    )
    if backend == "cuda":
        from gpu_ht_adapter import CudaHTAdapter

        return CudaHTAdapter(buf)
    return buf


def ht_body(
    rank,
    world,
    rpn,
    transport,
    seed,
    n_tokens,
    hidden,
    num_topk,
    num_experts,
    pressure_runs=3,
    starve_last=False,
    backend="host",
    nvl_bytes=HT_NVL_BYTES,
):
    """starve_last: no rank routes anything to the last rank (empty receive side); otherwise rank 0 alone avoids
    the last rank (one empty source block). nvl_bytes: the Buffer's num_nvl_bytes (DeepEP's tests take 2e9)."""
    ck = Checker(rank)
    e_l = num_experts // world
    num_nodes = world // rpn
    n = n_tokens[rank]
    n_max = max(n_tokens)
    buf = make_ht_buffer(rank, rpn, transport, backend, nvl_bytes)
    avoid = world - 1 if (starve_last or rank == 0) else None
    inp = make_ht_inputs(rank, seed, n, hidden, num_topk, num_experts, avoid_rank=avoid)
    idx = inp["idx"]

    # --- layout ---------------------------------------------------------------------------------------------
    ck.step = "get_dispatch_layout"
    r_ntpr, r_rdma, r_ntpe, r_itir = ref.layout_ref(idx, num_experts, world, rpn)
    res = buf.get_dispatch_layout(idx, num_experts)
    if ck.true(isinstance(res, tuple) and len(res) == 5, "get_dispatch_layout did not return a 5-tuple"):
        ntpr, ntp_rdma, ntpe, itir, _ = res
        ck.equal("num_tokens_per_rank", ntpr, r_ntpr)
        if r_rdma is None:
            ck.true(ntp_rdma is None, f"num_tokens_per_rdma_rank must be None with one node, got {ntp_rdma!r:.80}")
        else:
            ck.equal("num_tokens_per_rdma_rank", ntp_rdma, r_rdma)
        ck.equal("num_tokens_per_expert", ntpe, r_ntpe)
        ck.equal("is_token_in_rank", itir, r_itir)
    # Dispatch uses the reference layout, so its checks do not depend on the layout kernel.
    layout = {
        "num_tokens_per_rank": r_ntpr,
        "num_tokens_per_rdma_rank": r_rdma,
        "is_token_in_rank": r_itir,
        "num_tokens_per_expert": r_ntpe,
    }

    g = all_gather({"idx": idx, "w": inp["w"], "x": inp["x"], "x_fp8": inp["x_fp8"].view(torch.uint8), "s": inp["s"]})
    all_idx = [v["idx"] for v in g]
    all_x = [v["x"] for v in g]
    all_fp8 = [v["x_fp8"].view(FP8) for v in g]
    all_s = [v["s"] for v in g]
    all_w = {"rand": [v["w"] for v in g], "const": [torch.ones(n_tokens[j], num_topk) * (j + 1) for j in range(world)]}
    all_xc = [torch.ones(n_tokens[j], hidden, dtype=BF16) * (j + 1) for j in range(world)]
    # The same layout reference, all-reduced, for the cardinality checks.
    red_ntpr = sum(ref.layout_ref(t, num_experts, world, rpn)[0] for t in all_idx)
    red_ntpe = sum(ref.layout_ref(t, num_experts, world, rpn)[2] for t in all_idx)
    x_fp8_deq = ref.per_token_cast_back(inp["x_fp8"], inp["s"]).to(BF16)

    variants = [
        ("rand", False, 1),
        ("rand", True, 4),
        ("const", False, 4),
        ("const", True, 1),
        ("fp8", False, 1),
        ("fp8", True, 4),
    ]
    biases = [None, inp["b0"], (inp["b0"], inp["b1"])]
    for vi, (kind, with_topk, align) in enumerate(variants):
        tag = f"{kind} topk={with_topk} align={align}"
        ck.step = f"dispatch {tag}"
        x_in = {"rand": inp["x"], "const": inp["x_const"], "fp8": (inp["x_fp8"], inp["s_cm"])}[kind]
        w_in = inp["w_const"] if kind == "const" else inp["w"]
        rd = ref.ht_dispatch_ref(
            rank, world, num_experts, all_idx, all_w["const" if kind == "const" else "rand"], expert_alignment=align
        )
        if kind == "fp8":
            exp_x = (
                ref.gather_rows(all_fp8, rd["src_rank"], rd["src_token"]),
                ref.gather_rows(all_s, rd["src_rank"], rd["src_token"]),
            )
        else:
            exp_x = ref.gather_rows(all_x if kind == "rand" else all_xc, rd["src_rank"], rd["src_token"])
        assert rd["num_recv"] == int(red_ntpr[rank]), "test bug: reference rows != all-reduced num_tokens_per_rank"
        assert rd["per_expert_list"] == [ref.align_up(int(c), align) for c in red_ntpe.view(world, -1)[rank]], (
            "test bug: reference list != all-reduced num_tokens_per_expert"
        )
        args = dict(layout, expert_alignment=align)
        if with_topk:
            args.update(topk_idx=idx, topk_weights=w_in)
        out = buf.dispatch(x_in, **args)
        ok = _check_ht_dispatch(ck, out, rd, exp_x, with_topk, num_nodes, world, rank, r_itir, kind)
        recv_x, recv_idx, recv_w, _, handle, _ = out if ok else (None,) * 6
        m = rd["num_recv"]

        if with_topk:
            ck.step = f"dispatch {tag} num_worst_tokens"
            worst = n_max * world
            wout = buf.dispatch(x_in, num_worst_tokens=worst, **args)
            if ck.true(isinstance(wout, tuple) and len(wout) == 6, "num_worst_tokens dispatch: not a 6-tuple"):
                wx, widx, ww, wlst, _, _ = wout
                ck.true(wlst == [], f"num_recv_tokens_per_expert_list must be empty, got {wlst!r:.100}")
                pairs = (
                    [("recv_x[0]", wx[0], exp_x[0]), ("recv_x[1]", wx[1], exp_x[1])]
                    if kind == "fp8"
                    else [("recv_x", wx, exp_x)]
                )
                pairs += [
                    ("recv_topk_idx", widx, rd["recv_topk_idx"].to(topk_idx_t())),
                    ("recv_topk_weights", ww, rd["recv_topk_weights"]),
                ]
                for name, got, exp in pairs:
                    if ck.tensor(name, got, exp.dtype, (worst,) + tuple(exp.shape[1:])):
                        ck.equal(f"{name}[:num_recv] vs the normal result", got[:m], exp)
                if torch.is_tensor(widx) and widx.shape[0] == worst:
                    ck.true(bool((widx[m:] == -1).all()), "recv_topk_idx rows past the real count are not all -1")

        if ok:
            ck.step = f"dispatch {tag} cached"
            cout = buf.dispatch(x_in, handle=handle)
            if ck.true(isinstance(cout, tuple) and len(cout) == 6, "cached dispatch: not a 6-tuple"):
                ck.true(
                    all(v is None for v in cout[1:5]),
                    "cached dispatch must return (recv_x, None, None, None, "
                    f"None, event), got types {[type(v).__name__ for v in cout[1:5]]}",
                )
                if kind == "fp8":
                    if ck.true(isinstance(cout[0], tuple) and len(cout[0]) == 2, "cached FP8 recv_x is not a tuple"):
                        ck.equal("cached recv_x[0]", cout[0][0], exp_x[0])
                        ck.equal("cached recv_x[1]", cout[0][1], exp_x[1])
                else:
                    ck.equal("cached recv_x", cout[0], exp_x)
            if kind != "fp8":
                # Same routing, new data: the handle alone must route it.
                cout = buf.dispatch(-x_in, handle=handle)
                ck.equal("cached recv_x of -x", cout[0], -exp_x)

        # --- combine: this rank's expert outputs of what it received --------------------------------------------
        # (`ok` only depends on the structure of the result, which is the same on every rank.)
        if ok:
            bias = biases[vi % 3]
            fill = kind == "const"
            ck.step = f"combine {tag} bias={['none', 'tensor', 'tuple'][vi % 3]} fill_by_rank={fill}"
            seen = ref.per_token_cast_back(recv_x[0], recv_x[1]).to(BF16) if kind == "fp8" else recv_x
            y = ref.ht_expert_outputs(seen, rank, rd["src_rank"])
            cargs = {}
            w_ref = None
            if with_topk:
                ew = recv_w.clone()
                if fill:
                    ew[recv_idx == -1] = rank + 1
                cargs["topk_weights"] = ew
                w_ref = ref.ht_combine_weights_ref(idx, w_in, r_itir, e_l, fill_by_rank=fill)
            if bias is not None:
                cargs["bias"] = bias
            cout = buf.combine(y, handle, **cargs)
            x_ref = {"rand": inp["x"], "const": inp["x_const"], "fp8": x_fp8_deq}[kind]
            _check_ht_combine(
                ck, cout, x_ref, r_itir, bias, with_topk, w_ref, x_orig=inp["x"] if kind == "fp8" else None
            )

    # --- stream/event arguments: previous_event + async_finish + allocate_on_comm_stream (valid together) -------
    ck.step = "dispatch/combine with previous_event, async_finish, allocate_on_comm_stream"
    prev = portep.Buffer.capture()
    ck.true(hasattr(prev, "current_stream_wait"), f"Buffer.capture() returned {type(prev).__name__}")
    aout = buf.dispatch(
        inp["x"],
        topk_idx=idx,
        topk_weights=inp["w"],
        previous_event=prev,
        async_finish=True,
        allocate_on_comm_stream=True,
        **layout,
    )
    if ck.true(
        isinstance(aout, tuple) and len(aout) == 6 and hasattr(aout[5], "current_stream_wait"),
        "async dispatch did not return an EventOverlap as its last element",
    ):
        aout[5].current_stream_wait()
    rd = ref.ht_dispatch_ref(rank, world, num_experts, all_idx, all_w["rand"])
    if _check_ht_dispatch(
        ck,
        aout,
        rd,
        ref.gather_rows(all_x, rd["src_rank"], rd["src_token"]),
        True,
        num_nodes,
        world,
        rank,
        r_itir,
        "rand",
    ):
        y = ref.ht_expert_outputs(aout[0], rank, rd["src_rank"])
        cout = buf.combine(
            y,
            aout[4],
            topk_weights=aout[2],
            previous_event=portep.Buffer.capture(),
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        if ck.true(
            isinstance(cout, tuple) and len(cout) == 3 and hasattr(cout[2], "__enter__"),
            "async combine did not return an EventOverlap usable in `with`",
        ):
            with cout[2]:
                pass
        _check_ht_combine(
            ck, cout, inp["x"], r_itir, None, True, ref.ht_combine_weights_ref(idx, inp["w"], r_itir, e_l)
        )

    # --- pressure: the same calls with the same seed give bit-identical results ----------------------------------
    ck.step = "pressure"
    hashes = []
    for _ in range(pressure_runs):
        p = make_ht_inputs(rank, seed + 1000, n, hidden, num_topk, num_experts)
        lay = buf.get_dispatch_layout(p["idx"], num_experts)
        pl = dict(
            zip(
                ["num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"],
                ref.layout_ref(p["idx"], num_experts, world, rpn),
            )
        )
        d = buf.dispatch(p["x"], topk_idx=p["idx"], topk_weights=p["w"], **pl)
        src = ref.ht_recv_src_ranks(d[4], rank, d[0].size(0))
        c = buf.combine(ref.ht_expert_outputs(d[0], rank, src), d[4], topk_weights=d[2], bias=(p["b0"], p["b1"]))
        f = buf.dispatch((p["x_fp8"], p["s_cm"]), **pl)
        f_seen = ref.per_token_cast_back(f[0][0], f[0][1]).to(BF16)
        cf = buf.combine(ref.ht_expert_outputs(f_seen, rank, ref.ht_recv_src_ranks(f[4], rank, f_seen.size(0))), f[4])
        parts = {
            "layout": lay[:4],
            "recv_x": d[0],
            "recv_topk_idx": d[1],
            "recv_topk_weights": d[2],
            "list": d[3],
            "combined_x": c[0],
            "combined_topk_weights": c[1],
            "fp8 recv_x": f[0][0],
            "fp8 recv scales": f[0][1],
            "fp8 combined_x": cf[0],
        }
        hashes.append({k: ref.digest(*(v if isinstance(v, tuple) else (v,))) for k, v in parts.items()})
    _check_same_hashes(ck, hashes)

    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks, "hashes": hashes}


# ===============================================================================================================
# Low-latency mode


def make_ll_inputs(rank, seed, n, hidden, k, num_experts, holes=10):
    torch.manual_seed(seed + rank)
    scores = torch.randn(n, num_experts).abs() + 1
    idx = torch.topk(scores, k, dim=-1, sorted=True).indices
    for _ in range(holes):
        idx[int(torch.randint(0, n, (1,))), int(torch.randint(0, k, (1,)))] = -1
    return {
        "x_struct": ref.ll_struct_x(rank, n, hidden),
        "x_rand": torch.randn(n, hidden, dtype=torch.float32).to(BF16),
        "idx": idx.to(topk_idx_t()).contiguous(),
        "w": torch.randn(n, k, dtype=torch.float32).abs(),
    }


class LLRef:
    """Expected LL dispatch results for one rank, given every rank's x and topk_idx."""

    def __init__(self, rank, world, T, hidden, num_experts, all_idx):
        self.rank, self.world, self.T, self.hidden, self.E = rank, world, T, hidden, num_experts
        self.e_l = num_experts // world
        self.counts, self.tokens = ref.ll_expected(rank, world, num_experts, all_idx)
        self.n_all = [int(t.size(0)) for t in all_idx]
        self._quant = {}

    def rows(self, all_x, key, j, toks, use_fp8, round_scale):
        """Expected rows: (BF16 source rows, None), or for FP8 (BF16 source rows, (the scales DeepEP's cast
        stores, the multipliers it applies), float32 [n, H/128] each: ref.ll_fp8_scales_ref)."""
        if not use_fp8:
            return all_x[j][toks], None
        q = self._quant.get((key, j, round_scale))
        if q is None:
            q = ref.ll_fp8_scales_ref(all_x[j], round_scale)
            self._quant[(key, j, round_scale)] = q
        return all_x[j][toks], (q[0][toks], q[1][toks])


def _check_ll_dispatch(ck, res, lref, all_x, key, hook_flag, use_fp8, round_scale, use_ue8m0, structured):
    T, H, world, e_l = lref.T, lref.hidden, lref.world, lref.e_l
    M = world * T
    if not ck.true(isinstance(res, tuple) and len(res) == 5, "low_latency_dispatch did not return a 5-tuple"):
        return
    recv_x, recv_count, handle, _, hook = res
    ok = ck.tensor("recv_count", recv_count, torch.int32, (e_l,))
    if hook_flag:
        ck.true(callable(hook), "return_recv_hook=True but hook is not callable")
    else:
        ck.true(hook is None, "return_recv_hook=False but hook is not None")
    if not ck.true(isinstance(handle, tuple) and len(handle) == 5, "LL handle is not a 5-tuple"):
        return
    src_info, layout_range = handle[0], handle[1]
    ok &= ck.tensor("handle[0] src_info", src_info, torch.int32, (e_l, M))
    ok &= ck.tensor("handle[1] layout_range", layout_range, torch.int64, (e_l, world))
    ck.true(tuple(handle[2:]) == (T, H, lref.E), f"handle[2:] = {tuple(handle[2:])}, expected {(T, H, lref.E)}")
    if use_fp8:
        if not ck.true(isinstance(recv_x, tuple) and len(recv_x) == 2, "FP8 recv_x is not an (x, scales) tuple"):
            return
        xq, sc = recv_x
        ok &= ck.tensor("recv_x[0]", xq, FP8, (e_l, M, H))
        sdt, S = (torch.int32, H // 512) if use_ue8m0 else (torch.float32, H // 128)
        if ck.tensor("recv_x[1] (scales)", sc, sdt, (e_l, M, S)):
            ck.true(sc.stride(1) == 1, f"scales are not column-major in the last two dims (strides {sc.stride()})")
        else:
            ok = False
    else:
        ok &= ck.tensor("recv_x", recv_x, BF16, (e_l, M, H))
    if not ok:
        return
    exp_total = lref.counts.sum(dim=1)
    ck.equal("recv_count", recv_count, exp_total.to(torch.int32))
    cnt = layout_range & 0xFFFFFFFF
    beg = layout_range >> 32
    ck.equal("layout_range & 0xffffffff", cnt, lref.counts)
    mism = elems = 0
    for e in range(e_l):
        blocks = sorted((int(beg[e, j]), int(cnt[e, j]), j) for j in range(world) if int(cnt[e, j]) > 0)
        pos = 0
        for b, c, j in blocks:
            if b != pos:
                ck.fail(
                    f"expert {e}: source blocks do not tile [0, recv_count): block of src {j} starts at {b}, "
                    f"expected {pos}"
                )
                break
            pos = b + c
        for b, c, j in blocks:
            if c != int(lref.counts[e, j]) or b + c > M:
                continue
            toks = src_info[e, b : b + c].long()
            if not ck.equal(f"src_info of expert {e} from src {j} (sorted)", toks.sort().values, lref.tokens[e][j]):
                continue
            exp_rows, exp_scales = lref.rows(all_x, key, j, toks, use_fp8, round_scale)
            if not use_fp8:
                ck.equal(f"recv_x rows of expert {e} from src {j}", recv_x[e, b : b + c], exp_rows)
                continue
            # The scales exactly as DeepEP's cast computes them (UE8M0: the exponent bytes of the same powers of
            # two), and every FP8 value x * multiplier rounded to E4M3.
            stored, mult = exp_scales
            got_s = ref.unpack_scales(sc[e, b : b + c]).float()
            what = "2^ceil(log2(amax * float32(1/448)))" if round_scale else "amax * float32(1/448)"
            if not ck.equal(f"scales of expert {e} from src {j} ({what})", got_s, stored):
                continue
            bad = ref.e4m3_rounding_mismatch(xq[e, b : b + c].float(), exp_rows, mult)
            mism += int(bad.sum())
            elems += bad.numel()
            got = ref.per_token_cast_back(xq[e, b : b + c], sc[e, b : b + c])
            if structured and not round_scale:
                # DeepEP's exact checks on the structured input: dequantized rows equal the original rows.
                ck.equal(f"dequantized rows of expert {e} from src {j}", got.to(BF16), all_x[j][toks])
            if structured and round_scale and c > 1:
                ck.diff_below(f"expert {e} src {j}: last column vs src_info", got[:, -1], toks.float(), 0.007)
    if use_fp8 and elems:
        ck.true(mism == 0, f"FP8 payload: {mism}/{elems} values are not x * multiplier rounded to E4M3")


def _ll_sim_x(recv_x, recv_count, use_fp8, nan_fill):
    """The received rows as BF16 (FP8: dequantized), rows past recv_count poisoned with NaN if asked. Not an expert
    output by itself: combine _ll_expert_y's, which tell experts and sources apart."""
    sim = ref.per_token_cast_back(recv_x[0], recv_x[1]).to(BF16) if use_fp8 else recv_x.clone()
    if nan_fill:
        for e in range(sim.size(0)):
            sim[e, int(recv_count[e]) :] = float("nan")
    return sim.contiguous()


def _ll_expert_y(res, rank, use_fp8, nan_fill):
    """The experts' outputs for an LL dispatch result: ref.ll_expert_outputs of the received rows (FP8:
    dequantized), a factor per global expert and an offset per expert and source rank, so that a weight applied to
    the wrong top-k slot or a row reduced from the wrong expert changes the combined sum; rows past recv_count
    poisoned with NaN if asked (a combine must never read them), else a finite constant. Only the rows below the
    largest recv_count are dequantized and computed: at production shapes the rest is most of the buffer."""
    recv_x, recv_count, handle = res[0], res[1], res[2]
    x = recv_x[0] if use_fp8 else recv_x
    e_l, m_all, hidden = x.shape
    m = min(m_all, int(recv_count.max()) if recv_count.numel() else 0)
    seen = ref.per_token_cast_back(x[:, :m], recv_x[1][:, :m]).to(BF16) if use_fp8 else x[:, :m]
    y = torch.full((e_l, m_all, hidden), float("nan") if nan_fill else 0.75, dtype=BF16)
    y[:, :m] = ref.ll_expert_outputs(seen, handle[1], rank)
    if nan_fill:
        for e in range(e_l):
            y[e, int(recv_count[e]) : m] = float("nan")
    return y


def _ll_combine(ck, buf, sim, idx, w, handle, zero_copy, hook, out, cost_stats=None, async_finish=False):
    if zero_copy:
        nb = buf.get_next_low_latency_combine_buffer(handle)
        if ck.tensor("get_next_low_latency_combine_buffer", nb, BF16, tuple(sim.shape)):
            nb[:, :, :] = sim
    kw = {"zero_copy": zero_copy, "return_recv_hook": hook}
    if out is not None:
        kw["out"] = out
    if cost_stats is not None:
        kw["combine_wait_recv_cost_stats"] = cost_stats
    if async_finish:
        kw["async_finish"] = True
    res = buf.low_latency_combine(sim, idx, w, handle, **kw)
    if not ck.true(isinstance(res, tuple) and len(res) == 3, "low_latency_combine did not return a 3-tuple"):
        return None
    combined, event, chook = res
    if async_finish and ck.true(hasattr(event, "current_stream_wait"), "async LL combine: no EventOverlap"):
        event.current_stream_wait()
    if hook:
        if ck.true(callable(chook), "combine: return_recv_hook=True but hook is not callable"):
            chook()
            check_hook_runs_once(ck, chook)
    else:
        ck.true(chook is None, "combine: return_recv_hook=False but hook is not None")
    return combined


def check_hook_runs_once(ck, hook):
    """A receive hook, already called, runs once: called again it raises, launching nothing (a second receive phase
    would wait for data no peer sends), and the Buffer goes on in step (the caller's later rounds)."""
    try:
        hook()
    except RuntimeError as e:
        ck.true("already called" in str(e), f"a receive hook called twice raised {e!r}")
    else:
        ck.true(False, "a receive hook called twice ran again")


def _check_ll_combine(ck, combined, out, x_self, x_self_q, idx, w, use_fp8, round_scale):
    """combined_x against the float64 weighted sum of the experts' outputs (_ll_expert_y) for the rows the experts
    saw (x_self, or x_self_q after an FP8 dispatch): every element the BF16 rounding of it; without round_scale an
    FP8 result is also close to the same sum on the original rows."""
    n, h = x_self.shape
    if not ck.tensor("combined_x", combined, BF16, (n, h)):
        return
    ck.true(not bool(combined.isnan().any()), "combined_x has NaN")
    if out is not None:
        ck.true(torch.equal(out, combined), "the result was not written into out=")
    rank = dist.get_rank()
    ref64, abs64 = ref.ll_combine_expert_ref(x_self_q if use_fp8 else x_self, idx, w, rank)
    ck.combined(
        "combined_x",
        combined,
        ref64,
        abs64,
        idx.size(1),
        "within BF16 rounding of sum_k w[t, k] * expert_k(x[t])",
        lambda i: f"experts {idx[i].tolist()}",
    )
    if use_fp8 and not round_scale and n:
        orig64 = ref.ll_combine_expert_ref(x_self, idx, w, rank)[0]
        ck.diff_below("combined_x vs the same experts on the original (pre-FP8) x", combined, orig64, 9e-4)
    none = ~(idx >= 0).any(dim=1)
    if none.any():
        ck.true(bool((combined[none] == 0).all()), "tokens with no expert do not combine to zeros")


def _ll_row_digest(res, use_fp8, world):
    recv_x, recv_count, handle, _, _ = res
    src_info, layout_range = handle[0], handle[1]
    parts = [ref.digest(recv_count, layout_range & 0xFFFFFFFF)]
    for e in range(recv_count.size(0)):
        c = int(recv_count[e])
        src = torch.zeros(c, dtype=torch.int64)
        for j in range(world):
            b, k = int(layout_range[e, j] >> 32), int(layout_range[e, j] & 0xFFFFFFFF)
            src[b : b + k] = j
        if use_fp8:
            rows = torch.cat(
                [ref.dense(recv_x[0][e, :c]).view(torch.uint8), ref.dense(recv_x[1][e, :c]).view(torch.uint8)], dim=1
            )
        else:
            rows = ref.dense(recv_x[e, :c]).view(torch.uint8)
        keys = torch.stack([src, src_info[e, :c].long()], dim=1)
        parts.append(ref.row_multiset_digest(rows, keys))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def make_ll_buffer(rank, world, rpn, transport, T, hidden, num_experts, backend="host", allow_nvlink=True):
    """A low-latency Buffer of DeepEP's hinted size; backend='cuda' gives one on this rank's GPU, wrapped so that
    CPU-tensor checks run unchanged (gpu_ll_adapter)."""
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, hidden, world, num_experts)
    if backend == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    buf = portep.Buffer(
        dist.group.WORLD,
        0,
        nbytes,
        low_latency_mode=True,
        num_ranks_per_node=rpn,
        allow_nvlink_for_low_latency_mode=allow_nvlink,
        transport=transport,
        timeout_s=30 if backend == "cuda" else 60,
        explicitly_destroy=True,
        backend=backend,
    )
    if backend == "cuda":
        from gpu_ll_adapter import CudaLLAdapter

        return CudaLLAdapter(buf)
    return buf


def _ranks_done(backend):
    """Every rank's calls so far have finished (their kernels too, on the CUDA backend)."""
    if backend == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def ll_body(
    rank,
    world,
    rpn,
    transport,
    seed,
    T,
    hidden,
    num_experts,
    num_topk,
    vary_tokens=False,
    pressure_runs=3,
    backend="host",
    allow_nvlink=True,
):
    ck = Checker(rank)
    e_l = num_experts // world
    n_all = [max(1, T - 3 * j - 1) if vary_tokens else T for j in range(world)]
    n = n_all[rank]
    buf = make_ll_buffer(rank, world, rpn, transport, T, hidden, num_experts, backend, allow_nvlink)
    inp = make_ll_inputs(rank, seed, n, hidden, num_topk, num_experts)
    idx, w = inp["idx"], inp["w"]
    g = all_gather({"idx": idx, "x_rand": inp["x_rand"]})
    all_idx = [v["idx"] for v in g]
    xs = {"struct": [ref.ll_struct_x(j, n_all[j], hidden) for j in range(world)], "rand": [v["x_rand"] for v in g]}
    lref = LLRef(rank, world, T, hidden, num_experts, all_idx)
    stats = torch.zeros(e_l, dtype=torch.int32)
    exp_stats = torch.zeros(e_l, dtype=torch.int64)
    self_q = {}

    def x_self_q(key, rnd):
        """This rank's rows as the experts see them after an FP8 dispatch (DeepEP's cast, dequantized)."""
        if (key, rnd) not in self_q:
            self_q[(key, rnd)] = ref.ll_fp8_round_trip(inp["x_" + key], rnd)
        return self_q[(key, rnd)]

    def dispatch(key, fp8, rnd, ue, hook, defer=False, **extra):
        """defer (with hook): the receive hook and the stats check are left to the caller."""
        nonlocal exp_stats
        res = buf.low_latency_dispatch(
            inp["x_" + key],
            idx,
            T,
            num_experts,
            cumulative_local_expert_recv_stats=stats,
            use_fp8=fp8,
            round_scale=rnd,
            use_ue8m0=ue,
            return_recv_hook=hook,
            **extra,
        )
        exp_stats = exp_stats + lref.counts.sum(dim=1)
        if defer:
            return res
        if hook and isinstance(res, tuple) and len(res) == 5 and callable(res[4]):
            res[4]()
        if extra.get("async_finish"):
            if ck.true(
                isinstance(res, tuple) and len(res) == 5 and hasattr(res[3], "current_stream_wait"),
                "async LL dispatch did not return an EventOverlap",
            ):
                res[3].current_stream_wait()
        ck.equal("cumulative_local_expert_recv_stats", stats, exp_stats.to(torch.int32))
        return res

    def combine_and_check(res, key, fp8, rnd, zero_copy, hook, use_out, nan_fill, cost_stats=None, async_finish=False):
        if not (
            isinstance(res, tuple)
            and len(res) == 5
            and isinstance(res[2], tuple)
            and torch.is_tensor(res[1])
            and res[1].shape == (e_l,)
            and torch.is_tensor(res[2][1])
            and res[2][1].shape == (e_l, world)
        ):
            ck.fail("cannot combine: the dispatch result is malformed")
            return
        sim = _ll_expert_y(res, rank, fp8, nan_fill)
        out = torch.full((n, hidden), 7.0, dtype=BF16) if use_out else None
        combined = _ll_combine(ck, buf, sim, idx, w, res[2], zero_copy, hook, out, cost_stats, async_finish)
        if combined is not None:
            _check_ll_combine(ck, combined, out, inp["x_" + key], x_self_q(key, rnd) if fp8 else None, idx, w, fp8, rnd)

    modes = [(False, False, False), (True, False, False), (True, True, False)]
    if hidden % 512 == 0:
        modes.append((True, True, True))
    step = 0
    for hook in (False, True):
        for fp8, rnd, ue in modes:
            times = 1 + step % 2  # one or two dispatches in a row: both buffer halves, two results held at once
            zero_copy, use_out, nan_fill = step % 2 == 1, (step // 2) % 2 == 1, step % 3 != 2
            ck.step = (
                f"struct hook={hook} fp8={fp8} round={rnd} ue8m0={ue} x{times} zero_copy={zero_copy} "
                f"out={use_out} poisoned_invalid_rows={nan_fill}"
            )
            results = [dispatch("struct", fp8, rnd, ue, hook) for _ in range(times)]
            for i, res in enumerate(results):
                ck.step = ck.step.split(" | ")[0] + f" | dispatch #{i + 1}"
                _check_ll_dispatch(ck, res, lref, xs["struct"], "struct", hook, fp8, rnd, ue, True)
            ck.step = ck.step.split(" | ")[0] + " | combine"
            combine_and_check(results[-1], "struct", fp8, rnd, zero_copy, hook, use_out, nan_fill)
            step += 1

    # Random data: every received row against the reference cast of the gathered source rows.
    rmodes = [(False, False, False), (True, False, False), (True, True, hidden % 512 == 0)]
    for i, (fp8, rnd, ue) in enumerate(rmodes):
        ck.step = f"rand fp8={fp8} round={rnd} ue8m0={ue}"
        res = dispatch("rand", fp8, rnd, ue, i == 1)
        _check_ll_dispatch(ck, res, lref, xs["rand"], "rand", i == 1, fp8, rnd, ue, False)
        combine_and_check(res, "rand", fp8, rnd, i == 2, i == 1, i == 0, True)

    # Two-batch overlap (DeepEP's double-batch overlapping): two dispatches in flight, each with a receive hook, both
    # sent before either receives; then their combines the same way. Each hook receives its own call's data (its
    # half, its sequence number) although a later call has begun since. As in DeepEP, a rank's next call into a
    # buffer half must not come while a peer still receives that half's previous call: with two calls in flight no
    # receive orders them, so the barriers stand in for the expert work between them in a model.
    ck.step = "two-batch overlap"
    _ranks_done(backend)
    pair = [dispatch(key, False, False, False, True, defer=True) for key in ("struct", "rand")]
    for res in pair:
        if ck.true(isinstance(res, tuple) and len(res) == 5 and callable(res[4]), "no receive hook to call"):
            res[4]()
    _ranks_done(backend)
    ck.equal("cumulative_local_expert_recv_stats", stats, exp_stats.to(torch.int32))
    for res, key in zip(pair, ("struct", "rand")):
        _check_ll_dispatch(ck, res, lref, xs[key], key, True, False, False, False, key == "struct")
    hooks = []
    for res in pair:
        sim = _ll_expert_y(res, rank, False, True)
        hooks.append(buf.low_latency_combine(sim, idx, w, res[2], return_recv_hook=True))
    for combined, _, chook in hooks:
        if ck.true(callable(chook), "combine: no receive hook to call"):
            chook()
    _ranks_done(backend)
    for (combined, _, _), key in zip(hooks, ("struct", "rand")):
        _check_ll_combine(ck, combined, None, inp["x_" + key], None, idx, w, False, False)

    # clean_low_latency_buffer, then three dispatch+combine rounds in a row (with the wait-cost stats once).
    ck.step = "clean_low_latency_buffer"
    buf.clean_low_latency_buffer(T, hidden, num_experts)
    for i in range(3):
        ck.step = f"after clean, round {i + 1}" + (" (async_finish)" if i == 2 else "")
        extra, cstats = {}, None
        if i == 0:
            extra = {"dispatch_wait_recv_cost_stats": torch.zeros(world, dtype=torch.int64)}
            cstats = torch.zeros(world, dtype=torch.int64)
        if i == 2:
            extra = {"async_finish": True}
        res = dispatch("struct", False, False, False, i == 1, **extra)
        _check_ll_dispatch(ck, res, lref, xs["struct"], "struct", i == 1, False, False, False, True)
        combine_and_check(
            res, "struct", False, False, i == 2, i == 1, False, True, cost_stats=cstats, async_finish=i == 2
        )
        if i == 0:
            for name, t in (
                ("dispatch_wait_recv_cost_stats", extra["dispatch_wait_recv_cost_stats"]),
                ("combine_wait_recv_cost_stats", cstats),
            ):
                ck.true(
                    t.shape == (world,) and t.dtype == torch.int64 and bool((t >= 0).all()),
                    f"{name} was changed to {t!r:.100}",
                )

    # Pressure: the same calls with the same seed give the same (order-invariant) received rows and the same
    # combined output, bit for bit.
    ck.step = "pressure"
    hashes = []
    for _ in range(pressure_runs):
        p = make_ll_inputs(rank, seed + 500, n, hidden, num_topk, num_experts)
        res = buf.low_latency_dispatch(p["x_rand"], p["idx"], T, num_experts, use_fp8=True)
        sim = _ll_expert_y(res, rank, True, False)
        comb = buf.low_latency_combine(sim, p["idx"], p["w"], res[2])[0]
        hashes.append(
            {"received rows (order-invariant)": _ll_row_digest(res, True, world), "combined_x": ref.digest(comb)}
        )
    _check_same_hashes(ck, hashes)

    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks, "hashes": hashes}


# ===============================================================================================================
# Bad inputs


class Expect:
    """Runs bad calls and records what they raised."""

    def __init__(self):
        self.records = []

    def __call__(self, case, fn, names, allowed=(ValueError, TypeError)):
        try:
            fn()
            self.records.append(
                {
                    "case": case,
                    "raised": None,
                    "type_ok": False,
                    "message": "",
                    "names": names,
                    "allowed": [a.__name__ for a in allowed],
                }
            )
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            self.records.append(
                {
                    "case": case,
                    "raised": type(exc).__name__,
                    "type_ok": isinstance(exc, allowed),
                    "message": str(exc)[:400],
                    "names": names,
                    "allowed": [a.__name__ for a in allowed],
                }
            )


def _ht_good_round(ck, buf, world, rpn, seed, n, hidden, k, num_experts, tag):
    """One correct get_dispatch_layout + dispatch + combine, checked (proves the Buffer is still usable)."""
    ck.step = f"good call {tag}"
    rank = dist.get_rank()
    inp = make_ht_inputs(rank, seed, n, hidden, k, num_experts)
    r_ntpr, r_rdma, r_ntpe, r_itir = ref.layout_ref(inp["idx"], num_experts, world, rpn)
    lay = buf.get_dispatch_layout(inp["idx"], num_experts)
    ck.equal("num_tokens_per_rank", lay[0], r_ntpr)
    ck.equal("is_token_in_rank", lay[3], r_itir)
    all_idx = all_gather(inp["idx"])
    all_w = all_gather(inp["w"])
    all_x = all_gather(inp["x"])
    rd = ref.ht_dispatch_ref(rank, world, num_experts, all_idx, all_w)
    out = buf.dispatch(
        inp["x"],
        num_tokens_per_rank=r_ntpr,
        num_tokens_per_rdma_rank=r_rdma,
        is_token_in_rank=r_itir,
        num_tokens_per_expert=r_ntpe,
        topk_idx=inp["idx"],
        topk_weights=inp["w"],
    )
    ck.equal("recv_x", out[0], ref.gather_rows(all_x, rd["src_rank"], rd["src_token"]))
    ck.equal("recv_topk_idx", out[1], rd["recv_topk_idx"].to(topk_idx_t()))
    ck.true(out[3] == rd["per_expert_list"], f"list {out[3]} != {rd['per_expert_list']}")
    c = buf.combine(ref.ht_expert_outputs(out[0], rank, rd["src_rank"]), out[4], topk_weights=out[2])
    _check_ht_combine(
        ck,
        c,
        inp["x"],
        r_itir,
        None,
        True,
        ref.ht_combine_weights_ref(inp["idx"], inp["w"], r_itir, num_experts // world),
    )


def bad_inputs_ht(rank, world, rpn, transport):
    ck = Checker(rank)
    ex = Expect()
    n, hidden, k, E = 64, 256, 4, 8 * world
    buf = portep.Buffer(
        dist.group.WORLD,
        64 * MiB,
        0,
        low_latency_mode=False,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=30,
        explicitly_destroy=True,
    )
    _ht_good_round(ck, buf, world, rpn, 5, n, hidden, k, E, "before the bad calls")
    inp = make_ht_inputs(rank, 7, n, hidden, k, E)
    x, idx, w = inp["x"], inp["idx"], inp["w"]
    ntpr, rdma, ntpe, itir = ref.layout_ref(idx, E, world, rpn)
    lay = dict(
        num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=rdma, is_token_in_rank=itir, num_tokens_per_expert=ntpe
    )
    good = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    handle, recv_x, recv_w = good[4], good[0], good[2]
    I32 = torch.int32

    # get_dispatch_layout
    ex("layout: topk_idx int32", lambda: buf.get_dispatch_layout(idx.to(I32), E), ["topk_idx"])
    ex("layout: topk_idx 1-D", lambda: buf.get_dispatch_layout(idx.flatten(), E), ["topk_idx"])
    ex("layout: num_experts not divisible by ranks", lambda: buf.get_dispatch_layout(idx, E + 1), ["num_experts"])
    ex(
        "layout: allocate_on_comm_stream without previous_event",
        lambda: buf.get_dispatch_layout(idx, E, allocate_on_comm_stream=True),
        ["allocate_on_comm_stream"],
    )
    # dispatch
    ex("dispatch: topk_idx int32", lambda: buf.dispatch(x, topk_idx=idx.to(I32), topk_weights=w, **lay), ["topk_idx"])
    ex(
        "dispatch: topk_weights float64",
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.double(), **lay),
        ["topk_weights"],
    )
    ex(
        "dispatch: non-contiguous x",
        lambda: buf.dispatch(x.t().contiguous().t(), topk_idx=idx, topk_weights=w, **lay),
        ["x", "contiguous"],
    )
    ex("dispatch: x 1-D", lambda: buf.dispatch(x.flatten(), **lay), ["x"])
    ex(
        "dispatch: topk_idx rows != x rows",
        lambda: buf.dispatch(x, topk_idx=idx[:-1].contiguous(), topk_weights=w[:-1].contiguous(), **lay),
        ["topk_idx", "num_tokens"],
    )
    ex(
        "dispatch: topk_weights shape",
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w[:, :-1].contiguous(), **lay),
        ["topk_weights"],
    )
    ex(
        "dispatch: topk_idx without topk_weights",
        lambda: buf.dispatch(x, topk_idx=idx, **lay),
        ["topk_weights", "topk_idx"],
    )
    ex(
        "dispatch: is_token_in_rank shape",
        lambda: buf.dispatch(x, **dict(lay, is_token_in_rank=torch.zeros(n, world + 1, dtype=torch.bool))),
        ["is_token_in_rank"],
    )
    ex(
        "dispatch: num_tokens_per_expert not divisible by ranks",
        lambda: buf.dispatch(x, **dict(lay, num_tokens_per_expert=torch.zeros(E + 1, dtype=I32))),
        ["num_tokens_per_expert", "num_experts"],
    )
    ex(
        "dispatch: non-cached without num_tokens_per_rank",
        lambda: buf.dispatch(x, is_token_in_rank=itir, num_tokens_per_expert=ntpe, num_tokens_per_rdma_rank=rdma),
        ["num_tokens_per_rank"],
    )
    ex(
        "dispatch: row bytes not a multiple of 16 (hidden 100)",
        lambda: buf.dispatch(torch.zeros(n, 100, dtype=BF16), **lay),
        ["hidden", "x"],
    )
    ex(
        "dispatch: FP8 scales with the wrong row count",
        lambda: buf.dispatch((inp["x_fp8"], inp["s_cm"][:-1]), **lay),
        ["scale", "x"],
    )
    ex(
        "dispatch: allocate_on_comm_stream without previous_event",
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, allocate_on_comm_stream=True, **lay),
        ["allocate_on_comm_stream"],
    )
    ex(
        "dispatch: allocate_on_comm_stream + async_finish without previous_event",
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, allocate_on_comm_stream=True, async_finish=True, **lay),
        ["allocate_on_comm_stream", "previous_event"],
    )
    ex(
        "dispatch: num_worst_tokens without top-k",
        lambda: buf.dispatch(x, num_worst_tokens=n * world, **lay),
        ["num_worst_tokens", "topk_idx"],
    )
    ex(
        "dispatch: cached with topk_idx",
        lambda: buf.dispatch(x, handle=handle, topk_idx=idx, topk_weights=w),
        ["topk_idx", "handle", "cached"],
    )
    # combine
    ex("combine: x float32", lambda: buf.combine(recv_x.float(), handle), ["x"])
    ex(
        "combine: x with one row too many",
        lambda: buf.combine(torch.cat([recv_x, recv_x[:1]]), handle),
        ["x", "num_recv", "handle"],
    )
    ex(
        "combine: topk_weights float64",
        lambda: buf.combine(recv_x, handle, topk_weights=recv_w.double()),
        ["topk_weights"],
    )
    ex(
        "combine: bias shape",
        lambda: buf.combine(recv_x, handle, bias=torch.zeros(n + 1, hidden, dtype=BF16)),
        ["bias"],
    )
    ex(
        "combine: allocate_on_comm_stream without previous_event",
        lambda: buf.combine(recv_x, handle, allocate_on_comm_stream=True),
        ["allocate_on_comm_stream"],
    )
    # Out-of-range expert ids (last: an implementation that does not check them may crash).
    bad_hi, bad_lo = idx.clone(), idx.clone()
    bad_hi[3, 1] = E
    bad_lo[5, 0] = -2
    ex("layout: topk_idx >= num_experts", lambda: buf.get_dispatch_layout(bad_hi, E), ["topk_idx"])
    ex("layout: topk_idx < -1", lambda: buf.get_dispatch_layout(bad_lo, E), ["topk_idx"])
    ex(
        "dispatch: topk_idx >= num_experts",
        lambda: buf.dispatch(x, topk_idx=bad_hi, topk_weights=w, **lay),
        ["topk_idx"],
    )
    ex("dispatch: topk_idx < -1", lambda: buf.dispatch(x, topk_idx=bad_lo, topk_weights=w, **lay), ["topk_idx"])

    _ht_good_round(ck, buf, world, rpn, 9, n, hidden, k, E, "after the bad calls")
    buf.destroy()
    return {"records": ex.records, "failures": ck.failures, "checks": ck.num_checks}


def _ll_good_round(ck, buf, world, seed, T, hidden, E, k, tag, n=None):
    rank = dist.get_rank()
    ck.step = f"good LL call {tag}"
    inp = make_ll_inputs(rank, seed, n or T, hidden, k, E, holes=3)
    all_idx = all_gather(inp["idx"])
    lref = LLRef(rank, world, T, hidden, E, all_idx)
    xs = [ref.ll_struct_x(j, int(all_idx[j].size(0)), hidden) for j in range(world)]
    res = buf.low_latency_dispatch(inp["x_struct"], inp["idx"], T, E, use_fp8=False)
    _check_ll_dispatch(ck, res, lref, xs, "struct", False, False, False, False, True)
    sim = _ll_expert_y(res, rank, False, False)
    comb = buf.low_latency_combine(sim, inp["idx"], inp["w"], res[2])
    _check_ll_combine(ck, comb[0], None, inp["x_struct"], None, inp["idx"], inp["w"], False, False)
    return res


def bad_inputs_ll(rank, world, rpn, transport):
    ck = Checker(rank)
    ex = Expect()
    T, hidden, k = 32, 512, 4
    E = 4 * world
    e_l = E // world
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, hidden, world, E)
    buf = portep.Buffer(
        dist.group.WORLD,
        0,
        nbytes,
        low_latency_mode=True,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=30,
        explicitly_destroy=True,
    )
    _ll_good_round(ck, buf, world, 3, T, hidden, E, k, "before the bad calls")
    inp = make_ll_inputs(rank, 4, T, hidden, k, E, holes=3)
    x, idx, w = inp["x_struct"], inp["idx"], inp["w"]
    d = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    handle, sim = d[2], _ll_expert_y(d, rank, False, False)
    lld = buf.low_latency_dispatch
    llc = buf.low_latency_combine

    ex("LL dispatch: x float32", lambda: lld(x.float(), idx, T, E, use_fp8=False), ["x"])
    ex("LL dispatch: topk_idx int32", lambda: lld(x, idx.to(torch.int32), T, E), ["topk_idx"])
    ex("LL dispatch: non-contiguous x", lambda: lld(x.t().contiguous().t(), idx, T, E), ["x", "contiguous"])
    ex("LL dispatch: topk_idx rows != x rows", lambda: lld(x, idx[:-1].contiguous(), T, E), ["topk_idx", "x"])
    big = torch.cat([x, x[:1]])
    ex(
        "LL dispatch: num_tokens > num_max_dispatch_tokens_per_rank",
        lambda: lld(big, torch.cat([idx, idx[:1]]), T, E),
        ["num_max_dispatch_tokens_per_rank", "num_tokens"],
    )
    ex(
        "LL dispatch: hidden not a multiple of 128",
        lambda: lld(torch.zeros(T, hidden - 64, dtype=BF16), idx, T, E),
        ["hidden"],
    )
    ex(
        "LL dispatch: use_ue8m0 without round_scale",
        lambda: lld(x, idx, T, E, use_fp8=True, use_ue8m0=True),
        ["use_ue8m0", "round_scale"],
    )
    ex(
        "LL dispatch: async_finish with return_recv_hook",
        lambda: lld(x, idx, T, E, async_finish=True, return_recv_hook=True),
        ["async_finish", "return_recv_hook"],
    )
    ex("LL dispatch: num_experts not divisible by ranks", lambda: lld(x, idx, T, E + 1), ["num_experts"])
    ex(
        "LL dispatch: cumulative stats int64",
        lambda: lld(x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(e_l, dtype=torch.int64)),
        ["cumulative_local_expert_recv_stats"],
    )
    ex(
        "LL dispatch: cumulative stats shape",
        lambda: lld(x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(e_l + 1, dtype=torch.int32)),
        ["cumulative_local_expert_recv_stats"],
    )
    ex(
        "LL combine: use_logfmt at hidden 512",
        lambda: llc(sim, idx, w, handle, use_logfmt=True),
        ["logfmt", "hidden=512"],
    )
    ex("LL combine: topk_weights float64", lambda: llc(sim, idx, w.double(), handle), ["topk_weights"])
    ex("LL combine: x float32", lambda: llc(sim.float(), idx, w, handle), ["x"])
    ex("LL combine: x shape", lambda: llc(sim[:, :-1].contiguous(), idx, w, handle), ["x"])
    ex("LL combine: topk_idx int32", lambda: llc(sim, idx.to(torch.int32), w, handle), ["topk_idx"])
    ex(
        "LL combine: async_finish with return_recv_hook",
        lambda: llc(sim, idx, w, handle, async_finish=True, return_recv_hook=True),
        ["async_finish", "return_recv_hook"],
    )
    ex(
        "LL combine: out of the wrong shape",
        lambda: llc(sim, idx, w, handle, out=torch.empty(T + 1, hidden, dtype=BF16)),
        ["out"],
    )
    bad_hi, bad_lo = idx.clone(), idx.clone()
    bad_hi[2, 1] = E
    bad_lo[4, 0] = -2
    ex("LL dispatch: topk_idx >= num_experts", lambda: lld(x, bad_hi, T, E), ["topk_idx"])
    ex("LL dispatch: topk_idx < -1", lambda: lld(x, bad_lo, T, E), ["topk_idx"])
    # The pending dispatch's handle still combines correctly after all that.
    ck.step = "combine of the dispatch made before the bad calls"
    comb = llc(sim, idx, w, handle)
    _check_ll_combine(ck, comb[0], None, x, None, idx, w, False, False)
    _ll_good_round(ck, buf, world, 5, T, hidden, E, k, "after the bad calls")
    buf.destroy()
    return {"records": ex.records, "failures": ck.failures, "checks": ck.num_checks}


def buffer_too_small(rank, world, transport):
    """Tiny buffers: a dispatch that cannot fit raises ValueError mentioning bytes; nothing hangs or breaks."""
    ck = Checker(rank)
    ex = Expect()
    notes = []
    E, k = 4 * world, 2
    # HT: 1 MiB of NVL buffer (a valid size: the constructor must take it, else the main case below never runs),
    # then 2048 tokens x 2048 hidden (8 MiB per rank) sent to every rank.
    buf = portep.Buffer(
        dist.group.WORLD,
        1 * MiB,
        0,
        low_latency_mode=False,
        num_ranks_per_node=world,
        transport=transport,
        timeout_s=30,
        explicitly_destroy=True,
    )
    n, hidden = 2048, 2048
    x = torch.randn(n, hidden).to(BF16)
    idx = torch.tensor([[r * (E // world) for r in range(k)]] * n, dtype=topk_idx_t())
    ntpr, rdma, ntpe, itir = ref.layout_ref(idx, E, world, world)
    ex(
        "HT dispatch larger than num_nvl_bytes",
        lambda: buf.dispatch(
            x,
            num_tokens_per_rank=ntpr,
            num_tokens_per_rdma_rank=rdma,
            is_token_in_rank=itir,
            num_tokens_per_expert=ntpe,
        ),
        ["bytes"],
        allowed=(ValueError,),
    )
    # A small dispatch on the same buffer either works (checked) or is refused the same clean way.
    try:
        _ht_good_round(ck, buf, world, world, 3, 8, 256, 2, E, "small dispatch on the tiny buffer")
    except ValueError as exc:
        notes.append(f"small dispatch refused on the 1 MiB buffer: {exc}")
        ck.true("bytes" in str(exc), f"small dispatch refusal does not mention bytes: {exc}")
    buf.destroy()
    buf = portep.Buffer(
        dist.group.WORLD,
        HT_NVL_BYTES,
        0,
        low_latency_mode=False,
        num_ranks_per_node=world,
        transport=transport,
        timeout_s=30,
        explicitly_destroy=True,
    )
    _ht_good_round(ck, buf, world, world, 4, 64, 256, 4, E, "new buffer of the right size")
    buf.destroy()

    # LL: sized for T=16, then called with num_max_dispatch_tokens_per_rank=64.
    T, hidden = 16, 512
    buf = portep.Buffer(
        dist.group.WORLD,
        0,
        portep.Buffer.get_low_latency_rdma_size_hint(T, hidden, world, E),
        low_latency_mode=True,
        num_ranks_per_node=world,
        transport=transport,
        timeout_s=30,
        explicitly_destroy=True,
    )
    inp = make_ll_inputs(rank, 2, 64, hidden, k, E, holes=0)
    ex(
        "LL dispatch with num_max_dispatch_tokens_per_rank above the sizing",
        lambda: buf.low_latency_dispatch(inp["x_struct"], inp["idx"], 64, E, use_fp8=False),
        ["bytes"],
        allowed=(ValueError,),
    )
    _ll_good_round(ck, buf, world, 6, T, hidden, E, k, "LL after the refused call")
    buf.destroy()

    # Constructor arguments (last: refused collectively, so every rank raises).
    ex(
        "Buffer: num_nvl_bytes not a multiple of 128",
        lambda: portep.Buffer(
            dist.group.WORLD,
            1000,
            0,
            num_ranks_per_node=world,
            transport=transport,
            timeout_s=30,
            explicitly_destroy=True,
        ),
        ["num_nvl_bytes"],
    )
    ex(
        "Buffer: neither group nor comm (DeepEP: ValueError)",
        lambda: portep.Buffer(
            None, 1 * MiB, 0, num_ranks_per_node=world, transport=transport, timeout_s=30, explicitly_destroy=True
        ),
        ["group"],
    )
    ex(
        "Buffer: num_ranks_per_node does not divide the group",
        lambda: portep.Buffer(
            dist.group.WORLD,
            1 * MiB,
            0,
            num_ranks_per_node=world + 1,
            transport=transport,
            timeout_s=30,
            explicitly_destroy=True,
        ),
        ["num_ranks_per_node"],
    )
    return {"records": ex.records, "failures": ck.failures, "checks": ck.num_checks, "notes": notes}


def case_id(case):
    """pytest id of a (world, ranks_per_node, transport, ...) case."""
    return f"{case[0]}ranks-{case[1]}pernode-{case[2]}"


def assert_clean(out, min_checks):
    """Every rank's collected check failures are empty and each rank made at least min_checks checks."""
    failures = [f for r in sorted(out) for f in out[r]["failures"]]
    assert not failures, f"{len(failures)} failed checks:\n" + "\n".join(failures)
    for r, res in out.items():
        assert res["checks"] >= min_checks, f"rank {r} made only {res['checks']} checks"
