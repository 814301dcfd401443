"""transport="nccl" on GPUs (transport/nccl/nccl_rma_engine.cpp): over an NCCL with the host one-sided API (2.29.2
and later) every rank writes a seeded block to every rank (itself included) in pieces through ncclPutSignal, signals
it, and each receiver compares what landed byte for byte and counts the signals; over an older NCCL (torch 2.11's
2.28.9 on the GPU machine) every rank's Channel is refused, naming the version found and the one needed. More ranks
than GPUs need NCCL 2.30.3 or later. The protocol itself runs in CI on the emulation (test_channel.py)."""

import pytest
import torch

import portep
from channel_workers import _cuts, _payload
from ci_expect import gpu_skip_reason
from dist_util import run_ranks
from portep import nccl_library

BLOCK = 1 << 16


def _missing(world):
    base = gpu_skip_reason(world)
    if not base.startswith("needs"):
        return base
    probe = nccl_library.probe()
    if probe["host_rma"] and world > torch.cuda.device_count() and int(probe["version"]) < 23003:
        return f"{base}: {world} ranks on {torch.cuda.device_count()} GPU(s) need NCCL >= 2.30.3 ({probe['summary']})"
    return ""


def writes_body(rank, world, seed):
    """Each rank writes _payload(seed, rank, dst) to every dst in _cuts pieces and signals each; returns the blocks
    that arrived wrong and the signal slots, or {"refused": the error} where the Channel could not be built."""
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    try:
        ch = portep.Channel(None, 2 * world * BLOCK, transport="nccl", device=device, num_streams=2, timeout_s=60)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"refused": f"{type(exc).__name__}: {exc}"}
    data = torch.as_tensor(ch.native_channel.device_data_lease(), device=f"cuda:{device}")
    for dst in range(world):
        data[dst * BLOCK : (dst + 1) * BLOCK] = _payload(seed, rank, dst, BLOCK).to(data.device)
    torch.cuda.synchronize()
    ch.barrier()
    for dst in range(world):
        cuts = _cuts(seed, rank, dst, BLOCK)
        for start, stop in zip([0] + cuts[:-1], cuts):
            ch.write(dst, dst * BLOCK + start, world * BLOCK + rank * BLOCK + start, stop - start, stream=1)
        ch.signal(dst, stream=1, final=True)
    expected = [len(_cuts(seed, src, rank, BLOCK)) for src in range(world)]
    for src in range(world):
        ch.wait_signal(src, 1, expected[src])
    ch.barrier()
    recv = data[world * BLOCK :].view(world, BLOCK).cpu()
    wrong = [src for src in range(world) if not torch.equal(recv[src], _payload(seed, src, rank, BLOCK))]
    slots = ch.signals[:, 1].tolist()
    ch.destroy()
    return {"wrong": wrong, "slots": slots, "expected": expected}


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
        assert r["wrong"] == [], (rank, r)
        for src, slot in enumerate(r["slots"]):
            assert slot & 0xFFFFFFFF == r["expected"][src] and slot >> 32 == 1, (rank, src, r)
