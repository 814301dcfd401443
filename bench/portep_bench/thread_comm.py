"""Ranks as threads of one process: a communicator with mpi4py's three methods (what portep's bootstrap uses for
DeepEP's `comm=`), so that several portep Buffers in one process form one group (the one-process internode
benchmark, ht_nodes_loopback.py). Every exchange waits at most timeout_s; a rank that never arrives breaks it for
all (threading.BrokenBarrierError) instead of hanging."""

import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait


class ThreadGroup:
    """What the ranks share: one slot each and a barrier."""

    def __init__(self, size, timeout_s=120.0):
        self.size, self.timeout_s = size, timeout_s
        self.slots = [None] * size
        self.barrier = threading.Barrier(size)

    def comm(self, rank):
        """Rank `rank`'s communicator."""
        return ThreadComm(self, rank)

    def abort(self):
        """Every rank waiting in (or later entering) an exchange raises threading.BrokenBarrierError."""
        self.barrier.abort()


class ThreadComm:
    """Rank `rank` of a ThreadGroup, as mpi4py's Comm: Get_rank, Get_size, allgather."""

    def __init__(self, group, rank):
        if not 0 <= rank < group.size:
            raise ValueError(f"rank={rank} is outside the group's {group.size} ranks")
        self.group, self.rank = group, rank

    def Get_rank(self):  # noqa: N802 - mpi4py's names
        """This rank."""
        return self.rank

    def Get_size(self):  # noqa: N802
        """The ranks in the group."""
        return self.group.size

    def allgather(self, obj):
        """Every rank's obj, by rank."""
        g = self.group
        g.barrier.wait(g.timeout_s)  # nobody still reads the previous exchange's slots
        g.slots[self.rank] = obj
        g.barrier.wait(g.timeout_s)
        return list(g.slots)


def on_all_ranks(pool: ThreadPoolExecutor, fn, ranks, group=None):
    """fn(rank) on every rank at once, one thread each (collective calls need all of them); the results by rank.
    When one fails, `group` (a ThreadGroup) is aborted so that the others leave their exchanges, and once every rank
    has ended the failure is raised (the first rank's that is not just a broken exchange)."""
    futures = [pool.submit(fn, r) for r in range(ranks)]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    if group is not None and any(f.exception() is not None for f in done):
        group.abort()
    wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [f.result() for f in futures]
