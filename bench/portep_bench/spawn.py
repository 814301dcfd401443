"""Spawn N ranks on this host with a gloo group, run a function in each, and collect results or errors.

The ranks meet through a file in a fresh temporary folder (torch's FileStore, as torch's own multi-process tests do),
not a TCP port: a port picked free here can be taken by another process before rank 0 listens on it (two test runs side
by side on the GPU machine failed that way with EADDRINUSE). Every run is bounded: a rank that does not report within
the timeout is killed and the caller fails. Each rank runs torch's CPU ops on one thread unless OMP_NUM_THREADS says
otherwise (as torchrun does). Used by the benchmarks and by the multi-process tests.
"""

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback


def free_port():
    """A TCP port free on this host now (another process may take it before it is used: only for a program that must
    be given a port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_group():
    """The default process group of this process alone (gloo, world size 1), made if there is none: its store lives in
    this process (torch's HashStore), so no port or file is taken."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _entry(fn, rank, world, store_file, args, results, env):
    os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # run_ranks' timeout asks for stacks
    import portep  # noqa: F401  (before torch sets CUDA up, as applications should: see portep/config.py)
    import torch
    import torch.distributed as dist

    if not os.environ.get("OMP_NUM_THREADS"):
        # One CPU thread per rank, as torchrun sets: ranks that each start an OpenMP team as wide as the machine (and
        # beside spinning proxy threads) wait a scheduler slice at every small op's barrier: on the 16-core GPU machine
        # the V2 decode tests' CPU references, seconds of work alone, did not finish in 300 s.
        torch.set_num_threads(1)

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        value = fn(rank, world, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - forwarded to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


class RankFailure(AssertionError):
    pass


def _check_exits(procs, reported, wait_s=60):
    """Ranks that returned their results must then exit without a crash: one killed by a signal on its way out
    (SIGSEGV, SIGABRT) fails the run. One still running after wait_s is left to run_ranks' cleanup."""
    for r in reported:
        procs[r].join(timeout=wait_s)
    crashed = {r: -procs[r].exitcode for r in reported if procs[r].exitcode is not None and procs[r].exitcode < 0}
    if crashed:
        raise RankFailure(
            f"ranks {sorted(crashed)} returned their results, then died on their way out (signals "
            f"{[crashed[r] for r in sorted(crashed)]})"
        )


def _dump_stacks(procs, ranks):
    """Asks each late rank for every thread's Python stack (faulthandler, on its stderr) before it is killed."""
    for r in sorted(ranks):
        if procs[r].is_alive():
            print(f"--- rank {r}: Python stacks at the timeout ---", file=sys.stderr, flush=True)
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(0.5)


def run_ranks(fn, world, args=(), timeout=180, env=None, expect_missing=()):
    """Runs fn(rank, world, *args) in `world` processes; returns {rank: value}.

    Ranks in expect_missing may die without reporting (used by crash tests). Any other rank that raises or
    does not report within `timeout` seconds fails the call with its traceback, and so does one that reported and
    then died by a signal as it exited. A late rank prints its threads' Python stacks to stderr before it is killed.
    PORTEP_RANK_TIMEOUT_S, where set, replaces `timeout` (a shorter bound on a machine where a hang is suspected).
    """
    if os.environ.get("PORTEP_RANK_TIMEOUT_S"):
        timeout = float(os.environ["PORTEP_RANK_TIMEOUT_S"])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="portep-ranks-")
    store_file = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, store_file, args, results, dict(env or {})), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out, errors = {}, {}
    waiting = set(range(world)) - set(expect_missing)
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while waiting:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                _dump_stacks(procs, waiting)
                done = "".join(f"\n--- rank {r} (finished with an error) ---\n{tb}" for r, tb in sorted(errors.items()))
                raise RankFailure(
                    f"ranks {sorted(waiting)} did not finish within {timeout} s (their Python stacks are on "
                    f"stderr){done}"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r in waiting if procs[r].exitcode not in (None, 0)]
                if dead:
                    raise RankFailure(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
                continue
            waiting.discard(rank)
            (out if status == "ok" else errors)[rank] = value
        if errors:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        _check_exits(procs, [r for r in out if r not in expect_missing])
        return out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
