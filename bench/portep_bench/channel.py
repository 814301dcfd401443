"""Channel benchmark: command rate through the proxies and write+signal round-trip latency.

Every rank is a process on this host (host backend, host producers). Baselines from the same run: the FIFO
alone (same producer threads, no proxy or transport) for the rate, and a gloo send/recv ping-pong of the
same bytes for the latency.
"""

import time

from .spawn import run_ranks
from .stats import median, percentile, table


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


def _rank_body(rank, world, transport, threads, producers, messages, msg_bytes, signal_every, sizes, iterations):
    import torch.distributed as dist

    import portep
    import portep_testing

    nbytes = max(portep_testing.traffic_region_bytes(producers, messages, msg_bytes, world), 2 * max(sizes) + 4096)
    nbytes = (nbytes + 15) // 16 * 16
    out = {}
    with portep.Channel(None, nbytes, transport=transport, num_streams=max(producers, 1), num_proxy_threads=threads,
                        num_fifos=max(32, threads), seed=rank + 1) as ch:
        if rank == 0:
            fifo = portep_testing.fifo_selftest(producers, messages, 4096, 60.0)
            out["fifo_alone_rate"] = fifo["popped"] / fifo["seconds"]
        ch.barrier()
        r = portep_testing.run_producers(ch._native.native_handle, producers, messages, msg_bytes, signal_every, 1234)
        ch.barrier()
        out["commands"] = r["commands"]
        out["rate"] = r["commands"] / r["total_seconds"]
        out["latency"] = {}
        for size in sizes:
            base = int(ch.signals[1 - rank, 0]) & 0xFFFFFFFF if rank < 2 else 0
            ch.barrier()
            if rank < 2:
                lat = portep_testing.run_pingpong(ch._native.native_handle, 1 - rank, rank == 0, iterations, size, base, 60.0)
                if rank == 0:
                    out["latency"][size] = lat
            ch.barrier()
    out["gloo_latency"] = {}
    for size in sizes:
        if rank < 2:
            lat = _gloo_pingpong(rank, size, iterations)
            if rank == 0:
                out["gloo_latency"][size] = lat
        dist.barrier()
    return out


def run(ranks=4, transports=("shm", "shm-unordered"), threads=4, producers=4, messages=20000, msg_bytes=64,
        signal_every=8, sizes=(8, 4096), iterations=2000, printer=print):
    if ranks < 2:
        raise ValueError(f"ranks={ranks} must be >= 2 for the channel benchmark")
    printer(f"portep channel benchmark: host backend, {ranks} ranks (processes) on this host, {threads} proxy threads "
            f"and {producers} producer threads per rank, {messages} writes of <= {msg_bytes} B per producer to "
            f"random peers, a signal after 1 in {signal_every} writes; latency: {iterations} round trips rank 0 <-> 1")
    results = {}
    rate_rows, lat_rows = [], []
    for transport in transports:
        t0 = time.time()
        out = run_ranks(_rank_body, ranks, args=(transport, threads, producers, messages, msg_bytes, signal_every,
                                                 tuple(sizes), iterations), timeout=600)
        per_process = [out[r]["rate"] for r in range(ranks)]
        med = median(per_process)
        results[transport] = {"rate_per_process": per_process, "fifo_alone_rate": out[0]["fifo_alone_rate"],
                              "latency_ns": out[0]["latency"], "gloo_latency_ns": out[0]["gloo_latency"],
                              "wall_s": time.time() - t0}
        rate_rows.append([transport, f"{med / 1e6:.3f}", f"{med / threads / 1e6:.3f}",
                          f"{out[0]['fifo_alone_rate'] / 1e6:.2f}"])
        for size in sizes:
            lat, base = out[0]["latency"][size], out[0]["gloo_latency"][size]
            lat_rows.append([transport, size, f"{median(lat) / 1e3:.1f}", f"{percentile(lat, 99) / 1e3:.1f}",
                             f"{median(base) / 1e3:.1f}", f"{percentile(base, 99) / 1e3:.1f}"])
    printer("")
    printer(table(["transport", "M cmd/s per process (median)", "M cmd/s per proxy thread",
                   "baseline: FIFO alone, M cmd/s"], rate_rows))
    printer("")
    printer(table(["transport", "bytes", "write+signal RTT median us", "p99 us", "baseline: gloo send/recv RTT median us",
                   "p99 us"], lat_rows))
    return results
