"""Rank body of the LL fast path's GPU test (tests/gpu/test_gpu_ll_fast_path.py): the fast path's outputs against
the full Python path's on the same inputs, bit for bit, for every dispatch flag combination, zero-copy and out=
combines; calls it must hand to the full path, which refuses them on every rank, after which it takes calls again;
a dropped expert index reported through it as a DroppedInput carrying the results."""

import torch
import torch.distributed as dist

import portep

BF16 = torch.bfloat16
FLAGS = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
COMBINES = [(False, False), (True, False), (False, True)]  # (zero_copy, out=)


class CountingFastPath:
    """Counts the native fast-path calls that launched and those that declined (then the full path ran)."""

    def __init__(self, fast):
        self.taken = self.declined = 0
        for name in ("_dispatch", "_combine"):
            setattr(fast, name, self._counted(getattr(fast, name)))

    def _counted(self, call):
        def counted(*args):
            out = call(*args)
            if out is None:
                self.declined += 1
            else:
                self.taken += 1
            return out

        return counted


class Calls:
    def __init__(self, buf, T, E, x, idx, weights, y):
        self.buf, self.T, self.E, self.x, self.idx, self.weights, self.y = buf, T, E, x, idx, weights, y

    def round_trip(self, flags, zero_copy=False, with_out=False, idx=None):
        """Every output of one dispatch + combine, copied (FP8 as bytes)."""
        use_fp8, round_scale, use_ue8m0 = flags
        idx = self.idx if idx is None else idx
        recv_x, count, handle, _, _ = self.buf.low_latency_dispatch(self.x, idx, self.T, self.E, use_fp8=use_fp8,
                                                                    round_scale=round_scale, use_ue8m0=use_ue8m0)
        if zero_copy:
            self.buf.get_next_low_latency_combine_buffer(handle)[:] = self.y
        out = torch.empty(self.x.shape, dtype=BF16, device="cuda") if with_out else None
        combined = self.buf.low_latency_combine(self.y, idx, self.weights, handle, zero_copy=zero_copy, out=out)[0]
        if with_out and combined is not out:
            raise AssertionError("combine with out= returned another tensor")
        torch.cuda.current_stream().synchronize()
        return _valid_parts(recv_x if use_fp8 else (recv_x, None), count, handle, combined)

    def dispatch_then_combine(self, idx):
        """An FP8 round trip that goes on with a DroppedInput's results, as a caller must; the DroppedInputs."""
        dropped = []
        try:
            dispatched = self.buf.low_latency_dispatch(self.x, idx, self.T, self.E, use_fp8=True)
        except portep.DroppedInput as e:
            dropped.append(e)
            dispatched = e.results
        try:
            self.buf.low_latency_combine(self.y, idx, self.weights, dispatched[2])
        except portep.DroppedInput as e:
            dropped.append(e)
        return dropped

    def on_both_paths(self, **kwargs):
        fast, self.buf._ll_fast = self.buf._ll_fast, None
        full = self.round_trip(**kwargs)
        self.buf._ll_fast = fast
        self.round_trip(**kwargs)  # a new signature: the full path checks it and marks it for the fast path
        return full, self.round_trip(**kwargs)


def _valid_parts(recv, count, handle, combined):
    """What a dispatch + combine defines: per local expert its first count[e] slots of recv_x, scales and
    src_info (the rest of those tensors is never written), layout_range, the counts and the combined rows."""
    data, scales = recv
    parts = [count.clone(), handle[1].clone(), combined.clone()]
    for e, n in enumerate(count.tolist()):
        parts.append((data[e, :n].view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data[e, :n]).clone())
        parts.append(handle[0][e, :n].clone())
        if scales is not None:
            parts.append(scales[e, :n].clone())
    return parts


def _setup(rank, world, rpn, transport, seed, T, H, E, K):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = portep.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, num_ranks_per_node=rpn,
                        transport=transport, timeout_s=60, explicitly_destroy=True, backend="cuda")
    if buf._ll_fast is None:
        raise AssertionError(f"the fast path is off: {buf.ll_fast_path_off}")
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T - 3, H, generator=g).to(BF16)  # fewer tokens than T, as DeepEP's tests send
    idx = torch.topk(torch.rand(T - 3, E, generator=g), K, dim=1).indices
    idx[torch.rand(T - 3, K, generator=g) < 0.1] = -1  # dropped selections, as masked routing makes
    weights = torch.rand(T - 3, K, generator=g)
    y = torch.randn(E // world, world * T, H, generator=g).to(BF16)
    return Calls(buf, T, E, x.cuda(), idx.cuda(), weights.cuda(), y.cuda())


def _refused(call, expect):
    try:
        call()
    except (TypeError, ValueError) as e:
        return None if expect in str(e) else f"refused, but the message lacks {expect!r}: {e}"
    return f"accepted a call that must be refused ({expect})"


def fast_path_body(rank, world, rpn, transport, seed, T, H, E, K):
    calls = _setup(rank, world, rpn, transport, seed, T, H, E, K)
    counter = CountingFastPath(calls.buf._ll_fast)
    errors = []
    for flags in FLAGS:
        for zero_copy, with_out in COMBINES:
            full, fast = calls.on_both_paths(flags=flags, zero_copy=zero_copy, with_out=with_out)
            for i, (a, b) in enumerate(zip(full, fast)):
                if not torch.equal(a, b):
                    errors.append(f"flags {flags}, zero_copy {zero_copy}, out {with_out}: output {i} differs")
    runs = len(FLAGS) * len(COMBINES)
    if counter.taken < 2 * runs:  # at least each case's last round trip (dispatch and combine) went the fast way
        errors.append(f"the fast path launched {counter.taken} calls, expected at least {2 * runs}")

    taken = counter.taken
    x, idx = calls.x, calls.idx
    bad = {"x has dtype": lambda: calls.buf.low_latency_dispatch(x.float(), idx, T, E),
           "topk_idx has dtype": lambda: calls.buf.low_latency_dispatch(x, idx.int(), T, E),
           "num_max_dispatch_tokens_per_rank": lambda: calls.buf.low_latency_dispatch(x, idx, float(T), E)}
    errors += [e for e in (_refused(call, expect) for expect, call in bad.items()) if e]
    if counter.taken != taken:
        errors.append(f"the fast path launched {counter.taken - taken} of the {len(bad)} bad calls")
    again = calls.round_trip(FLAGS[1])  # refused everywhere, then settled: the Buffer is in step
    if any(not torch.equal(a, b) for a, b in zip(again, calls.round_trip(FLAGS[1]))):
        errors.append("round trips after the refusals differ")

    bad_idx = idx.clone()
    if rank == 0:
        bad_idx[0, 0] = E + 5
    dropped = calls.dispatch_then_combine(bad_idx)
    torch.cuda.current_stream().synchronize()
    dropped += calls.dispatch_then_combine(idx)  # a notice comes with the call that finds it: this one at the latest
    expected = 1 if rank == 0 else 0
    if len(dropped) != expected or any(str(E + 5) not in str(e) or e.results is None for e in dropped):
        errors.append(f"rank {rank}: expected {expected} DroppedInput naming expert {E + 5}, got {dropped}")
    calls.buf.destroy()
    return errors
