"""The verbs transports. Outside a guest (no RDMA in this kernel) they must fail cleanly and leave everything
else working; inside a qemu guest with soft-RoCE (tests/guest_vm.py) they run for real: one guest boot runs
every scenario of tests/verbs_inside.py (exact bytes, traffic checked at each signal, a bad remote key) over RC
with one QP (native atomics) and striped over 4 QPs (unordered, signals emulated with immediates), also with the
data region on emulated GPU memory: registered by pointer, or staged in host memory when no NIC can register it
or PORTEP_IB_GPUDIRECT=0 says so."""

import json
import os
import shutil
import sys

import pytest

from portep import native

HERE = os.path.dirname(os.path.abspath(__file__))
verbs_built = any(t["name"] == "verbs" and t["built"] for t in native.transport_catalog())


def in_guest(test):
    """Marks of the tests that boot the soft-RoCE guest."""
    marks = [pytest.mark.verbs, pytest.mark.slow,
             pytest.mark.skipif(not verbs_built, reason="portep was built without libibverbs"),
             pytest.mark.skipif(os.geteuid() != 0 and shutil.which("qemu-system-x86_64") is None,
                                reason="the guest needs qemu (installed with apt as root on first use)")]
    for mark in reversed(marks):
        test = mark(test)
    return test


def run_script_in_guest(script, timeout):
    """Runs tests/<script> in one guest boot; returns (rc, {scenario name: its JSON line}, output, seconds).
    Skips (with the reason) when soft-RoCE cannot come up on this machine's kernel (guest_vm.GuestUnavailable)."""
    import guest_vm

    try:
        rc, output, seconds = guest_vm.run_in_guest(f"{sys.executable} {HERE}/{script}", cwd=HERE, timeout=timeout)
    except guest_vm.GuestUnavailable as exc:
        pytest.skip(str(exc))
    results = {}
    for line in output.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["name"]] = r
    return rc, results, output, seconds


def test_catalog_reports_verbs_transports():
    names = {t["name"]: t for t in native.transport_catalog()}
    assert names["verbs"]["ordered"] and not names["verbs-striped"]["ordered"]
    for name in ("verbs", "verbs-striped"):
        assert names[name]["built"] or "libibverbs" in names[name]["reason"]


def test_no_rdma_device_is_a_clean_error():
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(RuntimeError, match="verbs: (no RDMA devices|this build has no libibverbs)"):
        native.Channel(rank=0, num_ranks=1, nbytes=4096, transport="verbs", num_proxy_threads=1, num_fifos=1,
                       fifo_capacity=64, num_streams=1, max_inflight_cmds=8, max_inflight_bytes=1 << 20,
                       timeout_s=5.0, unordered_window=8, seed=0, skip_ordering=False)


@in_guest
def test_verbs_in_soft_roce_guest():
    rc, results, output, seconds = run_script_in_guest("verbs_inside.py", 1200)
    assert rc == 0 and len(results) == 11, f"guest rc {rc} after {seconds:.0f} s:\n{output[-6000:]}"
    for name, r in results.items():
        for rank, v in enumerate(r["ranks"]):
            assert "exception" not in v, f"{name} rank {rank}:\n{v['exception']}"
    # transport -> (native signals, where the data region went: None for host memory)
    expected = {"verbs": (True, None), "verbs-striped": (False, None),
                "verbs+gpu": (False, "GPU data region: peer memory"),
                "verbs+gpu-no-rdma": (False, "ibv_reg_mr on the device pointer: Bad address"),
                "verbs-striped+gpu-staged": (False, "GPU memory: GPUDirect RDMA turned off (PORTEP_IB_GPUDIRECT=0)")}
    for transport, (native_signals, placement) in expected.items():
        for v in results[f"exact_bytes/{transport}"]["ranks"] + results[f"traffic/{transport}"]["ranks"]:
            assert v["native_signals"] == native_signals
            if placement is None:
                assert "GPU data region" not in v["placement"], v["placement"]
            else:
                assert placement in v["placement"], v["placement"]
                assert ("host staging" in v["placement"]) == ("gpu-" in transport), v["placement"]
        for v in results[f"exact_bytes/{transport}"]["ranks"]:
            assert v["mismatched_sources"] == []
            assert all(s & 0xFFFFFFFF == 4 and s >> 32 == 1 for s in v["slots"]), v["slots"]
        for v in results[f"traffic/{transport}"]["ranks"]:
            assert v["error"] is None and v["violations"] == 0, v
            assert v["streams_final"] == 2 * 3 and v["messages_checked"] > 0
    err = results["bad_remote_key/verbs"]["ranks"][0]["error"]
    assert "failed" in err and "remote" in err.lower(), err
    print(f"guest run: {seconds:.0f} s; " + ", ".join(f"{n} {r['seconds']} s" for n, r in results.items()))


@in_guest
def test_deepep_suite_over_verbs_in_soft_roce_guest():
    """The host-backend DeepEP bodies (LL and HT, 2 and 4 ranks, 1 and 2 ranks per node) over verbs RC and over
    striped verbs, in one guest boot (torch takes about a minute to import under TCG, so the runs are small)."""
    import verbs_deepep_inside

    rc, results, output, seconds = run_script_in_guest("verbs_deepep_inside.py", 2400)
    assert rc == 0 and set(results) == set(verbs_deepep_inside.SCENARIOS), \
        f"guest rc {rc} after {seconds:.0f} s:\n{output[-6000:]}"
    for name, r in results.items():
        assert "exception" not in r, f"{name}:\n{r['exception']}"
        assert not r["failures"], f"{name}: " + "\n".join(r["failures"])
        assert min(r["checks"]) >= 100, f"{name}: only {r['checks']} checks"
    print(f"guest run: {seconds:.0f} s; " + ", ".join(f"{n} {r['seconds']} s" for n, r in results.items()))
