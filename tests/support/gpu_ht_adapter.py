"""Runs a backend='cuda' Buffer under the host-backend HT suite (deepep_workers.ht_body), which is written against
CPU tensors: arguments go to the GPU, results come back to the CPU after the device is synchronized (the kernels
run on the Buffer's communication stream, which async_finish=True leaves running), and handles map back to their
GPU originals."""

import torch


def _gpu(v):
    if isinstance(v, tuple):
        return tuple(_gpu(t) for t in v)
    return v.cuda() if torch.is_tensor(v) else v


def _cpu(v):
    if isinstance(v, tuple):
        return tuple(_cpu(t) for t in v)
    return v.cpu() if torch.is_tensor(v) else v


class CudaHTAdapter:
    def __init__(self, buf):
        self.buf = buf
        self._handles = {}  # id(CPU handle[0]) -> (GPU handle, CPU handle)

    def _gpu_handle(self, handle):
        return None if handle is None else self._handles[id(handle[0])][0]

    def _keep(self, handle):
        if handle is None:
            return None
        cpu = _cpu(handle)
        self._handles[id(cpu[0])] = (handle, cpu)
        return cpu

    def get_dispatch_layout(self, topk_idx, num_experts, **kw):
        res = self.buf.get_dispatch_layout(topk_idx.cuda(), num_experts, **kw)
        torch.cuda.synchronize()
        return _cpu(tuple(res[:4])) + (res[4],)

    def dispatch(self, x, handle=None, **kw):
        kw = {k: _gpu(v) for k, v in kw.items()}
        recv_x, idx, w, lst, h, event = self.buf.dispatch(_gpu(x), handle=self._gpu_handle(handle), **kw)
        torch.cuda.synchronize()
        return _cpu(recv_x), _cpu(idx), _cpu(w), lst, self._keep(h), event

    def combine(self, x, handle, topk_weights=None, bias=None, **kw):
        out, weights, event = self.buf.combine(
            x.cuda(), self._gpu_handle(handle), topk_weights=_gpu(topk_weights), bias=_gpu(bias), **kw
        )
        torch.cuda.synchronize()
        return _cpu(out), _cpu(weights), event

    def destroy(self):
        self.buf.destroy()
