"""Bootstrap: exchanging endpoint descriptions over the ranks' communicator, either a torch.distributed process
group (NCCL or gloo) or an mpi4py communicator (DeepEP's `comm=`). Everything portep does across ranks before its
own channel exists goes through these three functions."""

from typing import Callable, Tuple


def is_mpi_comm(comm: object) -> bool:
    """Whether comm is an mpi4py communicator (told by its methods: mpi4py need not be importable to ask)."""
    return all(callable(getattr(comm, name, None)) for name in ("Get_rank", "Get_size", "allgather"))


def group_rank_and_size(group: object, what: str = "a Channel") -> Tuple[int, int]:
    """(rank, size) in `group` (a torch.distributed group, None for the default one, or an mpi4py communicator);
    raises naming `what` where torch.distributed is not initialized."""
    if is_mpi_comm(group):
        return int(group.Get_rank()), int(group.Get_size())
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is not initialized: call init_process_group before creating {what}, or pass an "
            f"mpi4py communicator"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(obj: object, group: object) -> list:
    """Every rank's `obj`, by rank (mpi4py's allgather, or torch.distributed.all_gather_object)."""
    if is_mpi_comm(group):
        return list(group.allgather(obj))
    import torch.distributed as dist

    try:
        import numpy  # noqa: F401  (torch's object collectives convert through numpy)
    except ImportError as exc:
        raise RuntimeError(
            f"portep's bootstrap uses torch.distributed.all_gather_object, which needs numpy ({exc}); "
            f"pip install numpy (python -m portep.doctor lists what is missing)"
        ) from exc
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def collective_step(step: Callable[[], object], group: object, what: str) -> None:
    """Runs step() on every rank; if it fails anywhere, every rank raises (nobody waits for a dead peer)."""
    try:
        step()
        mine = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        mine = f"{type(exc).__name__}: {exc}"
    errors = all_gather_objects(mine, group)
    failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {err}" for rank, err in failed)
        raise RuntimeError(f"{what} failed on {len(failed)} rank(s): {detail}")
