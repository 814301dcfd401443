"""Runs a backend='cuda' Buffer under the host-backend LL suite (deepep_workers.ll_body), which is written
against CPU tensors: arguments go to the GPU, results come back to the CPU once they are final (after the receive
hook when there is one), and in-place outputs (stats, out=) are copied back. Handles keep their GPU originals. An
in-place CPU tensor has one GPU copy while any call that uses it is in flight: two hooked dispatches sent before
either receives both add to it, as they add to the one GPU tensor a DeepEP user passes."""

import torch


def _gpu(t):
    return None if t is None else t.cuda()


class _InPlace:
    """The GPU copies of in-place CPU tensors, each shared by the calls in flight with it."""

    def __init__(self):
        self._copies = {}  # id(CPU tensor) -> [the CPU tensor, its GPU copy, calls in flight]

    def take(self, t):
        """t's GPU copy for one more call (made from t when no call has it), or None for None."""
        if t is None:
            return None
        entry = self._copies.setdefault(id(t), [t, None, 0])
        if entry[2] == 0:
            entry[1] = t.cuda()
        entry[2] += 1
        return entry

    def release(self, entry, copy_back=True):
        """One call with entry's tensor ended: its GPU copy back into it (copy_back), the copy dropped after the
        last call."""
        if entry is None:
            return
        if copy_back:
            entry[0].copy_(entry[1])
        entry[2] -= 1
        if entry[2] == 0:
            del self._copies[id(entry[0])]


def _gpu_of(entry):
    return None if entry is None else entry[1]


class CudaLLAdapter:
    def __init__(self, buf):
        self.buf = buf
        self._handles = {}  # id(CPU src_info) -> the GPU handle
        self._in_place = _InPlace()

    def _synchronize(self):
        """Once the call's kernels finished: a kernel that failed raises here, as the next call would (the host
        suite reads results right away, which on GPUs a failed call leaves invalid)."""
        torch.cuda.current_stream().synchronize()
        self.buf.runtime.check_error()

    def low_latency_update_mask_buffer(self, rank, mask=False):
        self.buf.low_latency_update_mask_buffer(rank, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        status = mask_status.cuda()
        self.buf.low_latency_query_mask_buffer(status)
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self):
        self.buf.low_latency_clean_mask_buffer()

    def _gpu_handle(self, handle):
        return self._handles[id(handle[0])][0]

    def low_latency_dispatch(
        self,
        x,
        topk_idx,
        T,
        E,
        cumulative_local_expert_recv_stats=None,
        dispatch_wait_recv_cost_stats=None,
        return_recv_hook=False,
        **kw,
    ):
        stats = self._in_place.take(cumulative_local_expert_recv_stats)
        wait = self._in_place.take(dispatch_wait_recv_cost_stats)
        try:
            recv_x, recv_count, handle, event, hook = self.buf.low_latency_dispatch(
                x.cuda(),
                topk_idx.cuda(),
                T,
                E,
                cumulative_local_expert_recv_stats=_gpu_of(stats),
                dispatch_wait_recv_cost_stats=_gpu_of(wait),
                return_recv_hook=return_recv_hook,
                **kw,
            )
        except BaseException:
            self._in_place.release(stats, copy_back=False)
            self._in_place.release(wait, copy_back=False)
            raise
        gpu_parts = list(recv_x) if isinstance(recv_x, tuple) else [recv_x]
        cpu_parts = [torch.empty_like(t, device="cpu") for t in gpu_parts]
        cpu_count = torch.empty_like(recv_count, device="cpu")
        cpu_handle = (torch.empty_like(handle[0], device="cpu"), torch.empty_like(handle[1], device="cpu")) + tuple(
            handle[2:]
        )
        self._handles[id(cpu_handle[0])] = (handle, cpu_handle)

        def fetch():
            ok = False
            try:
                self._synchronize()
                for c, g in zip(cpu_parts, gpu_parts):
                    c.copy_(g)
                cpu_count.copy_(recv_count)
                cpu_handle[0].copy_(handle[0])
                cpu_handle[1].copy_(handle[1])
                ok = True
            finally:  # a failed call's stats are invalid: not copied back, and no copy is kept for later calls
                self._in_place.release(stats, copy_back=ok)
                self._in_place.release(wait, copy_back=ok)

        def cpu_hook():
            try:
                hook()
            except BaseException:
                self._in_place.release(stats, copy_back=False)
                self._in_place.release(wait, copy_back=False)
                raise
            fetch()

        if not return_recv_hook:
            fetch()
        out_x = tuple(cpu_parts) if isinstance(recv_x, tuple) else cpu_parts[0]
        return out_x, cpu_count, cpu_handle, event, (cpu_hook if return_recv_hook else None)

    def get_next_low_latency_combine_buffer(self, handle):
        return self.buf.get_next_low_latency_combine_buffer(self._gpu_handle(handle))

    def low_latency_combine(
        self,
        x,
        topk_idx,
        topk_weights,
        handle,
        out=None,
        combine_wait_recv_cost_stats=None,
        return_recv_hook=False,
        **kw,
    ):
        out_g, wait_g = _gpu(out), _gpu(combine_wait_recv_cost_stats)
        combined, event, hook = self.buf.low_latency_combine(
            x.cuda(),
            topk_idx.cuda(),
            topk_weights.cuda(),
            self._gpu_handle(handle),
            out=out_g,
            combine_wait_recv_cost_stats=wait_g,
            return_recv_hook=return_recv_hook,
            **kw,
        )
        result = out if out is not None else torch.empty_like(combined, device="cpu")

        def fetch():
            self._synchronize()
            result.copy_(combined)
            if wait_g is not None:
                combine_wait_recv_cost_stats.copy_(wait_g)

        def cpu_hook():
            hook()
            fetch()

        if return_recv_hook:
            # DeepEP's result tensor is only final after the hook: hand out the CPU tensor the hook fills.
            return result, event, cpu_hook
        fetch()
        return result, event, None

    def clean_low_latency_buffer(self, *args):
        self.buf.clean_low_latency_buffer(*args)

    def destroy(self):
        self.buf.destroy()
