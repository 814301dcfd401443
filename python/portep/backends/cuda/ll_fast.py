"""The low-latency calls' hot path on the CUDA backend: one native call per phase (portep._ll_torch), reached from
the caller without a Python frame (Buffer's LL methods are its entries on each Buffer that has it), that checks the
call against a signature the full path validated, allocates the outputs and launches the kernels. Anything it does
not take (a new signature, shrink mode, a Buffer that failed or is out of step, tensors of other shapes, dtypes or
devices) goes the full way through Buffer's Python methods and CudaEngine, which give the same results more slowly.
It takes async_finish calls (their EventOverlap's event a native one recorded after the launch,
python/src/ll_torch_event.cpp, with the methods of the full path's CudaEvent) and hooked ones (return_recv_hook=True:
the hook it returns launches the receive phase natively, python/src/ll_torch_hook.cpp), as DeepEP's callers make
them.

portep._ll_torch links libtorch, so it loads only under the torch it was built against (build_info's
ll_fast_path_torch); an install without it (pip's build isolation), or built for another torch, compiles it at first
use (ll_jit.py). It is not used where torch's CUDA allocator was swapped for another (it calls torch's own
directly); `PORTEP_LL_FAST_PATH=0` turns it off."""

import os
import warnings

import torch

from ...event import EventOverlap
from ...handles import LLHandle
from . import ll_jit

FAST_PATH_VAR = "PORTEP_LL_FAST_PATH"
TORCH_ALLOCATORS = ("native", "cudaMallocAsync")  # torch's own, chosen at start (PYTORCH_CUDA_ALLOC_CONF)


def fast_path_module(native):
    """(portep._ll_torch or None, why not): the module the build made for this torch, else the one compiled at
    first use (ll_jit.py); a reason that is not the user's choice is also warned once."""
    if os.environ.get(FAST_PATH_VAR, "1") == "0":
        return None, f"{FAST_PATH_VAR}=0"
    module, why = _fast_path_module(native)
    if module is None and f"{ll_jit.JIT_VAR}=0" not in why:
        _warn_once(why)
    return module, why


_warned = set()


def _warn_once(why):
    if why not in _warned:
        _warned.add(why)
        warnings.warn(
            f"portep: LL calls take the Python path (several times the host time of the fast path): {why}",
            RuntimeWarning,
            stacklevel=4,
        )


def _fast_path_module(native):
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a build of torch without CUDA or ROCm
        return None, "this torch has no GPU support (no torch._C._cuda_getCurrentRawStream)"
    backend = torch.cuda.get_allocator_backend()
    if backend not in TORCH_ALLOCATORS:  # the fast path allocates from the one torch registered for CUDA at start
        return None, (
            f"torch's CUDA allocator is {backend!r} (torch.cuda.memory.change_current_allocator), not "
            f"one of {TORCH_ALLOCATORS}, and the fast path allocates from torch's own"
        )
    if native.build_info().get("ll_fast_path_torch", "") == torch.__version__:
        try:
            from ... import _ll_torch

            return _ll_torch, ""
        except (ImportError, OSError):  # e.g. a libtorch that differs under the same version string: compile
            pass
    module, why, _ = ll_jit.load()
    return module, ("" if module else f"not built into this install, and {why}")


def fast_calls(module, engine, buffer, full_dispatch, full_combine):
    """portep._ll_torch.LLCalls for `buffer`: its entries `dispatch` and `combine` take Buffer's LL methods'
    arguments, run the calls they can take natively and hand the rest to full_dispatch / full_combine (Buffer's Python
    methods, called with the buffer and the arguments as they came). They read and advance the engine's lockstep
    counters (lockstep.py's Lockstep.state, the native object both paths share, handed over with the plan table in one
    versioned capsule, python/src/ll_shared.h), launch on torch's current stream when the Buffer's GPU is the current
    one, and raise a kernel's notice with the call's results as the full path does (engine.raise_notice)."""
    shared = engine.native.ll_shared(engine.lockstep.state, engine.kernels)
    return module.LLCalls(
        shared,
        engine.lockstep,
        buffer,
        EventOverlap,
        engine.raise_notice,
        full_dispatch,
        full_combine,
        handle_type=LLHandle,
    )
