"""Channel benchmark: command rate through the proxies and write+signal round-trip latency.

Every rank is a process on this host (host backend, host producers). Baselines from the same run: the FIFO
alone (same producer threads, no proxy or transport) for the rate, and a gloo send/recv ping-pong of the
same bytes for the latency.
"""

import time

from .ep import EMULATION
from .report import Table
from .spawn import run_ranks
from .stats import median

FIFO_ALONE_REPEATS = 3


def _gloo_pingpong(rank, nbytes, iterations):
    import torch
    import torch.distributed as dist

    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    lat = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
            lat.append((time.perf_counter() - t0) * 1e9)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return lat


def _rank_body(
    rank, world, transport, threads, producers, messages, msg_bytes, signal_every, sizes, iterations, progress
):
    import torch.distributed as dist

    import portep
    import portep_testing

    say = progress if rank == 0 else (lambda what: None)
    nbytes = max(portep_testing.traffic_region_bytes(producers, messages, msg_bytes, world), 2 * max(sizes) + 4096)
    nbytes = (nbytes + 15) // 16 * 16
    out = {}
    with portep.Channel(
        None,
        nbytes,
        transport=transport,
        num_streams=max(producers, 1),
        num_proxy_threads=threads,
        num_fifos=max(32, threads),
        seed=rank + 1,
    ) as ch:
        if rank == 0:
            say(f"channel {transport}: baseline, the FIFO alone ({FIFO_ALONE_REPEATS} runs)")
            runs = [portep_testing.fifo_selftest(producers, messages, 4096, 60.0) for _ in range(FIFO_ALONE_REPEATS)]
            out["fifo_alone_rates"] = [f["popped"] / f["seconds"] for f in runs]
        ch.barrier()
        say(f"channel {transport}: {producers} producers per rank push {messages} writes each")
        r = portep_testing.run_producers(ch._native.native_handle, producers, messages, msg_bytes, signal_every, 1234)
        ch.barrier()
        out["commands"] = r["commands"]
        out["rate"] = r["commands"] / r["total_seconds"]
        out["latency"] = {}
        for size in sizes:
            say(f"channel {transport}: {iterations} write+signal round trips of {size} B")
            base = int(ch.signals[1 - rank, 0]) & 0xFFFFFFFF if rank < 2 else 0
            ch.barrier()
            if rank < 2:
                lat = portep_testing.run_pingpong(
                    ch._native.native_handle, 1 - rank, rank == 0, iterations, size, base, 60.0
                )
                if rank == 0:
                    out["latency"][size] = lat
            ch.barrier()
    out["gloo_latency"] = {}
    for size in sizes:
        say(f"channel {transport}: baseline, {iterations} gloo send/recv round trips of {size} B")
        if rank < 2:
            lat = _gloo_pingpong(rank, size, iterations)
            if rank == 0:
                out["gloo_latency"][size] = lat
        dist.barrier()
    return out


def run(
    report,
    ranks=4,
    transports=("shm", "shm-unordered"),
    threads=4,
    producers=4,
    messages=20000,
    msg_bytes=64,
    signal_every=8,
    sizes=(8, 4096),
    iterations=2000,
):
    if ranks < 2:
        raise ValueError(f"ranks={ranks} must be >= 2 for the channel benchmark")
    setup = (
        f"{ranks} ranks (processes) on this host, {threads} proxy threads and {producers} producer threads per "
        f"rank, {messages} writes of <= {msg_bytes} B per producer to random peers, a signal after 1 in "
        f"{signal_every} writes; latency: {iterations} round trips rank 0 <-> 1"
    )
    report.say(f"channel: {setup}; {EMULATION}")
    rates = Table(
        f"channel: command rate, {ranks} ranks, {threads} proxy threads per rank",
        "M cmd/s",
        f"{EMULATION}. {setup}. Samples: each process's commands per second (median over the processes "
        f"= the old single figure); baseline: the FIFO alone (same producer threads, no proxy or transport), "
        f"{FIFO_ALONE_REPEATS} runs on rank 0.",
        extra_columns=("M cmd/s per proxy thread at median",),
    )
    latency = Table(
        f"channel: write+signal round trip, ranks 0 <-> 1 of {ranks}",
        "us",
        f"{EMULATION}. Samples: {iterations} round trips of a write with a signal, rank 0 <-> 1; "
        "baseline: gloo send/recv of the same bytes, same run.",
        p99=True,
    )
    for transport in transports:
        report.progress(f"channel {transport}: starting {ranks} rank processes")
        out = run_ranks(
            _rank_body,
            ranks,
            args=(
                transport,
                threads,
                producers,
                messages,
                msg_bytes,
                signal_every,
                tuple(sizes),
                iterations,
                report.progress,
            ),
            timeout=600,
        )
        per_process = [out[r]["rate"] / 1e6 for r in range(ranks)]
        rates.add(
            f"{transport}, per process",
            per_process,
            extra={"M cmd/s per proxy thread at median": f"{median(per_process) / threads:.3f}"},
        )
        rates.add(f"baseline: FIFO alone ({transport} run)", [v / 1e6 for v in out[0]["fifo_alone_rates"]])
        for size in sizes:
            latency.add(f"{transport}, {size} B", [v / 1e3 for v in out[0]["latency"][size]])
            latency.add(
                f"baseline: gloo send/recv, {size} B ({transport} run)", [v / 1e3 for v in out[0]["gloo_latency"][size]]
            )
    report.add(rates)
    report.add(latency)
