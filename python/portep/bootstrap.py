"""Bootstrap over a torch.distributed process group (NCCL or gloo): exchange endpoint descriptions."""

from typing import Callable, Tuple


def group_rank_and_size(group: object, what: str = "a Channel") -> Tuple[int, int]:
    """(rank, size) of `group` in torch.distributed; raises naming `what` where it is not initialized."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"torch.distributed is not initialized: call init_process_group before creating {what}")
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(obj: object, group: object) -> list:
    """Every rank's `obj`, by rank (torch.distributed.all_gather_object)."""
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
