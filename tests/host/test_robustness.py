"""After a failure on one side, a Buffer never returns wrong data without an error and never crashes, and a peer
that will not answer fails the waiting ranks fast (robust_workers.py), on the host backend over every path: direct
stores (one node), the proxies in order (shm) and out of order (shm-unordered), with several ranks per node."""

import pytest

import robust_workers as r
from deepep_workers import assert_clean
from dist_util import run_ranks

# world, ranks_per_node, transport
PATHS = [(2, 2, "shm"), (2, 1, "shm"), (2, 1, "shm-unordered"), (4, 2, "shm-unordered")]
IDS = [f"{p[0]}ranks-{p[1]}pernode-{p[2]}" for p in PATHS]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ll", "ht"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_one_sided_refusal_fails_every_rank_fast_until_resynchronised(path, mode):
    world, rpn, transport = path
    out = run_ranks(r.one_sided_refusal_body, world, args=(rpn, transport, mode, 3), timeout=240)
    assert_clean(out, 10)


@pytest.mark.parametrize("mode", ["ll", "ht"])
@pytest.mark.parametrize("path", PATHS[:3], ids=IDS[:3])
def test_an_expert_id_out_of_range_on_one_rank_is_refused_on_every_rank(path, mode):
    """The host backend reads CPU inputs: rank 0's expert id equal to num_experts is refused before any traffic, its
    peers raise at once, and every rank goes on after clean_low_latency_buffer (never a result from the bad round)."""
    world, rpn, transport = path
    out = run_ranks(r.one_sided_refusal_body, world, args=(rpn, transport, mode, 5, "host", "expert"), timeout=240)
    assert_clean(out, 10)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ll", "ht"])
@pytest.mark.parametrize("path", PATHS[1:3], ids=IDS[1:3])
def test_a_call_refused_everywhere_leaves_the_ranks_in_step(path, mode):
    world, rpn, transport = path
    out = run_ranks(r.refused_everywhere_body, world, args=(rpn, transport, mode, 5), timeout=240)
    assert_clean(out, 10)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ll", "ht"])
@pytest.mark.parametrize("path", PATHS[1:], ids=IDS[1:])
def test_a_peer_late_past_the_timeout_never_gives_wrong_data(path, mode):
    world, rpn, transport = path
    out = run_ranks(r.late_peer_body, world, args=(rpn, transport, mode, 7, 3.0, 4.5), timeout=240)
    assert_clean(out, 5)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "destroy"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_a_dead_or_departed_peer_fails_the_waiters_within_a_second(path, how):
    world, rpn, transport = path
    out = run_ranks(
        r.dead_peer_body,
        world,
        args=(rpn, transport, how, 9),
        timeout=120,
        expect_missing=(world - 1,) if how == "exit" else (),
    )
    assert_clean({k: v for k, v in out.items() if k != world - 1}, 2)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "shm-unordered"])
def test_a_dead_rank_of_another_node_fails_normal_mode_fast_at_16_ranks(transport):
    # 2 nodes x 8: the last rank (a forwarder of node 1) exits before a normal-mode call; every other rank's call
    # raises naming it within seconds (16 processes share this machine's cores), not after the 30 s timeout
    world, rpn = 16, 8
    out = run_ranks(
        r.dead_peer_body,
        world,
        args=(rpn, transport, "exit", 23, "host", "ht", 6.0),
        timeout=300,
        expect_missing=(world - 1,),
    )
    assert_clean({k: v for k, v in out.items() if k != world - 1}, 2)


@pytest.mark.slow
@pytest.mark.parametrize("path", [(4, 2, "shm-unordered"), (16, 8, "shm")], ids=["2x2-shm-unordered", "2x8-shm"])
def test_normal_mode_then_clean_then_low_latency_on_one_buffer_across_nodes(path):
    world, rpn, transport = path
    out = run_ranks(r.modes_in_turn_body, world, args=(rpn, transport, 29), timeout=300)
    assert_clean(out, 8)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_a_rank_without_tokens_and_odd_empty_strides(path):
    world, rpn, transport = path
    out = run_ranks(r.zero_token_rank_body, world, args=(rpn, transport, 11), timeout=240)
    assert_clean(out, 5)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS[1:], ids=IDS[1:])
def test_calls_ignore_the_callers_default_device_and_dtype(path):
    """DeepEP's tests make bfloat16 and CUDA torch's defaults; the library's own tensors must not follow them
    ('meta' here: any tensor made by the default device fails)."""
    world, rpn, transport = path
    out = run_ranks(r.zero_token_rank_body, world, args=(rpn, transport, 17, "meta"), timeout=240)
    assert_clean(out, 5)


@pytest.mark.parametrize("path", PATHS[:2], ids=IDS[:2])
def test_views_keep_their_memory_after_destroy(path):
    world, rpn, transport = path
    out = run_ranks(r.view_after_destroy_body, world, args=(rpn, transport), timeout=120)
    assert_clean(out, 5)


@pytest.mark.parametrize("path", PATHS[1:3], ids=IDS[1:3])
def test_a_receive_hook_runs_once_and_not_after_destroy(path):
    world, rpn, transport = path
    out = run_ranks(r.hook_after_destroy_body, world, args=(rpn, transport), timeout=120)
    assert_clean(out, 3)


def test_a_rank_killed_while_building_leaves_no_segment_behind():
    out = run_ranks(r.killed_while_building_body, 2, timeout=120, expect_missing=(1,))
    res = out[0]
    assert len(res["held"]) >= 3, f"the rank being built held {res['held']}: the test did not reach the moment it means"
    assert res["named_while_building"] == [], "segments must never have a name in /dev/shm"
    assert res["left_after"] == [], f"the killed rank {res['victim']} left {res['left_after']}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [(6, 6, "shm"), (6, 1, "shm-unordered"), (4, 2, "shm")],
    ids=["6ranks-direct", "6ranks-proxies-unordered", "4ranks-2pernode"],
)
def test_shrink_masks_the_ranks_that_leave(path):
    world, rpn, transport = path
    defaults = "meta" if transport == "shm-unordered" else None  # as test_calls_ignore_the_callers_default_device
    out = run_ranks(r.shrink_body, world, args=(rpn, transport, 13, 3, "host", defaults), timeout=400)
    assert_clean(out, 1)
    assert sum(v["checks"] for v in out.values()) > 100


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS[1:3], ids=IDS[1:3])
def test_shrink_masks_a_silent_rank_after_the_timeout(path):
    world, rpn, transport = path
    out = run_ranks(r.shrink_silent_rank_body, world, args=(rpn, transport, 15, 3.0), timeout=200)
    assert_clean(out, 1)


@pytest.mark.parametrize("path", [PATHS[1], PATHS[3]], ids=[IDS[1], IDS[3]])
def test_a_buffer_left_alive_has_its_proxies_stopped_at_exit(path, tmp_path):
    """A Buffer never destroyed (explicitly_destroy=True, its worker done or raised) does not leave proxy threads
    running into the process's teardown, where they read freed mapped memory (SIGSEGV on the CUDA backend); run_ranks
    also fails a rank that dies by a signal on its way out."""
    world, rpn, transport = path
    out = run_ranks(r.left_alive_body, world, args=(rpn, transport, str(tmp_path)), timeout=180)
    assert all(n > 0 for n in out.values()), f"no proxy threads while the Buffers lived: {out}"
    for rank in range(world):
        at_exit = (tmp_path / f"rank{rank}.txt").read_text()
        assert at_exit == "0", f"rank {rank}: {at_exit} proxy threads still ran at exit"
