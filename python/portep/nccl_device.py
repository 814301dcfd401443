"""NCCL's device API as a device path (gpu_kernels/nccl/nccl_lsa.h): this rank's bytes in an NCCL symmetric window,
kernels that store into the windows of the peers NCCL reaches by loads and stores (LSA: NVLink or PCIe P2P), and
NCCL's LSA barrier between them. NCCL is found at run time (portep.nccl_library: torch's own, else an nvidia-nccl
wheel's) and never linked; the build carries the device headers of one NCCL release and runs only under that
release's major.minor, which every rank checks before any collective step, so a refusal on one rank is raised on all
of them instead of leaving the others waiting."""

from typing import List, Optional

import torch
import torch.distributed as dist

from . import nccl_library
from ._native import require_native
from .config import timeout_from_env


def device_path_problem() -> str:
    """Why this process cannot run the NCCL device path ("" where it can): no GPU kernels or NCCL device headers in
    this build, no NCCL library, another NCCL release than the build's headers, or no GPU."""
    native = require_native()
    info = native.build_info()
    if not info["nccl_device_headers"]:
        return f"this build has no NCCL device path: {info['nccl_device_reason']}"
    found = nccl_library.probe()
    if not found.get("loaded"):
        return found["summary"]
    mismatch = native.nccl_device_mismatch(int(found["version"]))
    if mismatch:
        return f"{mismatch} ({found['path']})"
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    return ""


class NcclDevicePath:
    """One rank's NCCL device path; construction is collective over `group` (a torch.distributed group, every rank
    on its own GPU: NCCL before 2.30.3 refuses two ranks of one communicator on one GPU)."""

    def __init__(
        self, group: Optional[dist.ProcessGroup], num_bytes: int, timeout_s: Optional[float] = None, gin: bool = False
    ) -> None:
        """num_bytes: the window's size, a positive multiple of 16; timeout_s: each collective step's bound
        (default PORTEP_TIMEOUT_S, else 100 s); gin: ask NCCL for GIN too (one context, one signal), which needs an
        RDMA NIC NCCL's GIN supports, and raises RuntimeError naming ncclDevCommCreate where there is none. Raises
        RuntimeError on every rank, naming each rank that cannot run the path and why, before any NCCL call."""
        if not isinstance(num_bytes, int) or num_bytes <= 0 or num_bytes % 16:
            raise ValueError(f"num_bytes={num_bytes!r}: a positive multiple of 16 is needed")
        native = require_native()
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        problems: List[str] = [""] * self.num_ranks
        dist.all_gather_object(problems, device_path_problem(), group=group)
        refused = [f"rank {r}: {why}" for r, why in enumerate(problems) if why]
        if refused:
            raise RuntimeError("the NCCL device path cannot run: " + "; ".join(refused))
        candidates = nccl_library.wheel_candidates()
        unique_id = [native.nccl_unique_id(candidates) if self.rank == 0 else None]
        dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._native = native.NcclLsa(
            rank=self.rank,
            num_ranks=self.num_ranks,
            device=self.device.index,
            nbytes=num_bytes,
            unique_id=unique_id[0],
            timeout_s=timeout_from_env(timeout_s),
            candidates=candidates,
            gin=bool(gin),
        )
        # the window: uint8 [num_bytes] on this rank's GPU, zeroed (the view keeps it allocated)
        self.region = torch.as_tensor(self._native.region_lease(), device=self.device)

    def lsa_peers(self) -> List[int]:
        """The ranks whose windows this rank's kernels store into (this rank included)."""
        return self._native.lsa_peers()

    def peer_table(self, table: torch.Tensor) -> None:
        """table: int64 [num_ranks] on this rank's GPU; gets each rank's window as kernels here reach it (0: not by
        stores), the table portep's kernels take for their direct peers."""
        self._native.peer_table(table)

    def put(self, peer: int, offset: int, src: torch.Tensor) -> None:
        """A kernel on the current stream stores src's bytes (a contiguous tensor on this rank's GPU) into peer's
        window from byte `offset`; offset and src's size in bytes are multiples of 16. Visible to peer after both
        have passed barrier()."""
        self._native.put(peer, offset, src, torch.cuda.current_stream(self.device).cuda_stream)

    def barrier(self) -> None:
        """NCCL's LSA barrier on the current stream: the stores every LSA peer queued before its barrier are visible
        to every other after this one."""
        self._native.barrier(torch.cuda.current_stream(self.device).cuda_stream)

    def gin_put(self, peer: int, offset: int, src_offset: int, num_bytes: int) -> None:
        """GIN (created with gin=True): a kernel on the current stream puts num_bytes of this rank's window from
        src_offset into peer's window at offset (multiples of 16), then adds 1 to peer's signal, which NCCL makes
        visible only after the bytes."""
        self._native.gin_put(peer, offset, src_offset, num_bytes, torch.cuda.current_stream(self.device).cuda_stream)

    def gin_wait(self, count: int) -> None:
        """GIN: a kernel on the current stream waits until count puts have signalled this rank since creation;
        returns once they have, or raises RuntimeError past the timeout."""
        self._native.gin_wait(count, torch.cuda.current_stream(self.device).cuda_stream)

    def close(self) -> None:
        """No further use: the communicator and the window are freed once no view of `region` is held either."""
        self._native.close()
        self.region = None
