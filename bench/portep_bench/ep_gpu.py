"""DeepEP V2's API (portep.ElasticBuffer) next to V1's (portep.Buffer) on one GPU, in one process: one rank (EP1),
every token to itself, DeepEP's shape (4096 tokens, hidden 7168, top-8, 256 experts), both APIs over the CUDA
backend with the same SMs (Buffer.num_sms), next to a device copy of the same bytes from the same run. What it tells:
V2's cost over V1 for the same rows (its layout, its metadata columns, its reduction at the source), and both
against the bytes' copy. What it does not: the network or NVLink (one rank has no peer; gpu-ht-loopback times the
kernels between two ranks). Also the memory rows: what each Buffer really takes from the GPU (cudaMemGetInfo around
its construction, in a process of its own) for this shape, V1 sized by DeepEP's hint, V2 by its get_buffer_size_hint;
and where V2's calls spend their time, by torch operation (op_profile.py).

Every output is checked against torch first. Samples in us: CUDA events around each call, which waits for the GPU
(calls with CPU sync wait for their counts on the host, as a user's call does). Bytes as DeepEP counts them: rows
received x hidden x 2 (BF16), the same rows for combine.
`python -m portep_bench gpu-ep [--sms 24] [--iterations 20]` (one of the one-GPU default modes)."""

import gc

import torch

from .ht_gpu import deepep_nvl_bytes, ht_inputs
from .ll_gpu import _timed
from .op_profile import op_table
from .report import MissingHardware, Table
from .spawn import one_rank_group, run_ranks

NOTE = (
    "one GPU, one process, EP1: every token goes to its own rank, so no peer and no network; V2 and V1 through "
    "the same kernels and SMs, and the device copy of the same bytes, in the same run. Samples in us, CUDA events "
    "around each call, which waits for the GPU (and, with CPU sync, for the counts on the host). GB/s at the "
    "median: rows received x hidden x 2, as DeepEP counts BF16 rows."
)


def _buffer_memory(rank, world, api, tokens, hidden, topk, v1_bytes):
    """In a process of its own (nothing freed earlier can come back during the measurement): the GPU memory one
    Buffer's construction takes (free device memory before and after, the CUDA context made first), and its size."""
    import portep
    import torch.distributed as dist

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    if api == "v1":
        buf = portep.Buffer(dist.group.WORLD, v1_bytes, 0, explicitly_destroy=True, backend="cuda")
        size = v1_bytes
    else:
        buf = portep.ElasticBuffer(
            dist.group.WORLD,
            num_max_tokens_per_rank=tokens,
            hidden=hidden,
            num_topk=topk,
            explicitly_destroy=True,
            backend="cuda",
        )
        size = buf.num_bytes  # get_buffer_size_hint for this group, as it sized itself
    torch.cuda.synchronize()
    taken = free_before - torch.cuda.mem_get_info()[0]
    buf.destroy()
    return taken, size


def _expect(ok, what):
    if not ok:
        raise AssertionError(f"gpu-ep: {what}")


def _v1_rows(buf, x, idx, w, E, iterations):
    layout = buf.get_dispatch_layout(idx, E)
    per_rank, per_node, per_expert, in_rank, _ = layout
    kw = dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_node,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
    )
    d = buf.dispatch(x, **kw)
    want = x[in_rank[:, 0]]
    _expect(torch.equal(d[0], want), "V1 dispatch: received rows differ from the tokens sent")
    handle = d[4]
    combined = buf.combine(d[0], handle, topk_weights=d[2])[0]
    _expect(torch.equal(combined[in_rank[:, 0]], want), "V1 combine: a token's one contribution differs")
    return {
        "rows": d[0].size(0),
        "V1 get_dispatch_layout": _timed(lambda: buf.get_dispatch_layout(idx, E), iterations),
        "V1 dispatch BF16 (count exchange, CPU sync)": _timed(lambda: buf.dispatch(x, **kw), iterations),
        "V1 cached dispatch BF16": _timed(lambda: buf.dispatch(x, handle=handle), iterations),
        "V1 combine BF16 (weights back)": _timed(lambda: buf.combine(d[0], handle, topk_weights=d[2]), iterations),
    }


def _v2_rows(buf, x, idx, w, E, iterations):
    selected = (idx >= 0).any(1)
    want = x[selected]
    d = buf.dispatch(x, idx, w, num_experts=E)
    _expect(torch.equal(d[0], want), "V2 dispatch: received rows differ from the tokens sent")
    combined = buf.combine(d[0], d[3], topk_weights=d[2])[0]
    _expect(torch.equal(combined[selected], want), "V2 combine: a token's one contribution differs")
    fixed = buf.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False)
    _expect(torch.equal(fixed[0][: want.size(0)], want), "V2 dispatch without CPU sync: received rows differ")
    fixed_back = buf.combine(fixed[0], fixed[3], topk_weights=fixed[2])[0]
    _expect(torch.equal(fixed_back[selected], want), "V2 combine after a dispatch without CPU sync differs")
    return {
        "V2 dispatch BF16 (CPU sync)": _timed(lambda: buf.dispatch(x, idx, w, num_experts=E), iterations),
        "V2 dispatch BF16, do_cpu_sync=False (worst-case rows)": _timed(
            lambda: buf.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False), iterations
        ),
        "V2 cached dispatch BF16": _timed(lambda: buf.dispatch(x, handle=d[3]), iterations),
        "V2 combine BF16 (weights back)": _timed(lambda: buf.combine(d[0], d[3], topk_weights=d[2]), iterations),
        "V2 combine BF16 after do_cpu_sync=False": _timed(
            lambda: buf.combine(fixed[0], fixed[3], topk_weights=fixed[2]), iterations
        ),
    }


def _v2_profile(buf, x, idx, w, E, shape):
    """The table of where one V2 dispatch and one combine spend their GPU time, by torch operation."""
    d = buf.dispatch(x, idx, w, num_experts=E)
    return op_table(
        f"gpu-ep: where a V2 call's GPU time goes, EP1, {shape}",
        [
            ("V2 dispatch", lambda: buf.dispatch(x, idx, w, num_experts=E)),
            ("V2 combine", lambda: buf.combine(d[0], d[3], topk_weights=d[2])),
        ],
        "cuda",
    )


def run(report, tokens=4096, hidden=7168, topk=8, experts=256, sms=24, iterations=20):
    """Prints the timing table, V2's operations and the memory table."""
    import portep
    from portep import native

    if not torch.cuda.is_available() or not native.build_info()["gpu_built"]:
        raise MissingHardware(
            f"gpu-ep needs a GPU and portep's GPU kernels; here: GPU visible {torch.cuda.is_available()}, kernels "
            f"built {native.build_info()['gpu_built']}"
        )
    torch.cuda.set_device(0)
    group = one_rank_group()
    portep.Buffer.set_num_sms(sms)
    shape = f"{tokens} tokens, hidden {hidden}, top-{topk}, {experts} experts"
    report.say(f"gpu-ep: EP1 on one GPU, {shape}, {sms} SMs (Buffer.num_sms, both APIs); {NOTE}")
    x, idx, w, _ = ht_inputs(0, tokens, hidden, topk, experts)
    w = w.float()
    v1_bytes = deepep_nvl_bytes(hidden, 2, sms)
    report.progress(f"gpu-ep: V1 Buffer ({v1_bytes} bytes, DeepEP's EP2 hint) and its checks")
    v1 = portep.Buffer(group, v1_bytes, 0, explicitly_destroy=True, backend="cuda")
    for _ in range(3):
        _v1_rows(v1, x, idx, w, experts, 1)
    report.progress("gpu-ep: V1 timings")
    res = _v1_rows(v1, x, idx, w, experts, iterations)
    v1.destroy()
    report.progress("gpu-ep: V2 ElasticBuffer (sized by its own hint) and its checks")
    v2 = portep.ElasticBuffer(
        group, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk, explicitly_destroy=True, backend="cuda"
    )
    for _ in range(3):
        _v2_rows(v2, x, idx, w, experts, 1)
    report.progress("gpu-ep: V2 timings")
    res.update(_v2_rows(v2, x, idx, w, experts, iterations))
    rows = res.pop("rows")
    nbytes = rows * hidden * 2
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = _timed(lambda: dst.copy_(src), iterations)
    t = Table(f"gpu-ep: V2 next to V1 on one GPU, EP1, {shape}, {sms} SMs, {rows} rows received", "us", NOTE)
    for what, samples in res.items():
        t.add(what, samples, None if "layout" in what else nbytes)
    t.add("baseline: device copy of the same bytes", copy, nbytes)
    report.add(t)
    report.progress("gpu-ep: V2's operations, profiled")
    report.add(_v2_profile(v2, x, idx, w, experts, shape))
    v2.destroy()
    report.progress("gpu-ep: the memory each Buffer takes, each in a process of its own")
    del v1, v2  # (free memory is the device's: nothing of this process may be released meanwhile)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    memory = {
        api: run_ranks(_buffer_memory, 1, args=(api, tokens, hidden, topk, v1_bytes), timeout=300)[0]
        for api in ("v1", "v2")
    }
    (v1_taken, _), (v2_taken, v2_hint) = memory["v1"], memory["v2"]
    m = Table(
        f"gpu-ep: GPU memory a Buffer takes, {shape}",
        "MiB",
        "Measured: free device memory (cudaMemGetInfo) before and after constructing each Buffer, each in a one-rank "
        "process of its own (after its CUDA context), next "
        "to the size each was asked for: V1 as DeepEP's users size it (its NVL hint for EP2 at this hidden size), "
        "V2 from its own get_buffer_size_hint for this group.",
    )
    mib = 1 << 20
    m.add(f"V1 Buffer, num_nvl_bytes {v1_bytes / mib:.1f} MiB: taken", [v1_taken / mib])
    m.add(f"V2 ElasticBuffer, size hint {v2_hint / mib:.1f} MiB: taken", [v2_taken / mib])
    if min(v1_taken, v2_taken) < 0:
        m.line("a negative figure: other work released GPU memory during that construction; it measures nothing")
    report.add(m)
    return res
