"""Run-time settings shared by the Python layer: timeouts, transport choice and proxy spinning from the
environment."""

import os
import sys
from typing import Optional, Sequence, Tuple

DEFAULT_TIMEOUT_S = 100.0
# nccl: NCCL's one-sided API on GPU memory (NCCL >= 2.29.2; refused natively, naming what is missing, where it cannot
# run). nccl-emulated: the same transport's protocol over an emulation of that API in shared memory (host memory only;
# for tests, and to try the protocol where no NCCL >= 2.29.2 or no GPU is).
TRANSPORTS = ("shm", "shm-unordered", "verbs", "verbs-striped", "nccl", "nccl-emulated")


DEFAULT_GPU_PROXY_SPIN_US = 1000.0
# GPU proxies share the host's cores with the ranks' own threads, which spin in CUDA synchronizations and waits: a rank
# gets at most 4 proxy threads and no more than its share of the cores less one for itself. Where even one each leaves
# more spinning threads than cores (many ranks time-sharing one GPU, as the one-GPU conformance runs have 16 or 32), an
# idle proxy spins only this long: a command then waits for a wake-up instead of for the scheduler to give a spinning
# proxy a core, which under that load took milliseconds a hop.
SHARED_HOST_PROXY_SPIN_US = 20.0
MAX_GPU_PROXY_THREADS = 4


def _env_number(name, unit):
    """The environment variable as a float, None when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit}") from None


def timeout_from_env(explicit: Optional[float] = None) -> float:
    """The explicit value if given, else PORTEP_TIMEOUT_S, else 100 s."""
    if explicit is not None:
        value = float(explicit)
        source = "timeout_s"
    else:
        value = _env_number("PORTEP_TIMEOUT_S", "seconds")
        if value is None:
            return DEFAULT_TIMEOUT_S
        source = "PORTEP_TIMEOUT_S"
    if not value > 0:
        raise ValueError(f"{source}={value} must be > 0 seconds")
    return value


def proxy_spin_us_from_env(explicit: Optional[float], on_gpu: bool) -> float:
    """How long an idle proxy busy-polls: the explicit value, else PORTEP_PROXY_SPIN_US, else 1000 us on a GPU
    (a sleeping proxy adds its wake-up to every hop of a kernel's command) and 0 on the host (spinning threads
    take the CPUs the ranks need)."""
    value = explicit if explicit is not None else _env_number("PORTEP_PROXY_SPIN_US", "microseconds")
    if value is None:
        value = DEFAULT_GPU_PROXY_SPIN_US if on_gpu else 0.0
    if not 0 <= value <= 1e6:
        raise ValueError(f"idle_spin_us={value} must be within [0, 1e6] microseconds")
    return float(value)


def gpu_proxy_plan(cores: int, ranks_on_host: int) -> Tuple[int, Optional[float]]:
    """(proxy threads per rank, idle spin in microseconds) for one of `ranks_on_host` GPU ranks sharing `cores`;
    the spin is None (the default, or PORTEP_PROXY_SPIN_US when set) unless the host is oversubscribed."""
    if cores < 1 or ranks_on_host < 1:
        raise ValueError(f"cores={cores} and ranks_on_host={ranks_on_host} must be >= 1")
    threads = max(1, min(MAX_GPU_PROXY_THREADS, cores // ranks_on_host - 1))
    oversubscribed = ranks_on_host * (threads + 1) > cores
    spin = SHARED_HOST_PROXY_SPIN_US if oversubscribed and "PORTEP_PROXY_SPIN_US" not in os.environ else None
    return threads, spin


def group_proxy_plan(hosts: Sequence[Tuple[str, Sequence[int]]], rank: int) -> Tuple[int, Optional[float]]:
    """Rank `rank`'s (proxy threads, idle spin) from every rank's (host key, affinity CPUs): a host's cores are the
    union of its ranks' masks (a launcher that binds each rank to its share leaves the host's total), and every rank
    runs the fewest threads any host allows, since the transports pair channels by index; the spin is its host's."""
    ranks, cpus = {}, {}
    for key, mask in hosts:
        ranks[key] = ranks.get(key, 0) + 1
        cpus.setdefault(key, set()).update(mask)
    plans = {key: gpu_proxy_plan(max(1, len(cpus[key])), ranks[key]) for key in ranks}
    return min(t for t, _ in plans.values()), plans[hosts[rank][0]][1]


def transport_from_env(explicit: Optional[str] = None) -> str:
    """The transport a Buffer or Channel uses: `explicit`, else $PORTEP_TRANSPORT, else "shm"; checked."""
    name = explicit if explicit is not None else os.environ.get("PORTEP_TRANSPORT", "shm")
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r} is not available; choose one of {', '.join(TRANSPORTS)}")
    return name


# The proxy path between GPUs of one host (shm on GPU memory): by default the kernels store a proxy peer's bytes
# into its memory themselves and the proxies carry only the notifications (placed WRITEs), making no CUDA call.
# PORTEP_GPU_PROXY_COPIES=1 makes the kernels stage the bytes and the proxies copy them with the copy engines from
# their own streams, as for a NIC: then anything that holds this process's CUDA calls while a receive waits stalls
# the proxies until the kernels' timeout (a copy to or from pageable memory such as .item(), a kernel's first launch
# under lazy module loading), and so does a proxy stream that shares a hardware queue with a kernel's stream.
PROXY_COPIES_VAR = "PORTEP_GPU_PROXY_COPIES"


def proxy_copies() -> bool:
    """Whether PORTEP_GPU_PROXY_COPIES=1 asks for copy-engine copies on the shm proxy path between GPUs."""
    return os.environ.get(PROXY_COPIES_VAR, "0") == "1"


# With proxy copies: CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default); a proxy copy
# that shares the queue of the stream running an LL kernel waits behind that kernel, which waits for the copy, until
# the kernel's timeout. Seen on the H200 machine: the CUDA-graph test over shm-unordered hung in 2 or 3 of 4 attempts
# with the default and in none of 4 with 32. CUDA reads the variable when it creates a context, so with proxy copies
# asked for portep asks for the most queues at import, unless the application chose a number or torch has already
# set CUDA up. Without them portep leaves the variable alone.
CUDA_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
CUDA_MAX_CONNECTIONS = 32


def _cuda_already_initialized():
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 (a partly imported torch): assume the worst
        return True


def widen_cuda_connections() -> Optional[str]:
    """Set CUDA_DEVICE_MAX_CONNECTIONS to 32 when unset and CUDA is not set up yet; returns why it was not."""
    if CUDA_CONNECTIONS_VAR in os.environ:
        return f"{CUDA_CONNECTIONS_VAR}={os.environ[CUDA_CONNECTIONS_VAR]} was set by the application"
    if _cuda_already_initialized():
        return "torch had set up CUDA before portep was imported"
    os.environ[CUDA_CONNECTIONS_VAR] = str(CUDA_MAX_CONNECTIONS)
    return None


CUDA_CONNECTIONS_NOTE = widen_cuda_connections() if proxy_copies() else f"{PROXY_COPIES_VAR} is not set"


def check_gpu_copy_connections(what: str) -> None:
    """Raise where the proxies' copies would surely queue behind the LL kernels (one hardware queue); warn where
    they may (fewer than 32 queues)."""
    if CUDA_CONNECTIONS_NOTE is None:
        return
    raw = os.environ.get(CUDA_CONNECTIONS_VAR)
    try:
        value = int(raw) if raw is not None else 8
    except ValueError:
        value = 8
    if value < 2:
        raise ValueError(
            f"{what} copies on the copy engines from the proxy threads' streams, but "
            f"{CUDA_CONNECTIONS_VAR}={raw} puts every stream in one hardware queue, where those copies "
            f"wait behind the LL kernels that wait for them (a hang until the timeout); set it to "
            f"{CUDA_MAX_CONNECTIONS} before CUDA starts, or give every peer the direct path"
        )
    if value < CUDA_MAX_CONNECTIONS:
        import warnings

        warnings.warn(
            f"{what}: {CUDA_CONNECTIONS_NOTE}, so CUDA uses {value} hardware queues; a proxy copy that "
            f"shares one with the LL kernel's stream waits behind the kernel and the call times out. Set "
            f"{CUDA_CONNECTIONS_VAR}={CUDA_MAX_CONNECTIONS} before CUDA starts (importing portep first does)",
            RuntimeWarning,
            stacklevel=3,
        )


LL_GRAPH_LAUNCH_VAR = "PORTEP_LL_GRAPH_LAUNCH"


def ll_graph_launch() -> bool:
    """Whether eager low-latency calls on the CUDA backend launch as cached CUDA graphs (PORTEP_LL_GRAPH_LAUNCH,
    default 1; gpu_kernels/cuda/graph_cache.h): half a kernel launch's host time, about 0.3 us more GPU time per
    round trip."""
    raw = os.environ.get(LL_GRAPH_LAUNCH_VAR, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{LL_GRAPH_LAUNCH_VAR}={raw!r} must be 0 or 1")
    return raw == "1"
