"""The low-latency calls' hot path on the CUDA backend: one native call per phase (portep._ll_torch), reached from
the caller without a Python frame (Buffer's LL methods are its entries on each Buffer that has it), that checks the
call against a signature the full path validated, allocates the outputs and launches the kernels. Anything it does
not take (a new signature, async_finish, a receive hook, shrink mode, a Buffer that failed or is out of step) goes
the full way through Buffer's Python methods and CudaEngine, which give the same results more slowly.

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


def fast_calls(module, engine, buffer, full_dispatch, full_combine):
    """portep._ll_torch.LLCalls for `buffer`: its entries `dispatch` and `combine` take Buffer's LL methods'
    arguments, run the calls they can take natively and hand the rest to full_dispatch / full_combine (Buffer's Python
    methods, called with the buffer and the arguments as they came). They read and advance the engine's lockstep state
    as Lockstep.made_call does (lockstep.py), launch on torch's current stream when the Buffer's GPU is the current
    one, and raise a kernel's notice with the call's results as the full path does (engine.raise_notice)."""
    return module.LLCalls(engine.kernels, engine.lockstep, buffer, EventOverlap, engine.raise_notice, full_dispatch,
                          full_combine)
