"""How many proxy threads a GPU Buffer runs and how long they spin idle (config.gpu_proxy_plan, group_proxy_plan),
from every rank's host and affinity mask (topology.host_masks, gathered over the group at construction): real nodes
keep 4 spinning threads a rank, a host time-sharing one GPU among many ranks gets one thread a rank that sleeps soon,
and every rank of a group runs the same count (the transports pair channels by index)."""

import pytest

from portep.config import (
    DEFAULT_GPU_PROXY_SPIN_US,
    SHARED_HOST_PROXY_SPIN_US,
    gpu_proxy_plan,
    group_proxy_plan,
    proxy_spin_us_from_env,
)
from portep.topology import affinity_cpus, host_key, host_masks


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


def test_a_host_counts_the_union_of_its_ranks_masks():
    # a launcher binding each of 8 ranks to 16 of a node's 128 cores: the node still has 128, so 4 threads
    bound = [("node-a/1", list(range(16 * r, 16 * r + 16))) for r in range(8)]
    assert group_proxy_plan(bound, 3) == (4, None)
    # 16 ranks sharing one 16-core host: one thread each, the short spin
    shared = [("gpu-box/7", list(range(16)))] * 16
    assert group_proxy_plan(shared, 0) == (1, SHARED_HOST_PROXY_SPIN_US)


def test_every_rank_runs_the_fewest_threads_any_host_allows():
    # host a: 2 ranks on 16 cores (4 threads alone); host b: 4 ranks on 16 cores (3 threads alone)
    hosts = [("a/1", range(16))] * 2 + [("b/2", range(16))] * 4
    plans = [group_proxy_plan(hosts, r) for r in range(6)]
    assert {p[0] for p in plans} == {3} and all(p[1] is None for p in plans)
    # the spin stays each host's own: c is oversubscribed, d is not
    hosts = [("c/1", range(4))] * 4 + [("d/2", range(64))] * 2
    assert group_proxy_plan(hosts, 0) == (1, SHARED_HOST_PROXY_SPIN_US)
    assert group_proxy_plan(hosts, 5) == (1, None)


class _Comm:
    """mpi4py's three methods over fixed (host key, mask) entries: this rank's is filled in by the call."""

    def __init__(self, rank, entries):
        self.rank, self.entries = rank, entries

    def Get_rank(self):  # noqa: N802
        return self.rank

    def Get_size(self):  # noqa: N802
        return len(self.entries)

    def allgather(self, obj):
        assert obj == (host_key(), affinity_cpus())
        return [obj if r == self.rank else e for r, e in enumerate(self.entries)]


def test_host_masks_gathers_every_ranks_host_and_cpus():
    me = host_key()
    assert me.split("/", 1)[0] and "/" in me
    cpus = affinity_cpus()
    assert cpus == sorted(set(cpus)) and len(cpus) >= 1
    got = host_masks(_Comm(1, [("other/1", [0, 1]), None, ("other/1", [2])]))
    assert got == [("other/1", [0, 1]), (me, cpus), ("other/1", [2])]
    assert group_proxy_plan(got, 0)[0] == group_proxy_plan(got, 1)[0] == group_proxy_plan(got, 2)[0]
