"""portep._ll_torch.LLCalls without a GPU: what its entries (a Buffer's low_latency_dispatch / low_latency_combine on
the CUDA backend) hand to Buffer's Python methods. With no plan table every call is declined, so each must reach the
full method with its arguments exactly as they came, leave the lockstep state alone and be counted as declined;
binding errors are the Python method's to raise; a deleted Buffer is named; the capsule portep._C hands over
(python/src/ll_shared.h) is refused when it is not one, or of another layout. The calls the entries take natively are
checked on a GPU (tests/gpu/test_gpu_ll_fast_path.py)."""

import ctypes
import gc
import importlib

import ci_expect
import pytest

from portep import native

torch = pytest.importorskip("torch")
BUILT = native.build_info().get("ll_fast_path_torch")
pytestmark = ci_expect.needs(
    "ll-fast-path",
    BUILT == torch.__version__,
    f"portep._ll_torch is built against torch {BUILT or '(none)'}, not {torch.__version__}",
)
_ll_torch = importlib.import_module("portep._ll_torch") if BUILT == torch.__version__ else None


def _state():
    """A LockstepState as a Buffer's after 41 calls, two refusals matched by every peer."""
    state = native.LockstepState()
    state.seq, state.refused, state.resolved = 41, 2, 2
    return state


class Lockstep:  # what the entries call on portep.lockstep.Lockstep: fail(), after a launch that failed
    def fail(self, what, error):
        raise AssertionError(f"fail({what!r}) called on a declined call")


class FakeBuffer:  # Buffer's instances take weak references; SimpleNamespace's do not
    pass


class Recorder:
    def __init__(self, result):
        self.calls, self.result = [], result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


def _calls(buffer, state=None):
    full_dispatch, full_combine = Recorder("full dispatch"), Recorder("full combine")
    shared = native.ll_shared(state if state is not None else _state(), None)  # no LLKernels: no plan table
    calls = _ll_torch.LLCalls(shared, Lockstep(), buffer, object, lambda results: None, full_dispatch, full_combine)
    return calls, full_dispatch, full_combine


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 16, (6, 4), generator=g)
    return x, idx, torch.rand(6, 4, generator=g)


@pytest.mark.parametrize("seed", [1, 2])
def test_declined_calls_reach_the_python_methods_with_their_arguments_as_they_came(seed):
    buffer, state = FakeBuffer(), _state()
    calls, full_dispatch, full_combine = _calls(buffer, state)
    x, idx, weights = _inputs(seed)
    stats = torch.arange(4, dtype=torch.int32) + seed
    handle = (idx.int(), idx, 8, 512, 16)
    cases = [
        (calls.dispatch, full_dispatch, (x, idx, 8, 16), {}),
        (calls.dispatch, full_dispatch, (x, idx, 8, 16, stats), {"use_fp8": False, "round_scale": True}),
        (
            calls.dispatch,
            full_dispatch,
            (x,),
            {"num_experts": 16, "topk_idx": idx, "async_finish": True, "num_max_dispatch_tokens_per_rank": 8},
        ),
        (calls.combine, full_combine, (x, idx, weights, handle), {"zero_copy": True, "out": x}),
        (calls.combine, full_combine, (x, idx, weights, handle, False, False, False, True), {}),
    ]
    for n, (entry, full, args, kwargs) in enumerate(cases, 1):
        assert entry(*args, **kwargs) == full.result
        got_args, got_kwargs = full.calls[-1]
        assert got_args[0] is buffer and len(got_args) == len(args) + 1
        assert all(a is b for a, b in zip(got_args[1:], args)) and got_kwargs.keys() == kwargs.keys()
        assert all(got_kwargs[k] is v for k, v in kwargs.items())
        assert calls.declined == n and calls.taken == 0
    assert (state.seq, state.sent) == (41, False)  # nothing launched: the call counts on the full path


def test_arguments_python_cannot_bind_are_left_to_the_python_method():
    def full_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        cumulative_local_expert_recv_stats=None,
        dispatch_wait_recv_cost_stats=None,
        use_fp8=True,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=False,
    ):
        return "bound"

    buffer = FakeBuffer()
    shared = native.ll_shared(_state(), None)
    calls = _ll_torch.LLCalls(shared, Lockstep(), buffer, object, print, full_dispatch, full_dispatch)
    x, idx, _ = _inputs(3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_fp9'"):
        calls.dispatch(x, idx, 8, 16, use_fp9=True)
    with pytest.raises(TypeError, match="multiple values for argument 'num_experts'"):
        calls.dispatch(x, idx, 8, 16, num_experts=16)
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        calls.dispatch(x, idx, 8)
    with pytest.raises(TypeError, match="positional arguments"):
        calls.dispatch(x, idx, 8, 16, None, None, True, False, False, False, False, 12)
    assert calls.dispatch(x, idx, 8, 16, use_ue8m0=False) == "bound"
    assert calls.declined == 5 and calls.taken == 0


def test_off_or_out_of_step_the_entries_take_nothing():
    buffer, state = FakeBuffer(), _state()
    calls, full_dispatch, _ = _calls(buffer, state)
    x, idx, _ = _inputs(4)
    calls.enabled = False
    assert calls.dispatch(x, idx, 8, 16) == full_dispatch.result and not calls.enabled
    calls.enabled = True
    state.broken = True
    assert calls.dispatch(x, idx, 8, 16) == full_dispatch.result
    state.broken, state.refused = False, 3  # a refusal its peers have not matched yet
    assert not state.in_step and calls.dispatch(x, idx, 8, 16) == full_dispatch.result
    assert calls.declined == 3 and calls.taken == 0 and (state.seq, state.sent) == (41, False)


def test_a_deleted_buffer_is_named_and_its_entries_hold_no_reference_to_it():
    buffer = FakeBuffer()
    calls, _, full_combine = _calls(buffer)
    entry = calls.combine
    del buffer, calls
    gc.collect()
    x, idx, weights = _inputs(5)
    with pytest.raises(RuntimeError, match="low_latency_combine: the Buffer this method belonged to was deleted"):
        entry(x, idx, weights, (idx.int(), idx, 8, 512, 16))
    assert full_combine.calls == []


def test_the_entries_refuse_arguments_that_are_not_what_they_need():
    shared = native.ll_shared(_state(), None)
    with pytest.raises(TypeError, match="event_type must be a class"):
        _ll_torch.LLCalls(shared, Lockstep(), FakeBuffer(), None, print, print, print)
    with pytest.raises(TypeError, match="full_dispatch and full_combine callables"):
        _ll_torch.LLCalls(shared, Lockstep(), FakeBuffer(), object, print, print, 5)
    with pytest.raises(TypeError, match="at most 7 (positional )?arguments"):  # async_event is gone
        _ll_torch.LLCalls(shared, Lockstep(), FakeBuffer(), object, print, print, print, print)
    with pytest.raises(TypeError, match="handle_type must be None or a subclass of tuple"):
        _ll_torch.LLCalls(shared, Lockstep(), FakeBuffer(), object, print, print, print, handle_type=list)
    with pytest.raises(TypeError, match=r"shared must be a portep\._C\.LLShared capsule .*, got object"):
        _ll_torch.LLCalls(object(), Lockstep(), FakeBuffer(), object, print, print, print)
    with pytest.raises(TypeError):
        _ll_torch.LLCalls(shared, Lockstep(), 5, object, print, print, print)  # no weak reference to an int
    with pytest.raises(TypeError, match="ll_shared: state must be a LockstepState, got Lockstep"):
        native.ll_shared(Lockstep(), None)
    with pytest.raises(TypeError, match="ll_shared: kernels must be an LLKernels or None, got object"):
        native.ll_shared(_state(), object())


class _LLShared(ctypes.Structure):  # python/src/ll_shared.h's LLShared, version 1
    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("lockstep_size", ctypes.c_uint32),
        ("table_size", ctypes.c_uint64),
        ("table", ctypes.c_void_p),
        ("lockstep", ctypes.c_void_p),
    ]


LL_SHARED_VERSION = 1  # python/src/ll_shared.h, LLShared::kVersion


def _capsule(struct, name=b"portep._C.LLShared"):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(struct), name, None)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("magic", 0x12345678, "magic 305419896, expected"),
        ("version", LL_SHARED_VERSION + 1, f"version {LL_SHARED_VERSION + 1}, expected {LL_SHARED_VERSION}"),
        ("size", 48, "size 48, expected 40"),
        ("lockstep_size", 40, "LockstepState size 40, expected 32"),
        ("lockstep", 0, "no LockstepState"),
    ],
)
def test_a_capsule_of_another_layout_is_refused_naming_what_differs(field, value, named):
    """The layout check a portep._ll_torch of another build meets: each field of the header is compared."""
    lockstep = ctypes.create_string_buffer(32)
    struct = _LLShared(0x534C4C50, LL_SHARED_VERSION, 40, 32, 0, None, ctypes.addressof(lockstep))
    name = ctypes.create_string_buffer(b"portep._C.LLShared")
    good = _capsule(struct, name)
    _ll_torch.LLCalls(good, Lockstep(), FakeBuffer(), object, print, print, print)  # the header as this build has it
    setattr(struct, field, value)
    with pytest.raises(RuntimeError, match=f"does not match this portep._ll_torch \\({named}"):
        _ll_torch.LLCalls(_capsule(struct, name), Lockstep(), FakeBuffer(), object, print, print, print)
    with pytest.raises(TypeError, match="shared must be"):
        _ll_torch.LLCalls(_capsule(struct, b"another.capsule"), Lockstep(), FakeBuffer(), object, print, print, print)


@pytest.mark.parametrize("entry", ["dispatch", "combine"])
def test_the_entries_bind_arguments_as_buffers_methods_declare_them(entry):
    """The entries' parameter table (their docstring's signature is made from it) against Buffer's Python methods:
    the same names in the same order, the same defaults, so a call binds alike on both."""
    import inspect

    import portep

    calls, _, _ = _calls(FakeBuffer())
    native = list(inspect.signature(getattr(calls, entry)).parameters.values())
    python = list(inspect.signature(getattr(portep.Buffer, f"low_latency_{entry}")).parameters.values())[1:]
    assert [(p.name, p.default, p.kind) for p in native] == [(p.name, p.default, p.kind) for p in python]
