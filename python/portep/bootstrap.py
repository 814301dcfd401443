"""Bootstrap over a torch.distributed process group (NCCL or gloo): exchange endpoint descriptions."""


def group_rank_and_size(group, what="a Channel"):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"torch.distributed is not initialized: call init_process_group before creating {what}")
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(obj, group):
    import torch.distributed as dist

    try:
        import numpy  # noqa: F401  (torch's object collectives convert through numpy)
    except ImportError as exc:
        raise RuntimeError(f"portep's bootstrap uses torch.distributed.all_gather_object, which needs numpy ({exc}); "
                           f"pip install numpy (python -m portep.doctor lists what is missing)") from exc
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def collective_step(step, group, what):
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
