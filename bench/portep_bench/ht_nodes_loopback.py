"""Normal mode across nodes in one process (issue 34): 2 simulated nodes x 2 ranks (--nodes: more), each rank a
portep.Buffer on its own thread (portep_bench.thread_comm: DeepEP's `comm=` with mpi4py's three methods), all on one
GPU. Ranks of one node store into each other's buffers; between the nodes every token goes through the proxies (shm
transport: the kernels place the rows in the other node's memory, mapped in this process, and the proxies carry the
WRITE commands and signals in order). DeepEP's shape per rank (4096 tokens, hidden 7168, top-8, 256 experts), DeepEP's
test_internode.py config (Config(num_sms, 8, 512, 16, 128)) and its byte counting: RDMA bytes are the rank's tokens
times the nodes each goes to (its own node included) times the row bytes, NVL bytes the rows it receives times the row
bytes; combine counts the same bytes back. Rank 0's bytes, GB/s at the median. Every rank's blocks must run at once
(their kernels wait for each other), so only SM counts whose ranks' blocks all fit the GPU together run.

Timing: CUDA events from a common start, which a sleep on the GPU holds until every rank's thread has queued its
call, to the last rank's end (the CPU's launch time left out), next to a device copy of rank 0's NVL bytes by all
ranks at once in the same run. Every output is checked first: the received rows bitwise against the senders' rows
(each row names its source rank and token in three exact BF16 columns), FP8 rows and scales in the same order, and
the combined rows against the rows times the number of ranks each token went to (exact in BF16 here).
`python -m portep_bench gpu-ht-nodes [--sms 8 20] [--nodes 3]`, a default with one GPU. With backend='host' (tests)
the same ranks run on CPU tensors, timed by the wall clock."""

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import portep
from portep import config, native

from .ht_gpu import fp8_per_128
from .report import MissingHardware, Table
from .thread_comm import ThreadGroup, on_all_ranks

PER_NODE = 2
MAX_TOKENS = 64 * 256  # token // 64 and token % 64 stay exact in BF16 (integers up to 256)
HOLD_CYCLES = 20_000_000  # about 10 ms at H200 clocks: longer than four threads queueing their calls from Python
NOTE = (
    "simulated nodes x 2 ranks as threads of one process on one GPU; between the nodes through the proxies (shm "
    "transport, rows placed by the kernels in the other node's memory), inside a node direct stores. Rank 0's bytes "
    "as DeepEP's test_internode.py counts them: RDMA = tokens x nodes they go to (own node included) x row bytes, "
    "NVL = rows received x row bytes. Samples in us: CUDA events from a common start (every rank's call queued "
    "behind a GPU sleep) to the last rank's end. Baseline: a device copy of rank 0's NVL bytes by all ranks at "
    "once, same run."
)


def rank_inputs(rank, N, H, K, E, device):
    """Rank `rank`'s seeded tokens (BF16 [N, H]; columns 0..2 hold rank + 1, token // 64, token % 64, exact in
    BF16), top-k experts (int64 [N, K]), weights (float32 [N, K]) and the FP8 cast (float8_e4m3fn [N, H] with
    float32 [N, H // 128] scales)."""
    g = torch.Generator().manual_seed(3400 + rank)
    x = torch.randn(N, H, generator=g)
    tokens = torch.arange(N)
    x[:, 0], x[:, 1], x[:, 2] = rank + 1, (tokens // 64).float(), (tokens % 64).float()
    x = x.to(torch.bfloat16)
    idx = torch.topk(torch.randn(N, E, generator=g).abs() + 1, K, dim=-1).indices
    w = torch.rand(N, K, generator=g)
    fp8, scales = fp8_per_128(x)
    return [t.to(device) for t in (x, idx, w, fp8, scales)]


def deepep_bytes(inputs, recv_rows, H, E, nodes):
    """Rank 0's (RDMA, NVL) bytes of a BF16 dispatch, as DeepEP's test_internode.py counts them."""
    idx = inputs[0][1].cpu()
    to_node = torch.zeros(idx.size(0), nodes, dtype=torch.bool)
    to_node.scatter_(1, idx // (E // nodes), True)
    return int(to_node.sum()) * H * 2, recv_rows * H * 2


class Ranks:
    """The ranks' Buffers and what their calls share: a thread per rank; on the GPU each rank's calls run on its
    Buffer's communication stream, so that a rank's kernels use one stream of this process: CUDA maps streams onto
    CUDA_DEVICE_MAX_CONNECTIONS hardware queues in turn, a queue runs its commands in order, and where two ranks'
    streams share one, a kernel waiting for a peer's (the ranks' kernels wait for each other) can hold the peer's
    kernel queued behind it until the timeout."""

    def __init__(self, backend, transport, nbytes, timeout_s, num_ranks):
        self.num_ranks = R = num_ranks
        self.pool = ThreadPoolExecutor(R)
        self.gpu = backend == "cuda"
        group = self.group = ThreadGroup(R, timeout_s)
        self.streams = None

        def make(r):
            if self.gpu:
                torch.cuda.set_device(0)
            return portep.Buffer(
                None,
                nbytes[0],
                nbytes[1],
                comm=group.comm(r),
                num_ranks_per_node=PER_NODE,
                transport=transport,
                backend=backend,
                explicitly_destroy=True,
                timeout_s=timeout_s,
            )

        built = [None] * R

        def make_kept(r):
            built[r] = make(r)

        try:
            on_all_ranks(self.pool, make_kept, R, group)
        except BaseException:
            for b in built:  # those built before another rank failed: released here, not at exit
                if b is not None:
                    b.destroy()
            self.pool.shutdown()
            raise
        self.buffers = built
        if self.gpu:
            self.streams = [b.get_comm_stream() for b in built]

    def call(self, fn):
        """fn(rank, buffer) on every rank at once (on its stream, GPU); the results by rank."""

        def one(r):
            if not self.gpu:
                return fn(r, self.buffers[r])
            torch.cuda.set_device(0)
            with torch.cuda.stream(self.streams[r]):
                return fn(r, self.buffers[r])

        return on_all_ranks(self.pool, one, self.num_ranks, self.group)

    def timed(self, what, fn, iterations, held):
        """us per call of fn on all ranks at once, after 3 untimed; held: the calls that were queued after the GPU
        sleep had ended (their launch time is in the sample) are counted in held[0]. Raises TimeoutError naming `what`
        and the call when the ranks' work has not ended within the group's timeout."""
        times = []
        for i in range(iterations + 3):
            if not self.gpu:
                t0 = time.perf_counter()
                self.call(fn)
                times.append((time.perf_counter() - t0) * 1e6)
                continue
            start = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.streams[0]):
                torch.cuda._sleep(HOLD_CYCLES)
            start.record(self.streams[0])
            for s in self.streams[1:]:
                s.wait_event(start)
            ends = self.call(lambda r, b: (fn(r, b), _recorded(self.streams[r]))[1])
            held[0] += int(start.query())
            wait_events(ends, self.group.timeout_s, f"{what}, call {i + 1} of {iterations + 3}")
            times.append(max(start.elapsed_time(e) for e in ends) * 1e3)
        return times[3:]

    def destroy(self):
        """Releases every rank's Buffer (collectively) and the threads. Raises TimeoutError, leaving the Buffers to
        the process's exit, when the ranks' streams are still busy after the group's timeout (their kernels may still
        use the memory)."""
        try:
            if self.gpu:
                wait_events([_recorded(s) for s in self.streams], self.group.timeout_s, "the ranks' last work")
            self.call(lambda r, b: b.destroy())
        finally:
            self.pool.shutdown(wait=False)


def wait_events(events, timeout_s, what):
    """Waits for every CUDA event; TimeoutError naming `what` when one has not completed after timeout_s. Polls
    with sleeps, so this thread does not take a core from the proxies while it waits."""
    deadline = time.monotonic() + timeout_s
    for e in events:
        while not e.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gpu-ht-nodes: {what} has not ended after timeout_s={timeout_s} s")
            time.sleep(2e-4)


def _recorded(stream):
    e = torch.cuda.Event(enable_timing=True)
    e.record(stream)
    return e


def check_dispatch(recvs, inputs, in_rank, N):
    """Every rank received exactly the rows sent to it, bitwise (their order is the kernels'); returns each rank's
    (source ranks, source tokens) of its received rows, in their order."""
    xs = torch.stack([i[0].cpu() for i in inputs])
    R, order = len(inputs), []
    for d, recv in enumerate(recvs):
        recv = recv.cpu()
        ids = recv[:, :3].float().long()
        src, tok = ids[:, 0] - 1, ids[:, 1] * 64 + ids[:, 2]
        want = sorted(s * N + t for s in range(R) for t in torch.nonzero(in_rank[s][:, d])[:, 0].tolist())
        if sorted((src * N + tok).tolist()) != want:
            raise AssertionError(f"rank {d}: received {recv.size(0)} rows, not the {len(want)} sent to it")
        if not torch.equal(recv, xs[src, tok]):
            raise AssertionError(f"rank {d}: received rows differ from the rows sent")
        order.append((src, tok))
    return order


def check_fp8(recvs, order, inputs):
    """Every rank's FP8 rows and scales are the senders', in the order `order` gives (check_dispatch's)."""
    for d, ((fp8, scales), (src, tok)) in enumerate(zip(recvs, order)):
        want = torch.stack([i[3].cpu().view(torch.uint8) for i in inputs])[src, tok]
        want_scales = torch.stack([i[4].cpu() for i in inputs])[src, tok]
        if not torch.equal(fp8.cpu().view(torch.uint8), want) or not torch.equal(scales.cpu(), want_scales):
            raise AssertionError(f"rank {d}: FP8 rows or scales differ from the rows sent")


def check_combine(outs, inputs, in_rank):
    """Every rank's combined rows are its rows times the number of ranks each token went to (exact in BF16 here)."""
    for r, out in enumerate(outs):
        count = in_rank[r].sum(1, keepdim=True).float()
        want = (inputs[r][0].cpu().float() * count).to(torch.bfloat16)
        if not torch.equal(out.cpu(), want):
            raise AssertionError(f"rank {r}: combined rows differ from rows x ranks each token went to")


def fitting_sms(sms_list, gpu_sms, R):
    """The SM counts whose R ranks' data kernels and notifies fit the GPU at once."""
    lay = native.HTLayout(
        num_ranks=R, ranks_per_node=PER_NODE, proxy=True, ctrl_off=1 << 20, area_off=0, area_bytes=1 << 20
    )
    return [s for s in sms_list if R * (lay.blocks_per_channel * (s // 2) + 1) <= gpu_sms]


def run(
    report,
    sms_list=(20, 8),
    tokens=4096,
    hidden=7168,
    topk=8,
    experts=256,
    iterations=20,
    backend="cuda",
    transport="shm",
    timeout_s=60.0,
    nodes=2,
):
    """One table per SM count, with `nodes` simulated nodes of 2 ranks; backend='host' runs the same ranks on CPU
    tensors (tests). timeout_s bounds every wait: the Buffers' (kernels and proxies), the threads' exchanges and the
    benchmark's own for the ranks' work."""
    gpu = backend == "cuda"
    if nodes < 2:
        raise ValueError(f"nodes={nodes}: at least 2 (the benchmark is the path between nodes)")
    R = nodes * PER_NODE
    if experts % R:
        raise ValueError(f"experts={experts} must be a multiple of the {R} ranks ({nodes} nodes x {PER_NODE})")
    if gpu and (not torch.cuda.is_available() or not native.build_info()["cuda_built"]):
        raise MissingHardware("gpu-ht-nodes needs a CUDA GPU and portep's CUDA kernels (built with nvcc)")
    N, H, K, E = tokens, hidden, topk, experts
    if not 1 <= N <= MAX_TOKENS:
        raise ValueError(f"tokens={N} must be in 1..{MAX_TOKENS} (a row names its token in two BF16 columns)")
    if gpu:
        gpu_sms = torch.cuda.get_device_properties(0).multi_processor_count
        fitting = fitting_sms(sms_list, gpu_sms, R)
        if not fitting:
            raise MissingHardware(
                f"gpu-ht-nodes: none of the SM counts {list(sms_list)} fits {R} ranks' blocks in this GPU's "
                f"{gpu_sms} SMs at once"
            )
    else:
        fitting = list(sms_list)
    configs = {s: portep.Config(s, 8, 512, 16, 128) for s in fitting}
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in configs.values())
    rdma = max(c.get_rdma_buffer_size_hint(H * 2, R) for c in configs.values())
    report.say(
        f"gpu-ht-nodes: {nodes} nodes x {PER_NODE} ranks in one process ({backend}, transport {transport}), {N} "
        f"tokens per rank, hidden {H}, top-{K}, {E} experts, SMs per rank {fitting} "
        f"(left out: {sorted(set(sms_list) - set(fitting))}); Buffer of {nvl} NVL + {rdma} RDMA bytes"
    )
    device = "cuda" if gpu else "cpu"
    inputs = [rank_inputs(r, N, H, K, E, device) for r in range(R)]
    in_rank = []
    for i in inputs:
        m = torch.zeros(N, R, dtype=torch.bool)
        m.scatter_(1, i[1].cpu() // (E // R), True)
        in_rank.append(m)
    queues = os.environ.get(config.CUDA_CONNECTIONS_VAR, "8")
    if gpu and (not queues.isdigit() or int(queues) < config.CUDA_MAX_CONNECTIONS):
        report.say(
            f"gpu-ht-nodes: WARNING: {config.CUDA_CONNECTIONS_VAR}={queues} hardware queues for {R} ranks' streams: "
            f"two ranks' streams may share one and stall until the timeout (python -m portep_bench asks for "
            f"{config.CUDA_MAX_CONNECTIONS})"
        )
    ranks = Ranks(backend, transport, (nvl, rdma), timeout_s, R)
    try:
        for sms in fitting:
            report.add(_measure(report, ranks, inputs, in_rank, configs[sms], sms, (N, H, E, nodes), iterations))
    except BaseException as e:  # said before the Buffers' release, which may take the timeout again
        report.progress(f"gpu-ht-nodes: failed: {type(e).__name__}: {e}")
        raise
    finally:
        ranks.destroy()


def _measure(report, ranks, inputs, in_rank, cfg, sms, shape, iterations):
    N, H, E, nodes = shape
    R = ranks.num_ranks
    report.progress(f"gpu-ht-nodes: {sms} SMs: first dispatch and checks")

    def first(r, b):
        x, idx, w = inputs[r][:3]
        per_rank, per_rdma_rank, per_expert, is_in_rank, _ = b.get_dispatch_layout(idx, E)
        return b.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=is_in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=w,
            config=cfg,
        )

    results = ranks.call(first)
    if ranks.gpu:
        torch.cuda.synchronize()  # the ranks' streams: the checks read on this thread's
    handles = [res[4] for res in results]
    order = check_dispatch([res[0] for res in results], inputs, in_rank, N)
    rdma_bytes, nvl_bytes = deepep_bytes(inputs, results[0][0].size(0), H, E, nodes)
    fp8_factor = (1 + 4 / 128) / 2
    table = Table(
        f"gpu-ht-nodes: {sms} SMs per rank, {nodes} nodes x {PER_NODE} ranks, rank 0 receives "
        f"{results[0][0].size(0)} rows",
        "us",
        NOTE,
        extra_columns=("RDMA GB/s", "NVL GB/s"),
    )
    held = [0]
    recv_x = [res[0] for res in results]

    def add(what, samples, factor, rdma=True):
        med = statistics.median(samples) * 1e-6
        extra = {"NVL GB/s": f"{nvl_bytes * factor / med / 1e9:.1f}"}
        if rdma:
            extra["RDMA GB/s"] = f"{rdma_bytes * factor / med / 1e9:.1f}"
        table.add(what, samples, extra=extra)

    report.progress(f"gpu-ht-nodes: {sms} SMs: cached dispatch BF16 / FP8, combine")
    out = {}

    def cached(r, b):
        out[r] = b.dispatch(inputs[r][0], handle=handles[r], config=cfg)[0]

    add("dispatch BF16 (cached)", ranks.timed("dispatch BF16", cached, iterations, held), 1.0)
    check_dispatch([out[r] for r in range(R)], inputs, in_rank, N)

    def cached_fp8(r, b):
        out[r] = b.dispatch((inputs[r][3], inputs[r][4]), handle=handles[r], config=cfg)[0]

    add("dispatch FP8 (cached)", ranks.timed("dispatch FP8", cached_fp8, iterations, held), fp8_factor)
    check_fp8([out[r] for r in range(R)], order, inputs)

    def combine(r, b):
        out[r] = b.combine(recv_x[r], handles[r], config=cfg)[0]

    add("combine", ranks.timed("combine", combine, iterations, held), 1.0)
    check_combine([out[r] for r in range(R)], inputs, in_rank)
    if ranks.gpu:
        copy_src = [torch.empty(nvl_bytes, dtype=torch.uint8, device="cuda") for _ in range(R)]
        copy_dst = [torch.empty_like(s) for s in copy_src]
        add(
            "baseline: device copy of rank 0's NVL bytes (all ranks at once)",
            ranks.timed("device copy", lambda r, b: copy_dst[r].copy_(copy_src[r]), iterations, held),
            1.0,
            rdma=False,
        )
    if held[0]:
        table.line(f"WARNING: in {held[0]} timings the GPU's sleep ended before every call was queued")
    return table
