"""Per-rank bodies for the multi-process channel tests (module-level so spawn can import them)."""

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import portep
import portep_testing
from shm_probe import mapped_segments, named_segments, shared_memfds
from portep import _C


def leftover_shm(pids, mapped_here=False):
    """What of portep's shared memory outlives its moment (shm_probe.py): names in /dev/shm, memfds the pids still
    hold open for peers, and with mapped_here, every portep segment this process still maps."""
    left = [n for pid in pids for n in named_segments(pid)]
    left += [f"{pid}: open {name}" for pid in pids for name in shared_memfds(pid)]
    if mapped_here:
        left += sorted(mapped_segments())
    return left


def traffic(
    rank,
    world,
    transport,
    producers,
    messages,
    max_bytes,
    signal_every,
    seed,
    threads,
    skip_ordering=False,
    window=48,
    device=None,
):
    """Producers push random writes+signals to random peers; a checker validates each signal on arrival.
    device="emulated": the data region takes the GPU path of the transport (copies on worker threads)."""
    nbytes = portep_testing.traffic_region_bytes(producers, messages, max_bytes, world)
    ch = portep.Channel(
        None,
        nbytes,
        transport=transport,
        num_streams=producers,
        num_proxy_threads=threads,
        num_fifos=8 * threads,
        timeout_s=60,
        seed=seed + rank,
        unordered_window=window,
        device=device,
        _skip_ordering=skip_ordering,
    )
    shm_while_running = leftover_shm([os.getpid()])
    result = {}

    def check():
        try:
            result["check"] = portep_testing.run_checker(
                ch._native.native_handle, producers, messages, max_bytes, signal_every, seed, 90.0
            )
        except Exception as exc:  # noqa: BLE001 - re-raised on the main thread
            result["error"] = exc

    checker = threading.Thread(target=check)
    checker.start()
    ch.barrier()
    produced = portep_testing.run_producers(
        ch._native.native_handle, producers, messages, max_bytes, signal_every, seed
    )
    checker.join()
    if "error" in result:
        raise result["error"]
    ch.barrier()
    stats = ch.stats()
    native = ch.native_signals
    ch.destroy()
    return {
        "check": result["check"],
        "produced": produced,
        "stats": stats,
        "native_signals": native,
        "shm_while_running": shm_while_running,
        "shm_after_destroy": leftover_shm([os.getpid()], mapped_here=True),
        "live_threads": _C.live_proxy_threads(),
    }


def _payload(seed, src, dst, nbytes):
    g = torch.Generator().manual_seed(seed * 1_000_003 + src * 1009 + dst)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _cuts(seed, src, dst, block):
    """Split points (multiples of 16, ending at block) of the block src sends to dst."""
    g = torch.Generator().manual_seed(seed + src * 31 + dst)
    chunks = int(torch.randint(1, 6, (1,), generator=g))
    inner = {int(c) // 16 * 16 for c in torch.randint(16, block, (chunks - 1,), generator=g)}
    return sorted(inner - {0}) + [block]


def _data(ch, device):
    """The Channel's data memory as a uint8 tensor: its host view, or on a GPU the device memory itself."""
    if device in (None, "emulated"):
        return ch.buffer
    return torch.as_tensor(ch.native_channel.device_data_lease(), device=f"cuda:{device}")


def python_api(rank, world, transport, seed, device=None):
    """Each rank writes a seeded random block to every peer with write_signal; receivers compare with a
    torch reference regenerated from the seed, and check the slot counts and final marks. device: None, "emulated"
    or a CUDA device (the data is then GPU memory)."""
    block = 4096
    ch = portep.Channel(
        None,
        2 * world * block,
        transport=transport,
        num_streams=2,
        num_proxy_threads=2,
        timeout_s=30,
        seed=seed,
        device=device,
    )
    data = _data(ch, device)
    send = data[: world * block].view(world, block)
    for dst in range(world):
        send[dst] = _payload(seed, rank, dst, block).to(data.device)
    if data.is_cuda:
        torch.cuda.synchronize()
    ch.barrier()
    for dst in range(world):
        cuts = _cuts(seed, rank, dst, block)
        for start, stop in zip([0] + cuts[:-1], cuts):
            ch.write(dst, dst * block + start, world * block + rank * block + start, stop - start, stream=1)
        ch.signal(dst, stream=1, final=True)
    expected = [len(_cuts(seed, src, rank, block)) for src in range(world)]
    for src in range(world):
        ch.wait_signal(src, 1, expected[src])
    ch.barrier()
    recv = data[world * block :].view(world, block).cpu()
    mismatches = [src for src in range(world) if not torch.equal(recv[src], _payload(seed, src, rank, block))]
    slots = ch.signals[:, 1].tolist()
    ch.destroy()
    return {"mismatches": mismatches, "slots": slots, "expected": expected}


def latched_transport_error(rank, world):
    """Rank 1 registers less memory than rank 0 writes into: rank 0's proxy fails, and the next call raises."""
    ch = portep.Channel(None, 1 << 20 if rank == 0 else 1 << 16, transport="shm", timeout_s=10)
    ch.barrier()
    out = {}
    if rank == 0:
        ch.write(1, 0, 1 << 19, 64)
        try:
            ch.quiet()
            out["raised"] = None
        except RuntimeError as exc:
            out["raised"] = str(exc)
        ch.destroy()
        out["live_threads"] = _C.live_proxy_threads()
    dist.barrier()
    if rank == 1:
        ch.destroy()
    return out


def peer_killed(rank, world, victim, timeout_s):
    """The victim kills itself mid-run; survivors must raise within timeout_s, then tear down cleanly."""
    ch = portep.Channel(None, 1 << 16, transport="shm-unordered", timeout_s=timeout_s, num_proxy_threads=2)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    ch.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(8):
        ch.write((rank + 1) % world, 0, 1024, 256, stream=0)
        ch.signal(victim, stream=0)
    errors = {}
    for name, call in (("wait_signal", lambda: ch.wait_signal(victim, 0, 1)), ("barrier", ch.barrier)):
        t0 = time.monotonic()
        try:
            call()
            errors[name] = (None, time.monotonic() - t0)
        except RuntimeError as exc:
            errors[name] = (str(exc), time.monotonic() - t0)
    ch.destroy()
    return {"errors": errors, "pids": pids, "live_threads": _C.live_proxy_threads()}


def peer_left_then_exited(rank, world, timeout_s):
    """Rank 1 announces that it left, waits until that is delivered, and ends its process at once; rank 0 watches
    its status for a while past the moment the process is gone: it must stay "left" (the announced cause), not
    turn into "process gone". Returns rank 0's statuses in the order seen."""
    ch = portep.Channel(
        None, 1 << 16, transport="shm", timeout_s=timeout_s, num_proxy_threads=1, num_streams=16, status_stream=8
    )
    ch.barrier()
    if rank == 1:
        ch.announce(_C.EVENT_LEFT)
        ch.quiet()
        os._exit(0)
    seen, deadline = [], time.monotonic() + 1.5  # the process check runs every 50 ms
    while time.monotonic() < deadline:
        status = ch.peer_status(1)
        if not seen or seen[-1] != status:
            seen.append(status)
        time.sleep(0.005)
    ch.destroy()
    return {"seen": seen}


def refusal(rank, world, transport, device):
    """What building a Channel on `transport` raised ("ExceptionType: message"), or None when it was built."""
    try:
        ch = portep.Channel(None, 1 << 16, transport=transport, device=device, timeout_s=30)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    ch.destroy()
    return None


def proxy_count_mismatch(rank, world, transport):
    """Rank r runs r + 1 proxy threads: what building the Channel raised ("ExceptionType: message"), or None."""
    try:
        ch = portep.Channel(None, 1 << 16, transport=transport, num_proxy_threads=rank + 1, timeout_s=30)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    ch.destroy()
    return None
