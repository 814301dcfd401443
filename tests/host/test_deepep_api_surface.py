"""The DeepEP-compatible surface that needs no engine: Config and its hints, the tuned config tables, the LL size
hint, EventOverlap, topk_idx_t, the `deep_ep` module, constructor refusals, and the argument checks of
validation.py called directly. Expected numbers come from shared/reference/deepep-api.md §1."""

import pytest
import torch

import deep_ep
import portep
from portep import validation as v
from portep.deepep_config import check_internode_config
from portep.event import HostEvent

Buffer, Config, EventOverlap = portep.Buffer, portep.Config, portep.EventOverlap
MB = 1e6


@pytest.fixture
def restore_num_sms():
    saved = Buffer.num_sms
    yield
    Buffer.num_sms = saved


# ---- module surface ----
def test_deep_ep_module_is_portep():
    from deep_ep import Buffer as B, Config as C, EventOverlap as E

    assert (B, C, E) == (portep.Buffer, portep.Config, portep.EventOverlap)
    assert deep_ep.topk_idx_t is torch.int64 and portep.topk_idx_t is torch.int64
    assert torch.zeros(2, 3).to(deep_ep.topk_idx_t).dtype == torch.int64
    assert Buffer.num_sms == 20


def test_is_sm90_compiled_reports_the_cuda_build():
    assert Buffer.is_sm90_compiled() is bool(portep.native.build_info()["cuda_built"])


# ---- Config ----
def test_config_defaults_and_rdma_rounding():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (20, 6, 256)
    assert c.num_max_rdma_chunked_send_tokens == 6
    assert c.num_max_rdma_chunked_recv_tokens == 258  # 256 rounded up to a multiple of 6, as DeepEP does
    assert Config(24, 8, 256).num_sms == 24


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((-2,), ValueError, "num_sms=-2 must be >= 0"),
        ((20, 0), ValueError, "num_max_nvl_chunked_send_tokens=0 must be >= 1"),
        ((20, 8, 8), ValueError, "num_max_nvl_chunked_send_tokens=8 must be < num_max_nvl_chunked_recv_tokens=8"),
        ((20, 6, 256, 0), ValueError, "num_max_rdma_chunked_send_tokens=0 must be >= 1"),
        (
            (20, 6, 256, 128, 100),
            ValueError,
            "num_max_rdma_chunked_send_tokens=128 must be <= half of num_max_rdma_chunked_recv_tokens=128",
        ),
        ((20.0,), TypeError, "num_sms must be an int"),
        ((True,), TypeError, "num_sms must be an int"),
    ],
)
def test_config_constraints_name_the_field(args, exc, match):
    with pytest.raises(exc, match=match):
        Config(*args)


def test_nvl_hint_matches_deepep():
    # EP8, 24 SMs, BF16 hidden 7168 -> 402.9 MB
    hint = Config(24, 6, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint == 402_851_712 and round(hint / MB, 1) == 402.9
    assert hint % 128 == 0


@pytest.mark.parametrize("num_ranks", [16, 32, 64, 128, 160, 256, 1024])
def test_nvl_hint_across_nodes_covers_portep_normal_mode(num_ranks):
    """Across nodes the NVL hint is DeepEP's, or what the CUDA normal mode needs where that is more (DeepEP's fell
    short at 16 to 64 ranks: forwarding carries FP32 partial rows in combine): a Buffer sized by the hints runs."""
    from portep import native
    from portep.deepep_config import normal_mode_bytes

    for getter in (Buffer.get_dispatch_config, Buffer.get_combine_config):
        cfg = getter(num_ranks)
        hint = cfg.get_nvl_buffer_size_hint(7168 * 2, num_ranks)
        assert hint >= cfg._deepep_nvl_hint(7168 * 2, num_ranks) and hint % 128 == 0
        if not native.build_info()["gpu_built"]:
            assert normal_mode_bytes(cfg, 7168 * 2, num_ranks) == 0
            continue
        layout = native.HTLayout(
            num_ranks=num_ranks, ranks_per_node=8, proxy=True, ctrl_off=1 << 60, area_off=0, area_bytes=hint // 16 * 16
        )
        C = cfg.num_sms // 2
        for row in (native.HTLayout.dispatch_row_bytes(7168 * 2, 56, 8), layout.combine_row_bytes(7168, 8)):
            assert layout.rows_per_ring(row, C) >= native.HT_MIN_RING_ROWS, (row, hint)


def test_rdma_hint_matches_deepep():
    # EP16, 24 SMs, rdma (send 20, recv 288 -> 300) -> 236.3 MB; 0 within one node
    hint = Config(24, 6, 256, 20, 288).get_rdma_buffer_size_hint(7168 * 2, 16)
    assert hint == 236_278_656 and round(hint / MB, 1) == 236.3
    assert Config(24).get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert Config(24).get_rdma_buffer_size_hint(7168 * 2, 2) == 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: Config(24).get_nvl_buffer_size_hint(14336, 12), "num_ranks=12 must be < 8 or a multiple of 8"),
        (lambda: Config(23, 6, 256).get_nvl_buffer_size_hint(14336, 16), "num_sms=23 must be even for num_ranks=16"),
        (lambda: Config(23, 6, 256).get_rdma_buffer_size_hint(14336, 16), "num_sms=23 must be even"),
        (lambda: Config(24).get_rdma_buffer_size_hint(14336, 20), "num_ranks=20 must be < 8 or a multiple of 8"),
        (lambda: Config(24).get_nvl_buffer_size_hint(-1, 8), "hidden_bytes=-1 must be >= 0"),
    ],
)
def test_hints_refuse_what_deepep_refuses(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- tuned configs ----
DISPATCH = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
COMBINE = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


@pytest.mark.parametrize("num_ranks", sorted(DISPATCH))
def test_tuned_configs_match_deepep_table(num_ranks):
    assert Buffer.get_dispatch_config(num_ranks) == Config(Buffer.num_sms, *DISPATCH[num_ranks])
    assert Buffer.get_combine_config(num_ranks) == Config(Buffer.num_sms, *COMBINE[num_ranks])


@pytest.mark.parametrize("num_ranks", [1, 3, 12, 164, 260])
def test_untuned_sizes_are_refused_with_the_supported_list(num_ranks):
    for getter in (Buffer.get_dispatch_config, Buffer.get_combine_config):
        with pytest.raises(
            ValueError, match=f"num_ranks={num_ranks}; supported: 2, 4, 8, 16, .*, 160, and multiples of 8 above 160"
        ):
            getter(num_ranks)


@pytest.mark.parametrize("num_ranks", [168, 256, 512, 1024])
def test_whole_nodes_beyond_deepeps_table_take_its_largest_entry_checked_for_their_nodes(num_ranks):
    nodes = num_ranks // 8
    for getter, table, what in (
        (Buffer.get_dispatch_config, DISPATCH, "dispatch"),
        (Buffer.get_combine_config, COMBINE, "combine"),
    ):
        cfg, largest = getter(num_ranks), Config(Buffer.num_sms, *table[160])
        send, recv, rdma_send = table[160][:3]
        assert (
            cfg.num_sms,
            cfg.num_max_nvl_chunked_send_tokens,
            cfg.num_max_rdma_chunked_send_tokens,
            cfg.num_max_rdma_chunked_recv_tokens,
        ) == (largest.num_sms, send, rdma_send, largest.num_max_rdma_chunked_recv_tokens)
        nvl_recv = cfg.num_max_nvl_chunked_recv_tokens
        assert nvl_recv >= recv and nvl_recv % nodes == 0 and nvl_recv // nodes > max(send, rdma_send)
        assert check_internode_config(cfg, nodes, 8, what) is cfg  # DeepEP's own checks pass
    hint = Buffer.get_dispatch_config(num_ranks).get_rdma_buffer_size_hint(7168 * 2, num_ranks)
    assert hint > Buffer.get_dispatch_config(160).get_rdma_buffer_size_hint(7168 * 2, 160) > 0


@pytest.mark.parametrize("num_ranks", sorted(r for r in DISPATCH if r > 8))
def test_deepeps_tuned_configs_pass_its_internode_checks(num_ranks):
    check_internode_config(Buffer.get_dispatch_config(num_ranks), num_ranks // 8, 8, "dispatch")
    check_internode_config(Buffer.get_combine_config(num_ranks), num_ranks // 8, 8, "combine")


@pytest.mark.parametrize(
    "cfg,nodes,what,match",
    [
        (
            Config(24, 8, 513, 16, 128),
            2,
            "combine",
            r"num_max_nvl_chunked_recv_tokens=513 must be a multiple of the "
            r"number of nodes 2",
        ),
        (
            Config(24, 40, 64, 6, 128),
            2,
            "combine",
            r"num_max_nvl_chunked_send_tokens=40 must be <= "
            r"num_max_nvl_chunked_recv_tokens / nodes = 64 / 2 = 32",
        ),
        (
            Config(24, 8, 64, 32, 128),
            2,
            "dispatch",
            r"64 / 2 = 32 must be > config.num_max_rdma_chunked_send_tokens=32",
        ),
        (
            Config(24, 40, 256, 6, 128),
            8,
            "dispatch",
            r"256 / 8 = 32 must be > config.num_max_nvl_chunked_send_tokens=40",
        ),
    ],
)
def test_internode_config_checks_name_the_field(cfg, nodes, what, match):
    with pytest.raises(ValueError, match=match):
        check_internode_config(cfg, nodes, 8, what)
    assert check_internode_config(cfg, 1, 8, what) is cfg  # one node: DeepEP's intranode path has no such rule
    assert check_internode_config(cfg, nodes, 4, what) is cfg  # simulated nodes of 4: a shape DeepEP never runs


def test_set_num_sms_feeds_the_tuned_configs(restore_num_sms):
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    assert Buffer.get_dispatch_config(8).num_sms == 24 and Buffer.get_combine_config(8).num_sms == 24


@pytest.mark.parametrize("value,exc", [(21, ValueError), (0, ValueError), (-2, ValueError), (2.0, TypeError)])
def test_set_num_sms_refuses_odd_or_non_positive(restore_num_sms, value, exc):
    with pytest.raises(exc, match="new_num_sms"):
        Buffer.set_num_sms(value)
    assert Buffer.num_sms == 20


# ---- low-latency size hint ----
@pytest.mark.parametrize(
    "tokens,experts,exact,mb",
    [
        (128, 288, 2_146_961_792, 2146.96),
        (128, 256, 1_908_410_496, 1908.41),
        (256, 256, 3_816_818_816, 3816.82),
    ],
)
def test_low_latency_size_hint_matches_deepep(tokens, experts, exact, mb):
    hint = Buffer.get_low_latency_rdma_size_hint(tokens, 7168, 8, experts)
    assert hint == exact and round(hint / MB, 2) == mb
    assert Buffer.get_low_latency_rdma_size_hint(tokens, 7168, 64, experts) == hint  # num_ranks is unused


def test_low_latency_size_hint_checks_arguments():
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=0 must be >= 1"):
        Buffer.get_low_latency_rdma_size_hint(0, 7168, 8, 288)
    with pytest.raises(TypeError, match="hidden must be an int"):
        Buffer.get_low_latency_rdma_size_hint(128, 7168.0, 8, 288)


# ---- EventOverlap ----
def test_event_overlap_without_event():
    e = EventOverlap()
    assert e.event is None and e.extra_tensors is None
    with pytest.raises(RuntimeError, match="needs an event"):
        e.current_stream_wait()
    with e as inside:  # exiting without an event does not wait
        assert inside is e


def test_event_overlap_with_host_event_keeps_tensors():
    t = torch.ones(3)
    e = EventOverlap(HostEvent(), (t,))
    assert e.extra_tensors[0] is t and e.event.query()
    e.current_stream_wait()
    with e():
        pass
    with e:
        pass


def test_capture_returns_a_waitable_event():
    e = Buffer.capture()
    assert isinstance(e, EventOverlap) and e.event is not None
    e.current_stream_wait()


# ---- constructor refusals (all raised before any engine or process group is touched) ----
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"group": None}, ValueError, "Either 'group' or 'comm' must be provided"),
        ({"group": None, "comm": object()}, TypeError, "comm must be an mpi4py communicator .* got object"),
        ({"num_nvl_bytes": 1000}, ValueError, "num_nvl_bytes=1000 must be a multiple of 128"),
        ({"num_rdma_bytes": 130}, ValueError, "num_rdma_bytes=130 must be a multiple of 128"),
        ({"num_nvl_bytes": -128}, ValueError, "num_nvl_bytes=-128 must be >= 0"),
        ({"low_latency_mode": True, "num_qps_per_rank": 0}, ValueError, "num_qps_per_rank=0 must be >= 1"),
        ({"backend": "hip"}, NotImplementedError, "backend='hip': the hip backend is not available yet"),
        ({"backend": "tpu"}, ValueError, "backend='tpu' is not a backend"),
        ({"transport": "ib"}, ValueError, "transport='ib' is not available"),
        ({"timeout_s": 0}, ValueError, "timeout_s=0.0 must be > 0"),
    ],
)
def test_constructor_refusals(kwargs, exc, match):
    args = {"group": object()}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        Buffer(args.pop("group"), **args)


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("PORTEP_BACKEND", "hip")
    with pytest.raises(NotImplementedError, match="PORTEP_BACKEND='hip'"):
        Buffer(object())


# ---- validation helpers ----
def idx(rows, cols, high=8, dtype=torch.int64):
    return torch.randint(-1, high, (rows, cols)).to(dtype)


@pytest.mark.parametrize(
    "tensor,kwargs,exc,match",
    [
        (idx(4, 2, dtype=torch.int32), {}, TypeError, "topk_idx has dtype torch.int32; it must be torch.int64"),
        (torch.full((4, 2), 8), {}, ValueError, r"expert index 8; entries must be in \[-1, 8\)"),
        (torch.full((4, 2), -2), {}, ValueError, r"expert index -2; entries must be in \[-1, 8\)"),
        (idx(4, 33), {}, ValueError, "num_topk=33 columns; it must be in 1..32"),
        (idx(4, 12), {"max_topk": 11}, ValueError, "num_topk=12 columns; it must be in 1..11"),
        (idx(4, 2), {"num_tokens": 5}, ValueError, r"shape \[4, 2\]; it must be \[num_tokens=5, num_topk\]"),
        (idx(2, 4).T, {}, ValueError, "topk_idx must be contiguous"),
        (torch.zeros(4, dtype=torch.int64), {}, ValueError, "it must be 2-D"),
        (idx(4, 2).to("meta"), {}, ValueError, "topk_idx is on meta; this backend needs cpu tensors"),
        ([[0, 1]], {}, TypeError, "topk_idx must be a torch.Tensor, got list"),
    ],
)
def test_check_topk_idx(tensor, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        v.check_topk_idx("topk_idx", tensor, 8, **kwargs)


def test_check_topk_idx_accepts_holes_and_empty():
    v.check_topk_idx("topk_idx", torch.tensor([[-1, 7], [0, -1]]), 8)
    v.check_topk_idx("topk_idx", torch.zeros(0, 4, dtype=torch.int64), 8, num_tokens=0)


def test_check_topk_weights_and_pair():
    with pytest.raises(TypeError, match="topk_weights has dtype torch.bfloat16; it must be torch.float32"):
        v.check_topk_weights("topk_weights", torch.zeros(4, 2, dtype=torch.bfloat16), (4, 2))
    with pytest.raises(ValueError, match=r"shape \[4, 3\]; it must be \[num_tokens=4, num_topk=2\]"):
        v.check_topk_weights("topk_weights", torch.zeros(4, 3), (4, 2))
    with pytest.raises(ValueError, match="topk_idx was given, topk_weights is None"):
        v.check_topk_pair(idx(4, 2), None)
    with pytest.raises(ValueError, match="topk_weights was given, topk_idx is None"):
        v.check_topk_pair(None, torch.zeros(4, 2))


@pytest.mark.parametrize(
    "num_experts,exc,match",
    [
        (0, ValueError, "num_experts=0 must be >= 1"),
        (10, ValueError, "num_experts=10 must be a multiple of the number of ranks 4"),
        (4 * 1025, ValueError, "1025 experts per rank; the limit is 1024"),
        (8.0, TypeError, "num_experts must be an int"),
    ],
)
def test_check_num_experts(num_experts, exc, match):
    with pytest.raises(exc, match=match):
        v.check_num_experts(num_experts, 4)


def test_check_dispatch_x_accepts_deepep_inputs():
    x, s = v.check_dispatch_x(torch.zeros(4, 256, dtype=torch.bfloat16))
    assert s is None
    fp8 = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    col_major = torch.ones(2, 4).T  # DeepEP's tests pass column-major scales
    assert v.check_dispatch_x((fp8, col_major))[1] is col_major
    v.check_dispatch_x((fp8, torch.zeros(4, 1, dtype=torch.int32)))


@pytest.mark.parametrize(
    "x,exc,match",
    [
        (torch.zeros(4, 256), TypeError, "torch.float32 .4 bytes per element.; dispatch moves 1-byte"),
        (torch.zeros(4, 4, dtype=torch.bfloat16), ValueError, r"rows are 8 bytes \(hidden=4 x 2\); .* multiple of 16"),
        (torch.zeros(4, 256, dtype=torch.bfloat16)[:, :128], ValueError, "x must be contiguous"),
        (torch.zeros(256, dtype=torch.bfloat16), ValueError, "x has shape .256.; it must be 2-D"),
        ((torch.zeros(4, 256, dtype=torch.bfloat16), torch.ones(4, 2)), TypeError, "x with scales must have 1-byte"),
        (
            (torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(3, 2)),
            ValueError,
            r"x_scales has shape \[3, 2\]; it must be \[num_tokens=4, num_scales\]",
        ),
        (
            (torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2, dtype=torch.float64)),
            TypeError,
            "x_scales has dtype torch.float64; it must be torch.float32 or torch.int32",
        ),
        ((torch.zeros(4, 256, dtype=torch.float8_e4m3fn),), ValueError, "must be .x, x_scales., got 1 elements"),
        ([torch.zeros(4, 256, dtype=torch.bfloat16)], TypeError, "x must be a torch.Tensor or an .x, x_scales. tuple"),
    ],
)
def test_check_dispatch_x_refusals(x, exc, match):
    with pytest.raises(exc, match=match):
        v.check_dispatch_x(x)


def layout(num_tokens=4, num_ranks=2, num_experts=8, num_nodes=1):
    return dict(
        num_tokens_per_rank=torch.zeros(num_ranks, dtype=torch.int32),
        num_tokens_per_rdma_rank=torch.zeros(num_nodes, dtype=torch.int32) if num_nodes > 1 else None,
        is_token_in_rank=torch.zeros(num_tokens, num_ranks, dtype=torch.bool),
        num_tokens_per_expert=torch.zeros(num_experts, dtype=torch.int32),
    )


def test_check_layout_tensors():
    assert v.check_layout_tensors(**layout(), num_tokens=4, num_ranks=2, num_nodes=1) == 8
    assert v.check_layout_tensors(**layout(num_nodes=2), num_tokens=4, num_ranks=2, num_nodes=2) == 8
    with pytest.raises(ValueError, match="needs num_tokens_per_rdma_rank"):
        v.check_layout_tensors(**layout(), num_tokens=4, num_ranks=2, num_nodes=2)
    bad = layout()
    bad["is_token_in_rank"] = None
    with pytest.raises(ValueError, match="dispatch without a handle needs is_token_in_rank"):
        v.check_layout_tensors(**bad, num_tokens=4, num_ranks=2, num_nodes=1)
    with pytest.raises(ValueError, match=r"is_token_in_rank has shape \[4, 2\]; it must be \[num_tokens=5"):
        v.check_layout_tensors(**layout(), num_tokens=5, num_ranks=2, num_nodes=1)
    bad = layout()
    bad["num_tokens_per_rank"] = bad["num_tokens_per_rank"].long()
    with pytest.raises(TypeError, match="num_tokens_per_rank has dtype torch.int64; it must be torch.int32"):
        v.check_layout_tensors(**bad, num_tokens=4, num_ranks=2, num_nodes=1)
    with pytest.raises(ValueError, match="num_experts=6 must be a multiple of the number of ranks 4"):
        v.check_layout_tensors(**layout(num_ranks=4, num_experts=6), num_tokens=4, num_ranks=4, num_nodes=1)


def test_check_event_args():
    e = EventOverlap(HostEvent())
    v.check_event_args(e, True, True)
    v.check_event_args(None, False, False)
    with pytest.raises(ValueError, match=r"requires previous_event \(got None\) and async_finish=True"):
        v.check_event_args(None, True, True)
    with pytest.raises(ValueError, match="async_finish=True .got False."):
        v.check_event_args(e, False, True)
    with pytest.raises(TypeError, match="previous_event must be an EventOverlap or None, got HostEvent"):
        v.check_event_args(HostEvent(), False, False)


def test_check_flag_combinations():
    with pytest.raises(ValueError, match="async_finish=True and return_recv_hook=True are mutually exclusive"):
        v.check_ll_flags(True, True)
    v.check_ll_flags(True, False)
    with pytest.raises(ValueError, match="use_ue8m0=True requires round_scale=True"):
        v.check_fp8_flags(True, False, True)
    with pytest.raises(ValueError, match="round_scale=True requires use_fp8=True"):
        v.check_fp8_flags(False, True, False)
    v.check_fp8_flags(True, True, True)


def test_check_config():
    assert v.check_config(Config(24)) == Config(24)
    with pytest.raises(ValueError, match="config.num_sms=0 must be even and >= 2"):
        v.check_config(Config(0))
    with pytest.raises(ValueError, match="config.num_sms=21 must be even"):
        v.check_config(Config(21))
    with pytest.raises(TypeError, match="config must be a portep Config"):
        v.check_config((24, 6, 256))


def intranode_handle(num_tokens=4, num_recv=5, num_ranks=2, channels=10):
    i32 = torch.int32
    return (
        torch.zeros(num_ranks, num_ranks, dtype=i32),
        torch.zeros(num_ranks, channels, dtype=i32),
        torch.zeros(num_ranks, channels, dtype=i32),
        torch.zeros(num_recv, dtype=i32),
        torch.zeros(num_tokens, num_ranks, dtype=torch.bool),
        torch.zeros(num_tokens, num_ranks, dtype=i32),
    )


def test_check_normal_handle():
    handle, num_tokens, num_recv, channels = v.check_normal_handle(list(intranode_handle()), 2, 1)
    assert isinstance(handle, tuple) and (num_tokens, num_recv, channels) == (4, 5, 10)
    with pytest.raises(ValueError, match="handle has 6 elements; a dispatch handle of this Buffer has 10"):
        v.check_normal_handle(intranode_handle(), 2, 2)
    with pytest.raises(ValueError, match="handle has 5 elements; a dispatch handle of this Buffer has 6"):
        v.check_normal_handle(intranode_handle()[:5], 2, 1)
    with pytest.raises(TypeError, match="handle must be the tuple returned by dispatch, got dict"):
        v.check_normal_handle({}, 2, 1)
    with pytest.raises(ValueError, match=r"handle's is_token_in_rank has shape \[4, 2\]; .*num_ranks=4"):
        v.check_normal_handle(intranode_handle(), 4, 1)
    with pytest.raises(ValueError, match="config.num_sms=24 gives 12 channels but the handle was made with 10"):
        v.check_handle_channels(10, Config(24), "combine")


def test_check_bias():
    b = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert v.check_bias(None, 4, 8, torch.bfloat16) == ()
    assert v.check_bias(b, 4, 8, torch.bfloat16) == (b,)
    assert len(v.check_bias((b, None), 4, 8, torch.bfloat16)) == 1
    assert len(v.check_bias((b, b), 4, 8, torch.bfloat16)) == 2
    with pytest.raises(TypeError, match=r"bias\[1\] has dtype torch.float32; it must be torch.bfloat16"):
        v.check_bias((b, b.float()), 4, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias has shape \[4, 8\]; it must be \[num_tokens=5, hidden=8\]"):
        v.check_bias(b, 5, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="bias as a tuple must have 2 elements"):
        v.check_bias((b,), 4, 8, torch.bfloat16)
    with pytest.raises(TypeError, match="bias must be a tensor, a 2-tuple of tensors, or None, got list"):
        v.check_bias([b, b], 4, 8, torch.bfloat16)


def test_check_ll_x():
    x = torch.zeros(8, 512, dtype=torch.bfloat16)
    v.check_ll_x(x, 8, use_ue8m0=True)
    with pytest.raises(ValueError, match="x has 8 tokens; the limit is num_max_dispatch_tokens_per_rank=4"):
        v.check_ll_x(x, 4, use_ue8m0=False)
    for hidden, ue8m0 in ((384, True), (200, False), (256, False)):
        with pytest.raises(ValueError, match=f"hidden={hidden} must be a multiple of 512 in low-latency mode"):
            v.check_ll_x(torch.zeros(2, hidden, dtype=torch.bfloat16), 8, use_ue8m0=ue8m0)
    with pytest.raises(TypeError, match="x has dtype torch.float16; it must be torch.bfloat16"):
        v.check_ll_x(torch.zeros(2, 256, dtype=torch.float16), 8, use_ue8m0=False)


def ll_handle(num_local=2, num_ranks=2, tokens=4, hidden=256):
    return (
        torch.zeros(num_local, num_ranks * tokens, dtype=torch.int32),
        torch.zeros(num_local, num_ranks, dtype=torch.int64),
        tokens,
        hidden,
        num_local * num_ranks,
    )


def test_check_ll_handle_and_combine_inputs():
    assert v.check_ll_handle(ll_handle(), 2) == (4, 256, 4)
    with pytest.raises(ValueError, match="handle has 6 elements; a low-latency handle has 5"):
        v.check_ll_handle(intranode_handle(), 2)
    short_src_info = (torch.zeros(2, 4, dtype=torch.int32),) + ll_handle()[1:]
    with pytest.raises(
        ValueError,
        match=r"handle's src_info has shape \[2, 4\]; it must be "
        r"\[num_local_experts=2, num_ranks\*T=8\]",
    ):
        v.check_ll_handle(short_src_info, 2)
    x = torch.zeros(2, 8, 256, dtype=torch.bfloat16)
    v.check_ll_combine_x(x, 2, 4, 256, 4)
    with pytest.raises(
        ValueError,
        match=r"x has shape \[2, 8, 256\]; it must be \[num_local_experts=2, "
        r"num_ranks\*T=8, hidden=512\]",
    ):
        v.check_ll_combine_x(x, 2, 4, 512, 4)
    with pytest.raises(ValueError, match="out has shape .3, 256.; it must be .num_combined_tokens=4, hidden=256."):
        v.check_ll_out(torch.zeros(3, 256, dtype=torch.bfloat16), 4, 256)
    with pytest.raises(TypeError, match="out has dtype torch.float32"):
        v.check_ll_out(torch.zeros(4, 256), 4, 256)


def test_check_stats():
    assert v.check_stats("s", None, 4, torch.int32, "num_local_experts") is None
    with pytest.raises(
        TypeError, match="cumulative_local_expert_recv_stats has dtype torch.int64; it must be torch.int32"
    ):
        v.check_stats(
            "cumulative_local_expert_recv_stats", torch.zeros(4, dtype=torch.int64), 4, torch.int32, "num_local_experts"
        )
    with pytest.raises(
        ValueError,
        match=r"dispatch_wait_recv_cost_stats has shape \[2, 2\]; it must be 1-D "
        r"\[num_ranks=2\]",
    ):
        v.check_stats(
            "dispatch_wait_recv_cost_stats", torch.zeros(2, 2, dtype=torch.int64), 2, torch.int64, "num_ranks"
        )


def test_a_buffer_deleted_without_destroy_warns_visibly():
    """explicitly_destroy=True and no destroy(): a warning Python shows by default (as DeepEP prints one)."""
    import subprocess
    import sys

    probe = (
        "import gc, torch.distributed as dist, portep\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "b = portep.Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True, backend='host')\n"
        "del b; gc.collect()\n"
        "print('deleted', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "deleted" in r.stdout, r.stderr[-2000:]
    assert "destroy() was not called" in r.stderr and "RuntimeWarning" in r.stderr, r.stderr[-2000:]
