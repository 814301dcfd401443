"""Checks that run inside the soft-RoCE guest (tests/verbs/guest_vm.py), without torch (too slow to import under TCG):
processes make native Channels on a verbs transport, exchange endpoint descriptions through a multiprocessing
manager, and run one scenario each. Prints one JSON line per scenario: {"name", "ranks": [per-rank results]}.

Scenarios: exact bytes of seeded writes + final signals; random writes+signals with a receiver that checks each
signal when it becomes visible (the channel traffic checker); a corrupted remote key that must come back as a
Python RuntimeError naming the failed completion. Over "verbs" (RC, native atomics), "verbs-striped"
(4 QPs per peer: unordered, signals emulated with immediates) and with the data region on emulated GPU memory
(signals then go through immediates): "verbs+gpu" (no dma-buf there, so the registration falls back to ibv_reg_mr
on the "device" pointer), "verbs+gpu-no-rdma" (device addresses no NIC can register, so the data region falls
back to host staging) and "verbs-striped+gpu-staged" (PORTEP_IB_GPUDIRECT=0: host staging without trying).
Also: incast under small per-QP in-flight caps (3 senders into one receiver, every byte and signal checked, the
caps seen deferring posts); a peer that never acknowledges (transport retry counter exceeded, naming the caps);
an unusable explicit PORTEP_IB_GID_INDEX; a pyverbs peer that shares no code with portep (verbs_foreign_peer.py).
"""

import json
import multiprocessing as mp
import os
import random
import re
import sys
import threading
import time
import traceback

import portep_testing
from verbs_foreign_peer import pyverbs_peer


EMULATED_GPU = -2  # the native kEmulatedDevice: host memory behind the transports' GPU-memory path
EMULATED_GPU_WITHOUT_RDMA = -3  # kEmulatedDeviceWithoutRdma: device addresses no NIC can register


def _channel(_C, rank, world, transport, nbytes, shared, barrier, tamper=None):
    # "<transport>+gpu...": the data region takes the GPU-memory path (registration chain, signals through
    # immediates, flush before publishing) on emulated device memory
    name, _, gpu = transport.partition("+")
    if gpu == "gpu-staged":
        os.environ["PORTEP_IB_GPUDIRECT"] = "0"  # this rank's process only
    device = {"": -1, "gpu-no-rdma": EMULATED_GPU_WITHOUT_RDMA}.get(gpu, EMULATED_GPU)
    ch = _C.Channel(
        rank=rank,
        num_ranks=world,
        nbytes=nbytes,
        transport=name,
        num_proxy_threads=2,
        num_fifos=8,
        fifo_capacity=4096,
        num_streams=8,
        max_inflight_cmds=256,
        max_inflight_bytes=1 << 24,
        timeout_s=30.0,
        unordered_window=64,
        seed=rank,
        skip_ordering=False,
        device=device,
    )
    shared[rank] = ch.endpoint_blob()
    barrier.wait()
    blobs = [shared[r] for r in range(world)]
    if tamper:
        blobs = tamper(rank, blobs)
    ch.connect(blobs)
    barrier.wait()
    ch.bootstrap_done()
    barrier.wait()
    return ch


def _pattern(src, dst, n):
    return random.Random(src * 1000 + dst).randbytes(n)


def exact_bytes(_C, rank, world, transport, shared, barrier):
    block = 4096
    ch = _channel(_C, rank, world, transport, 2 * world * block, shared, barrier)
    mem = memoryview(ch.data_view())
    for dst in range(world):
        mem[dst * block : (dst + 1) * block] = _pattern(rank, dst, block)
    for dst in range(world):
        for start in range(0, block, 1024):  # 4 writes per peer, then the final signal
            ch.write(dst, dst * block + start, world * block + rank * block + start, 1024, 1)
        ch.signal(dst, 1, True)
    slots = [ch.wait_signal(src, 1, 4, 30.0) for src in range(world)]
    ch.barrier()
    bad = [
        src for src in range(world) if bytes(mem[world * block + src * block :][:block]) != _pattern(src, rank, block)
    ]
    native, placement = ch.native_signals, ch.describe_peer(rank)
    ch.destroy()
    return {"mismatched_sources": bad, "slots": slots, "native_signals": native, "placement": placement}


def traffic(_C, rank, world, transport, shared, barrier):
    producers, messages, max_bytes, signal_every, seed = 3, 400, 256, 5, 7
    region = portep_testing.traffic_region_bytes(producers, messages, max_bytes, world)
    ch = _channel(_C, rank, world, transport, region, shared, barrier)
    result = {}

    def check():
        try:
            result["check"] = portep_testing.run_checker(
                ch.native_handle, producers, messages, max_bytes, signal_every, seed, 120.0
            )
        except Exception as exc:  # noqa: BLE001 - reported
            result["error"] = str(exc)

    t = threading.Thread(target=check)
    t.start()
    ch.barrier()
    produced = portep_testing.run_producers(ch.native_handle, producers, messages, max_bytes, signal_every, seed)
    t.join()
    ch.barrier()
    native, placement = ch.native_signals, ch.describe_peer(rank)
    delayed = sum(s["signals_delayed"] for s in ch.stats())
    ch.destroy()
    check = result.get("check", {})
    return {
        "error": result.get("error"),
        "violations": check.get("violations"),
        "messages_checked": check.get("messages_checked"),
        "streams_final": check.get("streams_final"),
        "commands": produced.get("commands"),
        "native_signals": native,
        "signals_delayed": delayed,
        "placement": placement,
    }


def _bad_rkey(rank, blobs):
    if rank != 0:
        return blobs
    lines = blobs[1].split(b"\n")
    addr, rkey, size = lines[2].split(b" ")
    lines[2] = b" ".join([addr, str((int(rkey) + 0x1234) & 0xFFFFFFFF).encode(), size])
    return blobs[:1] + [b"\n".join(lines)] + blobs[2:]


def bad_remote_key(_C, rank, world, transport, shared, barrier):
    ch = _channel(_C, rank, world, transport, 1 << 16, shared, barrier, tamper=_bad_rkey)
    message = ""
    if rank == 0:
        ch.write(1, 0, 0, 4096, 0)
        try:
            ch.quiet()
        except RuntimeError as exc:
            message = str(exc)
    barrier.wait()
    ch.destroy()
    return {"error": message}


INCAST_CAPS = {"PORTEP_IB_MAX_INFLIGHT_BYTES": "65536", "PORTEP_IB_MAX_INFLIGHT_MSGS": "2"}


def _incast_plan(src):
    """Sender src's writes to rank 0: (offset in src's slice, size, stream), mixed sizes and one above the cap."""
    rng = random.Random(src)
    sizes = [rng.choice([16, 48, 512, 1000, 4096, 9000, 30000, 64000]) for _ in range(60)]
    sizes.insert(rng.randrange(len(sizes)), 200000)  # larger than the byte cap: must go alone
    plan, off = [], 0
    for i, size in enumerate(sizes):
        plan.append((off, size, i % 4))
        off += (size + 15) // 16 * 16
    return plan


def _incast_bytes(src, off, n):
    return random.Random((src << 32) | off).randbytes(n)


def _final_slot(ch, src, stream, want, timeout=30.0):
    """The slot once it holds want (a final signal with no units of its own may follow the count), else its value."""
    slots = memoryview(ch.signal_view()).cast("Q")
    deadline = time.monotonic() + timeout
    while slots[src * 8 + stream] != want and time.monotonic() < deadline:
        time.sleep(0.001)
    return slots[src * 8 + stream]


def incast(_C, rank, world, transport, shared, barrier):
    os.environ.update(INCAST_CAPS)  # this rank's process only
    slice_bytes = 2 << 20
    ch = _channel(_C, rank, world, transport, world * slice_bytes, shared, barrier)
    mem = memoryview(ch.data_view())
    result = {}
    if rank:
        base = rank * slice_bytes
        units = [0] * 4
        for i, (off, size, stream) in enumerate(_incast_plan(rank)):
            mem[base + off : base + off + size] = _incast_bytes(rank, off, size)
            ch.write(0, base + off, base + off, size, stream)
            units[stream] += 1
            if i % 7 == 6:
                ch.signal(0, stream, False)
        for stream in range(4):
            ch.signal(0, stream, True)
        ch.quiet()
        described = ch.describe_peer(0)
        result = {"describe": described, "deferred": int(re.search(r"(\d+) posts deferred", described).group(1))}
    else:
        slots, bad = {}, []
        for src in range(1, world):
            plan = _incast_plan(src)
            for stream in range(4):
                units = sum(1 for _, _, s in plan if s == stream)
                ch.wait_signal(src, stream, units, 60.0)
                slots[f"{src}/{stream}"] = [_final_slot(ch, src, stream, units + (1 << 32)), units + (1 << 32)]
            base = src * slice_bytes
            bad += [
                [src, off]
                for off, size, _ in plan
                if bytes(mem[base + off : base + off + size]) != _incast_bytes(src, off, size)
            ]
        result = {"slots": slots, "bad": bad}
    ch.barrier()
    ch.destroy()
    return result


def _lost_qp(rank, blobs):
    """Rank 0 connects its QPs for rank 1 to QP numbers nobody has: its writes are never acknowledged."""
    if rank != 0:
        return blobs
    lines = blobs[1].split(b"\n")
    for c in range(2):
        lines[6 + c * 2] = str(0x7FFF00 + c).encode()
    return blobs[:1] + [b"\n".join(lines)] + blobs[2:]


def retry_exceeded(_C, rank, world, transport, shared, barrier):
    os.environ["PORTEP_IB_RETRY_CNT"] = "1"  # soft-RoCE retries forever at 7, real NICs 7 times
    ch = _channel(_C, rank, world, transport, 1 << 16, shared, barrier, tamper=_lost_qp)
    message, started = "", time.monotonic()
    if rank == 0:
        ch.write(1, 0, 0, 4096, 0)
        try:
            ch.quiet()
        except RuntimeError as exc:
            message = str(exc)
    barrier.wait()
    ch.destroy()
    return {"error": message, "seconds": round(time.monotonic() - started, 1)}


def bad_gid_index(_C, rank, world, transport, shared, barrier):
    os.environ["PORTEP_IB_GID_INDEX"] = "200"  # an empty entry of rxe's table
    try:
        _C.Channel(
            rank=0,
            num_ranks=1,
            nbytes=4096,
            transport=transport,
            num_proxy_threads=1,
            num_fifos=1,
            fifo_capacity=64,
            num_streams=1,
            max_inflight_cmds=8,
            max_inflight_bytes=1 << 20,
            timeout_s=5.0,
            unordered_window=8,
            seed=0,
            skip_ordering=False,
        )
        return {"error": None}
    except RuntimeError as exc:
        return {"error": str(exc)}


def _rank_main(fn, rank, world, transport, shared, barrier, out):
    try:
        from portep import _C

        out.put((rank, fn(_C, rank, world, transport, shared, barrier)))
    except Exception:  # noqa: BLE001 - reported
        out.put((rank, {"exception": traceback.format_exc()}))


def run(fn, transport, world=2, timeout=240):
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        shared = manager.dict()
        barrier = ctx.Barrier(world)
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, transport, shared, barrier, out)) for r in range(world)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        results = {}
        while len(results) < world and time.monotonic() - start < timeout:
            try:
                rank, value = out.get(timeout=1)
                results[rank] = value
            except Exception:  # noqa: BLE001 - queue.Empty
                if all(p.exitcode is not None for p in procs) and out.empty():
                    break
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        return [
            results.get(r, {"exception": "no result (timeout or crash)"}) for r in range(world)
        ], time.monotonic() - start


def main():
    scenarios = [
        ("exact_bytes", exact_bytes, "verbs"),
        ("traffic", traffic, "verbs"),
        ("exact_bytes", exact_bytes, "verbs-striped"),
        ("traffic", traffic, "verbs-striped"),
        ("exact_bytes", exact_bytes, "verbs+gpu"),
        ("traffic", traffic, "verbs+gpu"),
        ("exact_bytes", exact_bytes, "verbs+gpu-no-rdma"),
        ("traffic", traffic, "verbs+gpu-no-rdma"),
        ("exact_bytes", exact_bytes, "verbs-striped+gpu-staged"),
        ("traffic", traffic, "verbs-striped+gpu-staged"),
        ("bad_remote_key", bad_remote_key, "verbs"),
        ("incast", incast, "verbs", 4),
        ("incast", incast, "verbs-striped", 4),
        ("retry_exceeded", retry_exceeded, "verbs"),
        ("bad_gid_index", bad_gid_index, "verbs", 1),
        ("pyverbs_peer", pyverbs_peer, "verbs", 1),
        ("pyverbs_peer", pyverbs_peer, "verbs-striped", 1),
    ]
    only = sys.argv[1:]
    for name, fn, transport, *world in scenarios:
        if only and f"{name}/{transport}" not in only:
            continue
        ranks, seconds = run(fn, transport, *world)
        print(json.dumps({"name": f"{name}/{transport}", "ranks": ranks, "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
