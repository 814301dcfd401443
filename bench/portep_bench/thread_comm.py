"""Ranks as threads of one process: a communicator with mpi4py's three methods (what portep's bootstrap uses for
DeepEP's `comm=`), so that several portep Buffers in one process form one group (the one-process internode
benchmark, ht_nodes_loopback.py). Every exchange waits at most timeout_s; a rank that never arrives breaks it for
all (threading.BrokenBarrierError) instead of hanging."""

import threading
from concurrent.futures import ThreadPoolExecutor


class ThreadGroup:
    """What the ranks share: one slot each and a barrier."""

    def __init__(self, size, timeout_s=120.0):
        self.size, self.timeout_s = size, timeout_s
        self.slots = [None] * size
        self.barrier = threading.Barrier(size)

    def comm(self, rank):
        return ThreadComm(self, rank)


class ThreadComm:
    """Rank `rank` of a ThreadGroup, as mpi4py's Comm: Get_rank, Get_size, allgather."""

    def __init__(self, group, rank):
        if not 0 <= rank < group.size:
            raise ValueError(f"rank={rank} is outside the group's {group.size} ranks")
        self.group, self.rank = group, rank

    def Get_rank(self):  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.group.size

    def allgather(self, obj):
        g = self.group
        g.barrier.wait(g.timeout_s)  # nobody still reads the previous exchange's slots
        g.slots[self.rank] = obj
        g.barrier.wait(g.timeout_s)
        return list(g.slots)


def on_all_ranks(pool: ThreadPoolExecutor, fn, ranks):
    """fn(rank) on every rank at once, one thread each (collective calls need all of them); the results by rank.
    The first exception is raised after all have ended."""
    futures = [pool.submit(fn, r) for r in range(ranks)]
    return [f.result() for f in futures]
