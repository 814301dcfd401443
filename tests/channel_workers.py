"""Per-rank bodies for the multi-process channel tests (module-level so spawn can import them)."""

import os
import threading

import portep
from portep import _C


def traffic(rank, world, transport, producers, messages, max_bytes, signal_every, seed, threads, skip_ordering=False):
    """Producers push random writes+signals to random peers; a checker validates each signal on arrival."""
    nbytes = _C.traffic_region_bytes(producers, messages, max_bytes, world)
    ch = portep.Channel(None, nbytes, transport=transport, num_streams=max(producers, 1), num_proxy_threads=threads,
                        num_fifos=8 * threads, timeout_s=60, seed=seed + rank, unordered_window=48,
                        _skip_ordering=skip_ordering)
    result = {}

    def check():
        result["check"] = _C.run_checker(ch._native, producers, messages, max_bytes, signal_every, seed, 90.0)

    checker = threading.Thread(target=check)
    checker.start()
    ch.barrier()
    produced = _C.run_producers(ch._native, producers, messages, max_bytes, signal_every, seed)
    checker.join()
    ch.barrier()
    stats = ch.stats()
    native = ch.native_signals
    ch.destroy()
    return {"check": result.get("check"), "produced": produced, "stats": stats, "native_signals": native,
            "leftover_shm": leftover_shm()}


def leftover_shm():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"portep.{os.getpid()}."))
