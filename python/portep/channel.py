"""The low-level channel API: a registered byte buffer on every rank of a group, and one-sided transfers
between them through the proxies (write / signal / quiet / barrier).

Each rank owns `nbytes` of data memory and `num_ranks * num_streams` 64-bit signal slots. A signal on stream s
adds, to slot (sender, s) at the destination, the number of writes of stream s the sender issued to that
destination since its previous signal there; it becomes visible only after those writes are in place, on
every transport (ordered ones natively, unordered ones through the ordering protocol). A final signal also
adds 2**32, so `slot >> 32` counts finished streams.
"""

import atexit
import weakref
from typing import TYPE_CHECKING, Any, Optional, Union

from ._native import require_native
from .bootstrap import all_gather_objects, collective_step, group_rank_and_size
from .config import DEFAULT_TIMEOUT_S, proxy_spin_us_from_env, timeout_from_env, transport_from_env
from .nccl_library import wheel_candidates

if TYPE_CHECKING:  # torch is imported where a view is made (a Channel needs no torch otherwise)
    import torch

__all__ = ["Channel", "DEFAULT_TIMEOUT_S"]


def _device_code(device):
    if device is None:
        return -1
    if device == "emulated":
        return -2
    return _check_int("device", device, 0, 1 << 16)


def _check_int(name, value, low, high):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value} must be in {low}..{high}")
    return value


# Channels not yet destroyed. At interpreter exit (atexit, registered with the first Channel, so that it runs before
# the handlers of modules imported earlier, torch's among them) their proxy threads are stopped and their regions
# released: a Channel whose owner never called destroy() (a worker that raised, a Buffer with explicitly_destroy=True
# left alive) would otherwise keep threads polling FIFOs in mapped memory while the CUDA runtime frees it as the
# process ends (the likely cause of the SIGSEGV on the way out seen on the GPU machine after a worker raised).
_live_channels = weakref.WeakSet()
_exit_hook = []


def _destroy_live_channels():
    for channel in list(_live_channels):
        try:
            channel.destroy()
        except Exception:  # noqa: BLE001 - the process is ending; nothing to raise to
            pass


def _track(channel):
    if not _exit_hook:
        atexit.register(_destroy_live_channels)
        _exit_hook.append(True)
    _live_channels.add(channel)


class Channel:
    """Registered memory on every rank of `group` plus the proxies that move it.

    Args:
        group: torch.distributed process group (None: the default group) or an mpi4py communicator. Construction is
            collective.
        nbytes: bytes of data memory per rank (multiple of 16, at most 64 GiB).
        transport: "shm" (ordered, native atomics) or "shm-unordered" (delivers in a seeded random order
            within `unordered_window` operations, no atomics, like EFA SRD); "verbs" (RC, one QP per peer) or
            "verbs-striped" (several QPs per peer, unordered) on an RDMA device; "nccl" (NCCL's one-sided API,
            ncclPutSignal into registered windows, on GPU memory; NCCL >= 2.29.2, found at run time) or
            "nccl-emulated" (the same protocol over an emulation of that API in shared memory; host memory only).
            Default: $PORTEP_TRANSPORT or "shm".
        num_streams: signal slots per source rank (<= 8192 on unordered transports).
        num_proxy_threads, num_fifos, fifo_capacity: the command path (each stream maps to one FIFO).
        max_inflight_cmds, max_inflight_bytes: per proxy thread caps.
        timeout_s: every wait raises after this long (default $PORTEP_TIMEOUT_S or 100 s).
        seed: seeds the unordered transport's delivery order.
        device: CUDA device ordinal: the data memory is GPU memory of that device (shared through CUDA IPC, moved
            by the proxies with copy-engine copies); None: host memory; "emulated": host memory behind the same
            GPU path (copies on worker threads, some delayed), to test that path without a GPU.
        device_fifos: a native DeviceFifoSet whose FIFOs kernels push into, served by the proxy threads.
        status_stream: the first of three streams whose slots carry the ranks' status events (a refused call, a
            failed call, a Buffer destroyed): a thread watches them and the peers' processes, and every wait on a
            peer that will not answer gives up at once (proxy/peer_watch.h). None: no watch.
        idle_spin_us: how long an idle proxy thread busy-polls before it yields and sleeps (default
            $PORTEP_PROXY_SPIN_US, else 1000 on a CUDA device, where a sleeping proxy adds its wake-up time to
            every hop of a kernel's command, and 0 on the host, where spinning threads take the CPUs the ranks
            need).
    """

    def __init__(
        self,
        group: Optional["torch.distributed.ProcessGroup"] = None,
        nbytes: int = 1 << 20,
        *,
        transport: Optional[str] = None,
        num_streams: int = 64,
        num_proxy_threads: int = 4,
        num_fifos: int = 32,
        fifo_capacity: int = 4096,
        max_inflight_cmds: int = 512,
        max_inflight_bytes: int = 64 << 20,
        timeout_s: Optional[float] = None,
        unordered_window: int = 64,
        seed: int = 0,
        device: Union[int, str, None] = None,
        device_fifos: object = None,
        idle_spin_us: Optional[int] = None,
        status_stream: Optional[int] = None,
        _skip_ordering: bool = False,
    ) -> None:
        native = require_native()
        self.group = group
        self.rank, self.num_ranks = group_rank_and_size(group)
        align = native.OFFSET_ALIGN
        _check_int("nbytes", nbytes, align, 64 << 30)
        if nbytes % align:
            raise ValueError(f"nbytes={nbytes} must be a multiple of {align}")
        self.nbytes = nbytes
        self.transport = transport_from_env(transport)
        self.timeout_s = timeout_from_env(timeout_s)
        # Ordered transports with atomics need no immediates (the native layer re-checks against the device).
        stream_limit = native.MAX_STREAMS if self.transport in ("shm", "verbs") else native.IMM_MAX_STREAMS
        self.num_streams = _check_int("num_streams", num_streams, 1, stream_limit)
        _check_int("num_proxy_threads", num_proxy_threads, 1, 64)
        _check_int("num_fifos", num_fifos, num_proxy_threads, 4096)
        _check_int("fifo_capacity", fifo_capacity, 64, 1 << 20)
        if fifo_capacity & (fifo_capacity - 1):
            raise ValueError(f"fifo_capacity={fifo_capacity} must be a power of two")
        _check_int("max_inflight_cmds", max_inflight_cmds, 1, 1 << 20)
        _check_int("max_inflight_bytes", max_inflight_bytes, 1, 1 << 40)
        _check_int("unordered_window", unordered_window, 1, 1 << 16)
        _check_int("num_ranks", self.num_ranks, 1, native.MAX_RANKS)
        self._native = native.Channel(
            rank=self.rank,
            num_ranks=self.num_ranks,
            nbytes=nbytes,
            transport=self.transport,
            num_proxy_threads=num_proxy_threads,
            num_fifos=num_fifos,
            fifo_capacity=fifo_capacity,
            num_streams=num_streams,
            max_inflight_cmds=max_inflight_cmds,
            max_inflight_bytes=max_inflight_bytes,
            timeout_s=self.timeout_s,
            unordered_window=unordered_window,
            seed=seed,
            skip_ordering=_skip_ordering,
            device=_device_code(device),
            idle_spin_us=proxy_spin_us_from_env(idle_spin_us, isinstance(device, int) and not isinstance(device, bool)),
            status_stream=-1
            if status_stream is None
            else _check_int("status_stream", status_stream, 0, num_streams - native.NUM_STATUS_EVENTS),
            nccl_libraries=wheel_candidates() if self.transport == "nccl" else [],
        )
        self.device = device
        _track(self)
        try:
            if device_fifos is not None:  # kernels push into these; the proxies serve them with the host FIFOs
                self._native.attach_device_fifos(device_fifos.host_views, device_fifos.count)
            blobs = all_gather_objects(self._native.endpoint_blob(), group)
            collective_step(lambda: self._native.connect(blobs), group, "channel connect")
            # Everyone has mapped everyone: names can go, proxies can start.
            collective_step(self._native.bootstrap_done, group, "channel start")
        except BaseException:
            self._native.destroy()
            raise
        self._buffer = None
        self._signals = None

    @property
    def native_channel(self) -> Any:
        """The native channel (portep._C.Channel) this object wraps, for the backends' engines, which hand it to the
        native kernels' owners (None if construction failed)."""
        return getattr(self, "_native", None)

    # ---- memory ----
    @property
    def buffer(self) -> "torch.Tensor":
        """This rank's data memory as a torch.uint8 tensor (a view: valid until destroy()); host channels only."""
        if self.device not in (None, "emulated"):
            raise RuntimeError(f"this Channel's data is GPU memory (device {self.device}); it has no host view")
        if self._buffer is None:
            import torch

            self._buffer = torch.frombuffer(self._live().data_view(), dtype=torch.uint8)
        return self._buffer

    @property
    def signals(self) -> "torch.Tensor":
        """This rank's signal slots as an int64 tensor [num_ranks, num_streams] (a view)."""
        if self._signals is None:
            import torch

            flat = torch.frombuffer(self._live().signal_view(), dtype=torch.int64)
            self._signals = flat.view(self.num_ranks, self.num_streams)
        return self._signals

    # ---- transfers ----
    def write(self, dst: int, local_offset: int, remote_offset: int, nbytes: int, stream: int = 0) -> None:
        """Copy nbytes from this rank's buffer at local_offset to dst's buffer at remote_offset."""
        self._check_peer("dst", dst)
        self._check_range(local_offset, remote_offset, nbytes)
        self._check_stream(stream)
        self._live().write(dst, local_offset, remote_offset, nbytes, stream)

    def signal(self, dst: int, stream: int = 0, final: bool = False) -> None:
        """Make dst's slot (this rank, stream) count the writes issued on stream since the last signal."""
        self._check_peer("dst", dst)
        self._check_stream(stream)
        self._live().signal(dst, stream, bool(final))

    def write_signal(
        self, dst: int, local_offset: int, remote_offset: int, nbytes: int, stream: int = 0, final: bool = False
    ) -> None:
        """write() then signal() on the same stream."""
        self.write(dst, local_offset, remote_offset, nbytes, stream)
        self.signal(dst, stream, final)

    def quiet(self) -> None:
        """Wait until every command pushed so far has completed at the transport."""
        self._live().quiet()

    def barrier(self) -> None:
        """quiet() on every rank, then synchronize all ranks through the proxies."""
        self._live().barrier()

    def wait_signal(self, src: int, stream: int, count: int, timeout_s: Optional[float] = None) -> int:
        """Wait until slot (src, stream) counts at least `count` writes; returns the slot's value."""
        self._check_peer("src", src)
        self._check_stream(stream)
        _check_int("count", count, 0, (1 << 32) - 1)
        timeout = timeout_from_env(timeout_s) if timeout_s else self.timeout_s
        return self._live().wait_signal(src, stream, count, timeout)

    def check_error(self) -> None:
        """Raise the error a proxy thread latched, if any."""
        self._live().check_error()

    def stats(self) -> dict:
        """The proxies' counters (commands, bytes, waits) as a dict."""
        return self._live().stats()

    def announce(self, kind: int) -> None:
        """Tell every rank, this one included, of a status event of this rank's (native.EVENT_REFUSED / FAILED /
        LEFT); needs status_stream."""
        self._live().announce(kind)

    def peer_status(self, peer: int) -> int:
        """native.PEER_OK while `peer` answers, else PEER_REFUSED / PEER_LEFT / PEER_GONE (see status_stream)."""
        self._check_peer("peer", peer)
        return self._live().peer_status(peer)

    def status_events(self, src: int, kind: int) -> int:
        """How many events of `kind` rank `src` announced so far."""
        self._check_peer("src", src)
        return self._live().status_events(src, kind)

    @property
    def placed_writes(self) -> bool:
        """True when a producer may store a WRITE's bytes into a mapped peer region itself and post the WRITE
        placed (the transport then carries only its notification, and on GPUs the proxies make no CUDA call)."""
        return self._live().transport_placed_writes

    @property
    def native_signals(self) -> bool:
        """True when signals are native atomics on an ordered transport; False when emulated with immediates."""
        return self._live().native_signals

    # ---- lifetime ----
    def destroy(self) -> None:
        """Stop the proxies and unmap every region. Tensors from buffer/signals must not be used afterwards."""
        self._buffer = None
        self._signals = None
        if getattr(self, "_native", None) is not None:
            self._native.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # ---- validation ----
    def _live(self):
        if getattr(self, "_native", None) is None or not self._native.alive:
            raise RuntimeError("this Channel was destroyed")
        return self._native

    def _check_peer(self, name, rank):
        _check_int(name, rank, 0, self.num_ranks - 1)

    def _check_stream(self, stream):
        _check_int("stream", stream, 0, self.num_streams - 1)

    def _check_range(self, local_offset, remote_offset, nbytes):
        native = require_native()
        _check_int("nbytes", nbytes, 0, native.MAX_CMD_BYTES)
        for name, off in (("local_offset", local_offset), ("remote_offset", remote_offset)):
            _check_int(name, off, 0, self.nbytes)
            if off % native.OFFSET_ALIGN:
                raise ValueError(f"{name}={off} must be a multiple of {native.OFFSET_ALIGN} bytes")
            if off + nbytes > self.nbytes:
                raise ValueError(f"{name}={off} + nbytes={nbytes} exceeds the channel's nbytes={self.nbytes}")
