"""transport="nccl" on GPUs (transport/nccl/nccl_rma_engine.cpp): over an NCCL with the host one-sided API (2.29.2
and later) every rank writes a seeded block to every rank (itself included) in pieces through ncclPutSignal, signals
it, and each receiver compares what landed byte for byte and counts the signals (channel_workers.python_api); over an
older NCCL (torch 2.11's 2.28.9 on the GPU machine) every rank's Channel is refused, naming the version found and the
one needed. More ranks than GPUs need NCCL 2.30.3 or later. The protocol itself runs in CI on the emulation
(test_channel.py)."""

import pytest
import torch

import channel_workers as w
from ci_expect import gpu_skip_reason
from dist_util import run_ranks
from portep import nccl_library


def _missing(world):
    base = gpu_skip_reason(world)
    if not base.startswith("needs"):
        return base
    probe = nccl_library.probe()
    if probe["host_rma"] and world > torch.cuda.device_count() and int(probe["version"]) < 23003:
        return f"{base}: {world} ranks on {torch.cuda.device_count()} GPU(s) need NCCL >= 2.30.3 ({probe['summary']})"
    return ""


def writes_body(rank, world, seed):
    """channel_workers.python_api over transport="nccl" on this rank's GPU, or {"refused": the error}."""
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    try:
        return w.python_api(rank, world, "nccl", seed, device)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"refused": f"{type(exc).__name__}: {exc}"}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_transport_moves_bytes_exactly_or_names_the_nccl_it_needs(world):
    if _missing(world):
        pytest.skip(_missing(world))
    probe = nccl_library.probe()
    out = run_ranks(writes_body, world, args=(5,), timeout=300)
    if not probe["host_rma"]:
        for rank in range(world):
            msg = out[rank].get("refused") or ""
            assert "needs NCCL >= 2.29.2" in msg and f"NCCL {probe['version_text']}" in msg, (rank, out[rank])
        return
    for rank in range(world):
        r = out[rank]
        assert "refused" not in r, (rank, r)
        assert r["mismatches"] == [], (rank, r)
        for src, slot in enumerate(r["slots"]):
            assert slot & 0xFFFFFFFF == r["expected"][src] and slot >> 32 == 1, (rank, src, r)
