"""Per-rank bodies of test_client_patterns.py: the `deep_ep` drop-in driven the way four DeepEP V1 clients drive it
(vLLM, LMDeploy/DLBlas, xtuner, SGLang), written from their call patterns (not copied), on portep's host backend
(CPU tensors, gloo).

Every body makes the client's calls (their argument spellings, keywords and the attributes they read) and checks at
least one low-latency or normal-mode round trip against the independent references that deepep_workers.py and
deepep_reference.py hold: received rows, counts and handles exactly, combined rows within BF16 rounding of a float64
reference (ref.combine_mismatch). Like deepep_workers, the checks are collected, not raised, and every rank makes the
same sequence of Buffer calls whatever they find.
"""

import weakref

import torch
import torch.distributed as dist

import deep_ep
import deepep_reference as ref
import deepep_workers as w
from deep_ep import Buffer, Config, EventOverlap
from deep_ep_cpp import EventHandle

MiB = 1 << 20
BF16 = torch.bfloat16
T, H, K = 32, 512, 4  # LL tokens per rank (num_max_dispatch_tokens_per_rank), hidden, top-k
HT_TOKENS = 64  # normal-mode tokens per rank
HT_NVL_BYTES = 64 * MiB


def num_experts(world):
    return 4 * world


def _result(ck):
    return {"failures": ck.failures, "checks": ck.num_checks}


# ---------------------------------------------------------------------------------------------------------------
# Shared: one round's inputs and references, and its checks (as robust_workers' LLRound and HTRound).


class LLCase:
    """One LL round's inputs (deepep_workers.make_ll_inputs, structured rows) and references, every rank's top-k
    gathered before any Buffer call."""

    def __init__(self, world, seed):
        self.rank, self.E = dist.get_rank(), num_experts(world)
        inp = w.make_ll_inputs(self.rank, seed, T, H, K, self.E, holes=3)
        self.x, self.idx, self.w = inp["x_struct"], inp["idx"], inp["w"]
        self.lref = w.LLRef(self.rank, world, T, H, self.E, w.all_gather(self.idx))
        self.xs = [ref.ll_struct_x(j, T, H) for j in range(world)]

    def check_dispatch(self, ck, res, hook, fp8=False):
        """res: low_latency_dispatch's 5-tuple (its hook, if any, already called)."""
        w._check_ll_dispatch(ck, res, self.lref, self.xs, "struct", hook, fp8, False, False, True)

    def expert_out(self, res, fp8=False):
        """The experts' outputs for the received rows (ref.ll_expert_outputs via deepep_workers)."""
        return w._ll_expert_y(res, self.rank, fp8, False)

    def check_combine(self, ck, combined, out=None, fp8=False):
        x_q = ref.ll_fp8_round_trip(self.x, False) if fp8 else None
        w._check_ll_combine(ck, combined, out, self.x, x_q, self.idx, self.w, fp8, False)


class HTCase:
    """One normal-mode round's inputs (deepep_workers.make_ht_inputs) and references (one node)."""

    def __init__(self, world, seed, expert_alignment=1):
        self.rank, self.world, self.E = dist.get_rank(), world, num_experts(world)
        inp = w.make_ht_inputs(self.rank, seed, HT_TOKENS, H, K, self.E)
        self.x, self.idx, self.w = inp["x"], inp["idx"], inp["w"]
        self.ntpr, self.rdma, self.ntpe, self.itir = ref.layout_ref(self.idx, self.E, world, world)
        g = w.all_gather({"idx": self.idx, "w": self.w, "x": self.x})
        all_idx, all_w = [v["idx"] for v in g], [v["w"] for v in g]
        self.rd = ref.ht_dispatch_ref(self.rank, world, self.E, all_idx, all_w, expert_alignment=expert_alignment)
        self.unaligned = ref.ht_dispatch_ref(self.rank, world, self.E, all_idx, all_w)["per_expert_list"]
        self.exp_x = ref.gather_rows([v["x"] for v in g], self.rd["src_rank"], self.rd["src_token"])

    def layout_kwargs(self):
        return dict(
            num_tokens_per_rank=self.ntpr,
            num_tokens_per_rdma_rank=self.rdma,
            is_token_in_rank=self.itir,
            num_tokens_per_expert=self.ntpe,
        )

    def check_layout(self, ck, res):
        """get_dispatch_layout's 5-tuple against ref.layout_ref."""
        if ck.true(isinstance(res, tuple) and len(res) == 5, "get_dispatch_layout did not return a 5-tuple"):
            ck.equal("num_tokens_per_rank", res[0], self.ntpr)
            ck.true(res[1] is None, "num_tokens_per_rdma_rank must be None on one node")
            ck.equal("num_tokens_per_expert", res[2], self.ntpe)
            ck.equal("is_token_in_rank", res[3], self.itir)

    def check_dispatch(self, ck, out):
        """dispatch's 6-tuple (with top-k): rows, top-k, per-expert list and handle, exactly."""
        return w._check_ht_dispatch(ck, out, self.rd, self.exp_x, True, 1, self.world, self.rank, self.itir, "rand")

    def expert_out(self, recv_x):
        return ref.ht_expert_outputs(recv_x, self.rank, self.rd["src_rank"])

    def weights_ref(self):
        return ref.ht_combine_weights_ref(self.idx, self.w, self.itir, self.E // self.world)

    def check_combine(self, ck, out, with_topk):
        """combine's 3-tuple against the float64 sum of the receiving ranks' expert outputs."""
        w_ref = self.weights_ref() if with_topk else None
        w._check_ht_combine(ck, out, self.x, self.itir, None, with_topk, w_ref)


# ---------------------------------------------------------------------------------------------------------------
# vLLM: a WeakValueDictionary of Buffers keyed by the constructor's arguments, all of them passed by keyword.

_VLLM_BUFFERS = weakref.WeakValueDictionary()


def _vllm_buffer(**kwargs):
    """The cached Buffer of these constructor arguments, made on first use (vLLM's all2all handle cache)."""
    key = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
    buf = _VLLM_BUFFERS.get(key)
    if buf is None:
        buf = deep_ep.Buffer(**kwargs)
        _VLLM_BUFFERS[key] = buf
    return buf


def _vllm_ll_round(ck, buf, case):
    """LL dispatch with a receive hook, then a combine with a hook into a caller's out tensor."""
    res = buf.low_latency_dispatch(
        case.x, case.idx, T, case.E, use_fp8=False, async_finish=False, return_recv_hook=True
    )
    if ck.true(callable(res[4]), "dispatch: return_recv_hook=True gave no callable hook"):
        res[4]()
    case.check_dispatch(ck, res, True)
    out = torch.full((T, H), 7.0, dtype=BF16)
    combined, _, hook = buf.low_latency_combine(
        case.expert_out(res), case.idx, case.w, res[2], zero_copy=False, return_recv_hook=True, out=out
    )
    if ck.true(callable(hook), "combine: return_recv_hook=True gave no callable hook"):
        hook()
    ck.true(combined.data_ptr() == out.data_ptr(), "combine with out= did not return out itself")
    case.check_combine(ck, combined, out)


def _vllm_ht_round(ck, buf, case, world):
    """Normal mode, every argument by keyword, configs from get_dispatch_config / get_combine_config."""
    layout = buf.get_dispatch_layout(topk_idx=case.idx, num_experts=case.E)
    case.check_layout(ck, layout)
    ntpr, rdma, ntpe, itir, _ = layout
    out = buf.dispatch(
        x=case.x,
        handle=None,
        num_tokens_per_rank=ntpr,
        num_tokens_per_rdma_rank=rdma,
        is_token_in_rank=itir,
        num_tokens_per_expert=ntpe,
        topk_idx=case.idx,
        topk_weights=case.w,
        expert_alignment=1,
        config=Buffer.get_dispatch_config(world),
    )
    if case.check_dispatch(ck, out):
        c = buf.combine(
            x=case.expert_out(out[0]), handle=out[4], topk_weights=None, config=Buffer.get_combine_config(world)
        )
        case.check_combine(ck, c, False)


def vllm_body(rank, world, seed):
    """vLLM's DeepEP LL and normal-mode all2all managers: one cached LL-mode Buffer serving both modes (a
    clean_low_latency_buffer at each switch, the host backend's rule), a shrink-mode Buffer's mask calls."""
    ck = w.Checker(rank)
    E = num_experts(world)
    group = dist.group.WORLD
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=T, hidden=H, num_ranks=world, num_experts=E
    )
    kwargs = dict(
        group=group,
        num_nvl_bytes=HT_NVL_BYTES,
        num_rdma_bytes=rdma,
        low_latency_mode=True,
        num_qps_per_rank=E // world,
        explicitly_destroy=True,
        allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False,
    )
    ck.step = "buffer cache"
    buf = _vllm_buffer(**kwargs)
    ck.true(_vllm_buffer(**kwargs) is buf, "the handle cache did not give back the same Buffer")
    local = buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)
    ck.tensor("get_local_buffer_tensor(int8, rdma)", local, torch.int8, (buf.num_rdma_bytes,))  # DeepEP's length

    ck.step = "LL round 1"
    _vllm_ll_round(ck, buf, LLCase(world, seed))
    buf.clean_low_latency_buffer(T, H, E)
    ck.step = "normal-mode round"
    _vllm_ht_round(ck, buf, HTCase(world, seed + 1), world)
    buf.clean_low_latency_buffer(T, H, E)
    ck.step = "LL round 2 (after the normal mode)"
    _vllm_ll_round(ck, buf, LLCase(world, seed + 2))

    ck.step = "shrink-mode Buffer"
    shrink = _vllm_buffer(**dict(kwargs, num_nvl_bytes=0, enable_shrink=True))
    ck.true(shrink is not buf, "a Buffer of other arguments came back from the cache")
    mask = torch.full((world,), 5, dtype=torch.int32)
    shrink.low_latency_query_mask_buffer(mask)
    ck.equal("mask status (no rank masked)", mask, torch.zeros(world, dtype=torch.int32))
    shrink.low_latency_clean_mask_buffer()
    _vllm_ll_round(ck, shrink, LLCase(world, seed + 3))
    shrink.destroy()
    buf.destroy()
    return _result(ck)


# ---------------------------------------------------------------------------------------------------------------
# LMDeploy / DLBlas


def _dlblas_buffer(group, nvl, rdma, qps):
    """The constructor with allow_mnnvl / explicitly_destroy, and without them on TypeError (older DeepEP).
    Returns (buffer, whether the first form was taken)."""
    try:
        buf = Buffer(
            group,
            num_nvl_bytes=nvl,
            num_rdma_bytes=rdma,
            low_latency_mode=True,
            num_qps_per_rank=qps,
            allow_mnnvl=False,
            explicitly_destroy=True,
        )
        return buf, True
    except TypeError:
        return Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True, num_qps_per_rank=qps), False


def lmdeploy_body(rank, world, seed):
    """LMDeploy's DLBlas DeepEP wrapper: set_num_sms at import, the TypeError-fallback constructor, the attributes
    it reads, capture(), an FP8 LL round unpacked as (fp8, scales), a BF16 LL round with receive hooks."""
    ck = w.Checker(rank)
    Buffer.set_num_sms(24)
    ck.true(Buffer.num_sms == 24, f"Buffer.num_sms is {Buffer.num_sms} after set_num_sms(24)")
    E = num_experts(world)
    group = dist.group.WORLD
    rdma = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf, first = _dlblas_buffer(group, 0, rdma, E // world)
    ck.step = "construction"
    ck.true(first, "the constructor refused allow_mnnvl / explicitly_destroy (the TypeError fallback ran)")
    ck.true(buf.group is group, "buffer.group is not the group it was made with")
    ck.true(buf.num_nvl_bytes == 0 and buf.num_rdma_bytes == rdma, "num_nvl_bytes / num_rdma_bytes differ")
    ck.true(buf.low_latency_mode is True, f"low_latency_mode is {buf.low_latency_mode!r}")
    ck.true(buf.group_size == world, f"group_size is {buf.group_size}")
    buf.set_num_sms(24)
    ck.true(isinstance(buf.capture(), EventOverlap), "capture() did not return an EventOverlap")

    ck.step = "FP8 LL round"
    case = LLCase(world, seed)
    res = buf.low_latency_dispatch(case.x, case.idx, T, E, use_fp8=True, async_finish=False, return_recv_hook=False)
    fp8, scales = res[0]
    ck.tensor("fp8 payload", fp8, torch.float8_e4m3fn, (E // world, world * T, H))
    ck.tensor("scales", scales, torch.float32, (E // world, world * T, H // 128))
    case.check_dispatch(ck, res, False, fp8=True)
    combined, _, _ = buf.low_latency_combine(case.expert_out(res, fp8=True), case.idx, case.w, res[2])
    case.check_combine(ck, combined, fp8=True)

    ck.step = "BF16 LL round with receive hooks"
    case = LLCase(world, seed + 1)
    res = buf.low_latency_dispatch(case.x, case.idx, T, E, use_fp8=False, async_finish=False, return_recv_hook=True)
    res[4]()
    case.check_dispatch(ck, res, True)
    combined, _, hook = buf.low_latency_combine(
        case.expert_out(res), case.idx, case.w, res[2], async_finish=False, return_recv_hook=True
    )
    hook()
    case.check_combine(ck, combined)
    if first:
        buf.destroy()
    return _result(ck)


# ---------------------------------------------------------------------------------------------------------------
# xtuner: the normal-mode handle saved for backward through ctx.save_for_backward.


class _XtunerDispatch(torch.autograd.Function):
    """Forward: layout + dispatch, the handle saved with save_for_backward; backward: combine of the gradients with
    the handle from ctx.saved_tensors. `sink` (a list) gets the dispatch's raw result for the checks."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, n_experts, buffer, sink):
        previous_event = EventOverlap(EventHandle())
        ntpr, rdma, ntpe, itir, event = buffer.get_dispatch_layout(
            topk_idx, n_experts, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True
        )
        out = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=ntpr,
            num_tokens_per_rdma_rank=rdma,
            is_token_in_rank=itir,
            num_tokens_per_expert=ntpe,
            previous_event=event,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        out[5].current_stream_wait()
        recv_x, recv_idx, recv_w, _, handle, _ = out
        sink.append((out, all(torch.is_tensor(t) for t in handle)))
        ctx.buffer = buffer
        ctx.save_for_backward(*handle)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_idx, grad_recv_w):
        handle = tuple(ctx.saved_tensors)
        combined, combined_w, event = ctx.buffer.combine(
            grad_recv_x.contiguous(),
            handle,
            topk_weights=grad_recv_w.contiguous(),
            previous_event=EventOverlap(EventHandle()),
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        event.current_stream_wait()
        return combined, None, combined_w, None, None, None


def xtuner_body(rank, world, seed):
    """xtuner's DeepEP dispatcher: normal mode inside an autograd.Function. Forward rows checked exactly; backward
    (gradient of recv_x: the reference experts' outputs; of recv_topk_weights: the received weights themselves)
    gives x.grad and topk_weights.grad, checked as a combine."""
    ck = w.Checker(rank)
    Buffer.set_num_sms(24)
    buf = Buffer(dist.group.WORLD, HT_NVL_BYTES, 0, explicitly_destroy=True)
    case = HTCase(world, seed)
    x = case.x.clone().requires_grad_(True)
    topk_w = case.w.clone().requires_grad_(True)
    sink = []
    ck.step = "forward"
    recv_x, recv_idx, recv_w = _XtunerDispatch.apply(x, case.idx, topk_w, case.E, buf, sink)
    raw, all_tensors = sink[0]
    ck.true(all_tensors, f"the handle holds non-tensors: {[type(t).__name__ for t in raw[4]]}")
    ok = case.check_dispatch(ck, raw)
    ck.equal("Function output recv_x", recv_x.detach(), case.exp_x)
    ck.true(recv_x.requires_grad and not recv_idx.requires_grad, "recv_x / recv_topk_idx requires_grad flags")
    ck.step = "backward (combine through ctx.saved_tensors)"
    if ok:
        torch.autograd.backward([recv_x, recv_w], [case.expert_out(recv_x.detach()), recv_w.detach().clone()])
        case.check_combine(ck, (x.grad, topk_w.grad, None), True)
    buf.destroy()
    return _result(ck)


# ---------------------------------------------------------------------------------------------------------------
# SGLang (V1 API)

# As SGLang's DeepEP config file: one Config's fields per normal-mode op.
SGLANG_CONFIG_JSON = {
    "normal_dispatch": {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 16,
        "num_max_nvl_chunked_recv_tokens": 256,
        "num_max_rdma_chunked_send_tokens": 6,
        "num_max_rdma_chunked_recv_tokens": 128,
    },
    "normal_combine": {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 6,
        "num_max_nvl_chunked_recv_tokens": 256,
        "num_max_rdma_chunked_send_tokens": 6,
        "num_max_rdma_chunked_recv_tokens": 128,
    },
}


def _sglang_ht_round(ck, buf, case, dispatch_config, combine_config):
    """Normal mode with Buffer.capture() events, expert_alignment=128 and the JSON configs."""
    previous_event = Buffer.capture()
    ntpr, rdma, ntpe, itir, event = buf.get_dispatch_layout(
        case.idx, case.E, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True
    )
    case.check_layout(ck, (ntpr, rdma, ntpe, itir, event))
    out = buf.dispatch(
        case.x,
        topk_idx=case.idx,
        topk_weights=case.w,
        num_tokens_per_rank=ntpr,
        num_tokens_per_rdma_rank=rdma,
        is_token_in_rank=itir,
        num_tokens_per_expert=ntpe,
        previous_event=event,
        async_finish=True,
        allocate_on_comm_stream=True,
        expert_alignment=128,
        config=dispatch_config,
    )
    out[5].current_stream_wait()
    if not case.check_dispatch(ck, out):
        return
    lst = out[3]
    ck.true(all(c % 128 == 0 for c in lst), f"num_recv_tokens_per_expert_list {lst} has counts not a multiple of 128")
    aligned = [ref.align_up(c, 128) for c in case.unaligned]
    ck.true(lst == aligned, f"num_recv_tokens_per_expert_list {lst} != the aligned counts {aligned}")
    c = buf.combine(
        case.expert_out(out[0]),
        out[4],
        topk_weights=out[2],
        config=combine_config,
        previous_event=Buffer.capture(),
        async_finish=True,
        allocate_on_comm_stream=True,
    )
    c[2].current_stream_wait()
    case.check_combine(ck, c, True)


def _sglang_ll_dispatch(buf, case, **extra):
    return buf.low_latency_dispatch(
        case.x,
        case.idx,
        T,
        case.E,
        use_fp8=False,
        round_scale=False,
        use_ue8m0=False,
        async_finish=True,
        return_recv_hook=False,
        **extra,
    )


def _sglang_ll_round(ck, buf, case):
    """LL dispatch tried first with use_nvfp4 (Blackwell builds), again without it on TypeError; combine by
    keyword."""
    try:
        res = _sglang_ll_dispatch(buf, case, use_nvfp4=True)
        ck.true(False, "low_latency_dispatch took use_nvfp4")
    except TypeError as e:
        ck.true("use_nvfp4" in str(e), f"the TypeError does not name use_nvfp4: {e}")
        res = _sglang_ll_dispatch(buf, case)
    res[3].current_stream_wait()
    case.check_dispatch(ck, res, False)
    combined, _, hook = buf.low_latency_combine(
        x=case.expert_out(res),
        topk_idx=case.idx,
        topk_weights=case.w,
        handle=res[2],
        async_finish=False,
        return_recv_hook=False,
    )
    ck.true(hook is None, "combine: return_recv_hook=False but a hook came back")
    case.check_combine(ck, combined)


def sglang_body(rank, world, seed):
    """SGLang's DeepEP dispatcher (V1): Config(**json), the class's capture() and num_sms, normal mode with
    expert_alignment=128, clean_low_latency_buffer, async LL dispatch with current_stream_wait, keyword combine."""
    ck = w.Checker(rank)
    E = num_experts(world)
    Buffer.set_num_sms(SGLANG_CONFIG_JSON["normal_dispatch"]["num_sms"])
    dispatch_config = Config(**SGLANG_CONFIG_JSON["normal_dispatch"])
    combine_config = Config(**SGLANG_CONFIG_JSON["normal_combine"])
    ck.step = "setup"
    ck.true(Buffer.num_sms == 24, f"class attribute Buffer.num_sms is {Buffer.num_sms}")
    ck.true(isinstance(Buffer.capture(), EventOverlap), "Buffer.capture() did not return an EventOverlap")
    rdma = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = Buffer(
        dist.group.WORLD,
        HT_NVL_BYTES,
        rdma,
        low_latency_mode=True,
        num_qps_per_rank=E // world,
        explicitly_destroy=True,
    )
    ck.true(buf.low_latency_mode and buf.group_size == world, "low_latency_mode / group_size")

    ck.step = "normal mode (expert_alignment=128)"
    _sglang_ht_round(ck, buf, HTCase(world, seed, expert_alignment=128), dispatch_config, combine_config)
    buf.clean_low_latency_buffer(T, H, E)
    ck.step = "LL"
    _sglang_ll_round(ck, buf, LLCase(world, seed + 1))
    buf.clean_low_latency_buffer(T, H, E)
    ck.step = "normal mode after LL"
    _sglang_ht_round(ck, buf, HTCase(world, seed + 2, expert_alignment=128), dispatch_config, combine_config)
    buf.destroy()
    return _result(ck)
