"""The rank spawner the tests and benchmarks share: a rank that outlives the timeout fails the call naming it, and
prints where it was stuck (every thread's Python stack) before it is killed; PORTEP_RANK_TIMEOUT_S shortens the
bound; each rank runs torch's CPU ops on one thread."""

import time

import pytest

from dist_util import RankFailure, run_ranks


def stuck_in_a_named_wait(rank, world, stuck_rank):
    if rank == stuck_rank:
        time.sleep(120)
    return rank * 10


def test_a_late_rank_fails_the_call_with_its_stack(capfd):
    t0 = time.monotonic()
    # 15 s: rank 0's start-up (spawn, torch's import) must fit it on a loaded 2-core machine; with 3 s it did not
    with pytest.raises(RankFailure, match=r"ranks \[1\] did not finish within 15(\.0)? s"):
        run_ranks(stuck_in_a_named_wait, 2, args=(1,), timeout=15)
    assert time.monotonic() - t0 < 60
    err = capfd.readouterr().err
    assert "rank 1: Python stacks at the timeout" in err
    assert "stuck_in_a_named_wait" in err, err[-2000:]


def test_the_environment_bound_replaces_the_callers(monkeypatch):
    monkeypatch.setenv("PORTEP_RANK_TIMEOUT_S", "2")
    with pytest.raises(RankFailure, match=r"did not finish within 2(\.0)? s"):
        run_ranks(stuck_in_a_named_wait, 2, args=(0,), timeout=600)


def test_ranks_that_finish_return_their_values():
    assert run_ranks(stuck_in_a_named_wait, 2, args=(-1,), timeout=60) == {0: 0, 1: 10}


def cpu_threads(rank, world):
    import torch

    return torch.get_num_threads()


def test_each_rank_runs_torch_on_one_cpu_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_ranks(cpu_threads, 2, timeout=60) == {0: 1, 1: 1}
