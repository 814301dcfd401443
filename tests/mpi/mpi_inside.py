"""Runs under mpirun (tests/host/test_mpi_comm.py): DeepEP's Buffer(group=None, comm=...) on the host backend, with
no torch.distributed at all. The communicator is MPI.COMM_WORLD split with the ranks reversed, so a Buffer that took
its ranks from anywhere but `comm` would exchange with the wrong peers. Runs the LL and HT bodies of
deepep_workers (checked against deepep_reference) with their collectives on the communicator, and writes one JSON
object per rank, {"rank", "world_rank", "checks", "failures", "torch_distributed"}, to <argv[1]>/rank<rank>.json
(mpirun merges the ranks' stdout, so lines printed there can run together)."""

import json
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

from mpi4py import MPI  # noqa: E402

import deepep_workers as w  # noqa: E402
import portep  # noqa: E402


def main():
    world = MPI.COMM_WORLD
    comm = world.Split(0, world.Get_size() - 1 - world.Get_rank())
    rank, size = comm.Get_rank(), comm.Get_size()

    class CommBuffer(portep.Buffer):
        """portep.Buffer as the workers call it (with dist.group.WORLD), bootstrapped over comm instead."""

        def __init__(self, group, *args, **kwargs):
            assert group is None, "the workers' group must be the shim's None"
            super().__init__(None, *args, comm=comm, **kwargs)

    # The workers' collectives and ranks go through the communicator too (no torch.distributed in this process).
    w.all_gather = lambda obj: comm.allgather(obj)
    w.dist = types.SimpleNamespace(
        group=types.SimpleNamespace(WORLD=None),
        get_rank=comm.Get_rank,
        get_world_size=comm.Get_size,
        barrier=comm.Barrier,
    )
    w.portep = types.SimpleNamespace(**{k: getattr(portep, k) for k in dir(portep) if not k.startswith("__")})
    w.portep.Buffer = CommBuffer

    out = [
        w.ll_body(rank, size, size, "shm", 5, 32, 512, 8, 4, False, 1),
        w.ht_body(rank, size, size, "shm-unordered", 7, [96, 64][:size] + [48] * max(0, size - 2), 512, 4, 8, 1),
    ]
    import torch.distributed as dist

    result = {
        "rank": rank,
        "world_rank": world.Get_rank(),
        "checks": sum(o["checks"] for o in out),
        "failures": [f for o in out for f in o["failures"]][:20],
        "torch_distributed": dist.is_initialized(),
    }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
