"""The low-latency calls' hot path on the CUDA backend: one native call per phase (portep._ll_torch) that checks
the call against a signature the full path validated, allocates the outputs and launches the kernels. Anything it
does not take (a new signature, async_finish, a receive hook, shrink mode, a Buffer that failed or is out of step)
goes the full way through Buffer's checks and CudaEngine, which give the same results more slowly.

portep._ll_torch links libtorch, so it loads only under the torch it was built against (build_info's
ll_fast_path_torch), and is not used where torch's CUDA allocator was swapped for another (it calls torch's own
directly); `PORTEP_LL_FAST_PATH=0` turns it off."""

import os

import torch

from ...event import EventOverlap

FAST_PATH_VAR = "PORTEP_LL_FAST_PATH"
TORCH_ALLOCATORS = ("native", "cudaMallocAsync")  # torch's own, chosen at start (PYTORCH_CUDA_ALLOC_CONF)


def fast_path_module(native):
    """(portep._ll_torch or None, why not)."""
    if os.environ.get(FAST_PATH_VAR, "1") == "0":
        return None, f"{FAST_PATH_VAR}=0"
    info = native.build_info()
    built_for = info.get("ll_fast_path_torch", "")
    if not built_for:
        return None, f"not built: {info.get('ll_fast_path_reason') or 'unknown reason'}"
    if built_for != torch.__version__:
        return None, f"built against torch {built_for}, this is torch {torch.__version__}: rebuild portep"
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a build of torch without CUDA or ROCm
        return None, "this torch has no GPU support (no torch._C._cuda_getCurrentRawStream)"
    backend = torch.cuda.get_allocator_backend()
    if backend not in TORCH_ALLOCATORS:  # the fast path allocates from the one torch registered for CUDA at start
        return None, (f"torch's CUDA allocator is {backend!r} (torch.cuda.memory.change_current_allocator), not "
                      f"one of {TORCH_ALLOCATORS}, and the fast path allocates from torch's own")
    try:
        from ... import _ll_torch
    except (ImportError, OSError) as e:  # e.g. a libtorch that differs under the same version string
        return None, f"portep._ll_torch does not load: {e}"
    return _ll_torch, ""


class LLFastPath:
    """One per CUDA Buffer in low-latency mode without shrink. dispatch()/combine() return the call's results, or
    None when the full path must take the call (nothing happened then)."""

    def __init__(self, engine, module):
        self._engine = engine
        self._kernels = engine.kernels  # owns the plan table the native calls read
        self._table = engine.kernels.table_address
        self._lockstep = engine.lockstep
        self._dispatch, self._combine = module.dispatch, module.combine

    # Each Python call costs a noticeable part of a call's budget (tens of nanoseconds against a few microseconds),
    # so the lockstep's checks are read inline here: a broken Buffer or a refusal that its peers have not matched yet
    # goes the full way, and a launched call counts as Lockstep.made_call says. The native calls raise RuntimeError
    # only once they tried the launch (anything before it declines); the sequence number is lockstep.wire_seq's. They
    # launch on torch's current stream when the Buffer's GPU is the current one, and decline otherwise.
    def dispatch(self, x, topk_idx, T, E, cumulative_stats, wait_stats, use_fp8, round_scale, use_ue8m0):
        ls = self._lockstep
        if ls.broken is not None or ls._refused != ls._resolved:
            return None
        try:
            out = self._dispatch(self._table, x, topk_idx, T, E, cumulative_stats, wait_stats, use_fp8, round_scale,
                                 use_ue8m0, ls.seq % 0xFFFFFFFF + 1, EventOverlap)
        except RuntimeError as e:  # the launch was tried: the call counts, and this rank is out of step
            ls.made_call()
            ls.fail("low_latency_dispatch", e)
            raise
        if out is None:
            return None
        ls.seq += 1
        ls.sent = True
        return out if out.__class__ is tuple else self._with_notice(out[0])

    def combine(self, x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats):
        ls = self._lockstep
        if ls.broken is not None or ls._refused != ls._resolved:
            return None
        try:
            result = self._combine(self._table, x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats,
                                   ls.seq % 0xFFFFFFFF + 1, EventOverlap)
        except RuntimeError as e:
            ls.made_call()
            ls.fail("low_latency_combine", e)
            raise
        if result is None:
            return None
        ls.seq += 1
        ls.sent = True
        return result if result.__class__ is tuple else self._with_notice(result[0])

    def _with_notice(self, results):
        """A kernel reported a notice: raised with the call's results, as the full path does (buffer._returned)."""
        self._engine.raise_notice(results)
        return results
