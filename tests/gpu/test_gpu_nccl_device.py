"""The NCCL device path on GPUs (gpu_kernels/nccl/nccl_lsa.h, portep.nccl_device): NCCL's communicator, a symmetric
window, the device communicator with its LSA barrier, and portep's kernel storing through the LSA pointers NCCL's
device API gives, checked byte for byte against the bytes put. One rank puts into its own window (what one GPU
allows); two and four ranks put into their neighbours' windows where each rank has a GPU of its own, or shares one
under an NCCL that allows it (2.30.3 and later). Needs a GPU, the CUDA kernels and a build whose NCCL device headers
are the loaded NCCL's release (the GPU machine's build compiles against torch's NCCL)."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
from dist_util import run_ranks
from portep import native, nccl_library

SHARE = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"
CHUNK = 1 << 20  # bytes each rank puts, at a rank-dependent offset


def _problem():
    from portep.nccl_device import device_path_problem

    return device_path_problem() if native.build_info()["gpu_built"] and torch.cuda.is_available() else "no GPU"


def _missing(world):
    """Why `world` ranks cannot run the path here ("" where they can)."""
    base = gpu_skip_reason(world, "a build whose NCCL device headers are the loaded NCCL's release")
    if not base.startswith("needs"):  # no GPU, or no kernels
        return base
    problem = _problem()
    if problem:
        return f"{base}: {problem}"
    version, gpus = int(nccl_library.probe()["version"]), torch.cuda.device_count()
    if world > gpus and version < 23003:
        return f"{base}: {world} ranks on {gpus} GPU(s) need NCCL >= 2.30.3 (this is {version})"
    return ""


def _pattern(rank, seed, n):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    data = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    data[:16] = torch.tensor([rank + 1] * 16, dtype=torch.uint8)  # never all zero: a missed put shows
    return data


def put_ring_body(rank, world, seed):
    """Rank r puts its pattern into rank (r + 1) % world's window at offset r * CHUNK (one rank: its own), then the
    LSA barrier; every window must hold exactly its sender's bytes there and zeros elsewhere."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    from portep.nccl_device import NcclDevicePath

    path = NcclDevicePath(None, world * CHUNK + 4096)
    peers = path.lsa_peers()
    table = torch.full((world,), -1, dtype=torch.int64, device=path.device)
    path.peer_table(table)
    src = _pattern(rank, seed, CHUNK).to(path.device)
    path.put((rank + 1) % world, rank * CHUNK, src)
    path.barrier()
    torch.cuda.synchronize()
    got = path.region.cpu()
    sender = (rank - 1) % world
    expected = torch.zeros(world * CHUNK + 4096, dtype=torch.uint8)
    expected[sender * CHUNK : (sender + 1) * CHUNK] = _pattern(sender, seed, CHUNK)
    mismatched = int((got != expected).sum())
    path.close()
    return {"peers": peers, "table_set": (table.cpu() != 0).tolist(), "mismatched": mismatched}


@pytest.mark.gpu
@pytest.mark.skipif(bool(_missing(1)), reason=_missing(1) or "runs here")
@pytest.mark.parametrize("seed", [1, 2])
def test_one_rank_puts_into_its_own_window_through_its_lsa_pointer(seed):
    out = run_ranks(put_ring_body, 1, args=(seed,), timeout=240)
    assert out[0] == {"peers": [0], "table_set": [True], "mismatched": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_put_into_their_neighbours_windows(world):
    if _missing(world):
        pytest.skip(_missing(world))
    out = run_ranks(put_ring_body, world, args=(7,), timeout=300)
    for rank in range(world):
        assert out[rank]["mismatched"] == 0, (rank, out[rank])
        assert out[rank]["peers"] == list(range(world)) and all(out[rank]["table_set"])  # one node: all LSA peers


@pytest.mark.gpu
@pytest.mark.skipif(bool(_missing(1)), reason=_missing(1) or "runs here")
def test_bad_puts_are_refused_naming_the_limit():
    out = run_ranks(bad_put_body, 1, timeout=240)
    assert out[0] == [
        "put: peer 1 is not a rank of 1",
        "put: offset 8 and bytes 64 must be multiples of 16 within the window's 8192",
        "put: offset 8192 and bytes 16 must be multiples of 16 within the window's 8192",
        "src: a tensor on cuda is needed, got one on cpu",
        "gin_put: this NcclLsa was created without GIN (gin=True asks for it)",
        "NcclLsa.closed",
    ]


def bad_put_body(rank, world):
    torch.cuda.set_device(0)
    from portep.nccl_device import NcclDevicePath

    path = NcclDevicePath(None, 8192)
    src = torch.ones(64, dtype=torch.uint8, device=path.device)
    errors = []
    for peer, offset, data in [(1, 0, src), (0, 8, src), (0, 8192, src[:16]), (0, 0, src.cpu())]:
        try:
            path.put(peer, offset, data)
        except ValueError as e:
            errors.append(str(e))
    try:
        path.gin_put(0, 0, 4096, 16)
    except RuntimeError as e:
        errors.append(str(e))
    path.close()
    try:
        path.barrier()
    except RuntimeError as e:
        errors.append("NcclLsa.closed" if "closed" in str(e) else str(e))
    return errors


def gin_body(rank, world):
    """GIN where NCCL has it (an RDMA NIC): a put of 4 KiB from this window's upper half into its lower half, through
    the NIC, and a wait for its signal; else the refusal, and the LSA path still works beside it."""
    torch.cuda.set_device(0)
    from portep.nccl_device import NcclDevicePath

    src = _pattern(rank, 5, 4096)
    try:
        path = NcclDevicePath(None, 8192, gin=True)
    except RuntimeError as e:
        refused = str(e)
        path = NcclDevicePath(None, 8192)
        path.put(0, 0, src.to(path.device))
        path.barrier()
        torch.cuda.synchronize()
        return {"refused": refused, "lsa_mismatched": int((path.region[:4096].cpu() != src).sum())}
    path.region[4096:].copy_(src.to(path.device))
    path.gin_put(0, 0, 4096, 4096)
    path.gin_wait(1)
    torch.cuda.synchronize()
    return {"gin_mismatched": int((path.region[:4096].cpu() != src).sum())}


@pytest.mark.gpu
@pytest.mark.skipif(bool(_missing(1)), reason=_missing(1) or "runs here")
def test_gin_puts_with_a_signal_or_is_refused_naming_what_it_needs():
    out = run_ranks(gin_body, 1, timeout=240)[0]
    if "refused" in out:  # no RDMA NIC for NCCL's GIN (the one-GPU machine has none)
        assert "ncclDevCommCreate with GIN (GIN needs an RDMA NIC" in out["refused"], out
        assert out["lsa_mismatched"] == 0
    else:
        assert out == {"gin_mismatched": 0}
