"""How many proxy threads a GPU Buffer runs and how long they spin idle (config.gpu_proxy_plan), from the cores of
the host and the ranks on it (topology.ranks_on_this_host, counted over the group at construction): real nodes keep
4 spinning threads a rank, a host time-sharing one GPU among many ranks gets one thread a rank that sleeps soon."""

import pytest

from portep.config import DEFAULT_GPU_PROXY_SPIN_US, SHARED_HOST_PROXY_SPIN_US, gpu_proxy_plan, proxy_spin_us_from_env
from portep.topology import host_key, ranks_on_this_host


@pytest.fixture(autouse=True)
def no_spin_env(monkeypatch):
    monkeypatch.delenv("PORTEP_PROXY_SPIN_US", raising=False)


@pytest.mark.parametrize(
    "cores,ranks,threads,spin",
    [
        (128, 8, 4, None),  # an 8-GPU node: as before
        (16, 2, 4, None),  # the one-GPU machine, 2 ranks
        (16, 4, 3, None),  # 4 ranks: 3 proxies each, 16 threads in all
        (16, 8, 1, None),  # 8 ranks: one proxy each, 16 threads in all
        (16, 16, 1, SHARED_HOST_PROXY_SPIN_US),  # DeepEP's 2 x 8 on one GPU: 32 spinning threads on 16 cores
        (16, 32, 1, SHARED_HOST_PROXY_SPIN_US),
        (2, 1, 1, None),
        (1, 1, 1, SHARED_HOST_PROXY_SPIN_US),
    ],
)
def test_threads_and_spin_follow_the_cores_each_rank_has(cores, ranks, threads, spin):
    assert gpu_proxy_plan(cores, ranks) == (threads, spin)
    spun = proxy_spin_us_from_env(spin, True)
    assert spun == (DEFAULT_GPU_PROXY_SPIN_US if spin is None else spin)


def test_the_environment_still_decides_the_spin(monkeypatch):
    monkeypatch.setenv("PORTEP_PROXY_SPIN_US", "300")
    threads, spin = gpu_proxy_plan(16, 16)
    assert (threads, spin) == (1, None) and proxy_spin_us_from_env(spin, True) == 300.0


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="ranks_on_host=0"):
        gpu_proxy_plan(16, 0)


class _Comm:
    """mpi4py's three methods over fixed keys: this rank's host key is keys[rank]."""

    def __init__(self, rank, keys):
        self.rank, self.keys = rank, keys

    def Get_rank(self):  # noqa: N802
        return self.rank

    def Get_size(self):  # noqa: N802
        return len(self.keys)

    def allgather(self, obj):
        assert obj == host_key()
        return [obj if r == self.rank else k for r, k in enumerate(self.keys)]


def test_ranks_on_this_host_counts_the_same_host_key():
    me = host_key()
    assert me.split("/", 1)[0] and "/" in me
    assert ranks_on_this_host(_Comm(1, ["other/1", me, "other/1", me, me])) == 3
    assert ranks_on_this_host(_Comm(0, [me])) == 1
    assert ranks_on_this_host(_Comm(2, ["a/x", "b/y", me])) == 1
