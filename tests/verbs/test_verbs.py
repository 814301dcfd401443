"""The verbs transports. Outside a guest (no RDMA in this kernel) they must fail cleanly and leave everything
else working; inside a qemu guest with soft-RoCE (tests/verbs/guest_vm.py) they run for real: one guest boot runs
every scenario of tests/verbs/verbs_inside.py (exact bytes, traffic checked at each signal, a bad remote key) over RC
with one QP (native atomics) and striped over 4 QPs (unordered, signals emulated with immediates), also with the
data region on emulated GPU memory: registered by pointer, or staged in host memory when no NIC can register it
or PORTEP_IB_GPUDIRECT=0 says so. The same boot runs incast under small per-QP in-flight caps, a peer that never
acknowledges (retry counter exceeded), an unusable explicit GID index, and a pyverbs peer that shares no code
with portep (tests/verbs/verbs_pyverbs_peer.py; it skips where pyverbs is missing).

Where the build has no libibverbs, qemu is missing, soft-RoCE does not come up or the guest lacks pyverbs, the tests
skip saying so, or fail where CI expects the piece (tests/support/ci_expect.py: verbs, verbs-guest, pyverbs)."""

import json
import os
import shutil
import sys

import ci_expect
from native_channel import native_channel
import pytest

from portep import native

HERE = os.path.dirname(os.path.abspath(__file__))
VERBS = next(t for t in native.transport_catalog() if t["name"] == "verbs")
verbs_built = VERBS["built"]
needs_verbs = ci_expect.needs("verbs", verbs_built, VERBS.get("reason", ""))


def in_guest(test):
    """Marks of the tests that boot the soft-RoCE guest."""
    marks = [
        pytest.mark.verbs,
        pytest.mark.slow,
        needs_verbs,
        ci_expect.needs(
            "verbs-guest",
            os.geteuid() == 0 or shutil.which("qemu-system-x86_64") is not None,
            "no qemu-system-x86_64 (the guest installs it with apt when run as root)",
        ),
    ]
    for mark in reversed(marks):
        test = mark(test)
    return test


_guest_unavailable = []  # why soft-RoCE did not come up, once it did not: the later tests do not boot again


def run_script_in_guest(script, timeout):
    """Runs tests/<script> in one guest boot; returns (rc, {scenario name: its JSON line}, output, seconds).
    Skips (with the reason), or fails where CI expects verbs-guest, when soft-RoCE cannot come up on this machine's
    kernel (guest_vm.GuestUnavailable)."""
    import guest_vm

    if not _guest_unavailable:
        try:
            rc, output, seconds = guest_vm.run_in_guest(f"{sys.executable} {HERE}/{script}", cwd=HERE, timeout=timeout)
        except guest_vm.GuestUnavailable as exc:
            _guest_unavailable.append(str(exc))
    if _guest_unavailable:
        ci_expect.require_or_skip("verbs-guest", False, _guest_unavailable[0])
    results = {}
    for line in output.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["name"]] = r
    return rc, results, output, seconds


def test_catalog_reports_verbs_transports():
    names = {t["name"]: t for t in native.transport_catalog()}
    # RC is ordered, with atomics where the device has them, but an EFA device gives SRD: the device decides
    assert names["verbs"]["ordered"] == "by device" and names["verbs"]["remote_atomics"] == "by device"
    assert "EFA" in names["verbs"]["note"]
    assert names["verbs-striped"]["ordered"] is False and names["verbs-striped"]["remote_atomics"] is False
    for name in ("verbs", "verbs-striped"):
        assert names[name]["built"] or "libibverbs" in names[name]["reason"]


def test_no_rdma_device_is_a_clean_error():
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(RuntimeError, match="verbs: (no RDMA devices|this build has no verbs transports)"):
        native_channel(transport="verbs")


_inside_run = {}


def inside_run():
    """verbs_inside.py's results from one guest boot, shared by the tests below."""
    if not _inside_run:
        _inside_run["run"] = run_script_in_guest("verbs_inside.py", 1800)
    return _inside_run["run"]


@needs_verbs
def test_inflight_caps_are_parsed_strictly(monkeypatch):
    for name, value, allowed in (
        ("PORTEP_IB_MAX_INFLIGHT_BYTES", "1.5M", "1..1099511627776"),
        ("PORTEP_IB_MAX_INFLIGHT_MSGS", "0", "1..65536"),
        ("PORTEP_IB_MAX_INFLIGHT_MSGS", "-3", "1..65536"),
        ("PORTEP_IB_GID_INDEX", "x", "0..255"),
        ("PORTEP_IB_RETRY_CNT", "8", "0..7"),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(RuntimeError, match=f"{name}='{value}' must be a decimal integer in {allowed}"):
            native_channel(transport="verbs")
        monkeypatch.delenv(name)


@pytest.mark.parametrize("expect", ["verbs-guest", ""], ids=["expected", "not-expected"])
def test_a_guest_without_soft_roce_is_a_skip_or_the_failure_ci_expects(monkeypatch, expect):
    """A planted GuestUnavailable (no guest boots): the guest tests skip naming it, or fail where CI expects
    verbs-guest; the next test does not boot again."""
    import guest_vm

    def unavailable(*args, **kwargs):
        raise guest_vm.GuestUnavailable("soft-RoCE did not come up in a guest with kernel 9.9 (planted)")

    monkeypatch.setattr(guest_vm, "run_in_guest", unavailable)
    monkeypatch.setattr(sys.modules[__name__], "_guest_unavailable", [])
    monkeypatch.setenv("PORTEP_CI_EXPECT", expect)
    outcome = pytest.fail.Exception if expect else pytest.skip.Exception
    for script in ("verbs_inside.py", "verbs_deepep_inside.py"):
        with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as info:  # neither may end this test
            run_script_in_guest(script, 60)
        assert info.type is outcome, info.value
        assert "verbs-guest" in str(info.value) and "kernel 9.9 (planted)" in str(info.value), info.value
        assert ("CI expects verbs-guest" in str(info.value)) == bool(expect), info.value
        monkeypatch.setattr(guest_vm, "run_in_guest", None)  # booting again would raise TypeError


@in_guest
def test_verbs_in_soft_roce_guest():
    rc, results, output, seconds = inside_run()
    assert rc == 0 and len(results) == 17, f"guest rc {rc} after {seconds:.0f} s:\n{output[-6000:]}"
    for name, r in results.items():
        for rank, v in enumerate(r["ranks"]):
            assert "exception" not in v, f"{name} rank {rank}:\n{v['exception']}"
    # transport -> (native signals, where the data region went: None for host memory)
    expected = {
        "verbs": (True, None),
        "verbs-striped": (False, None),
        "verbs+gpu": (False, "GPU data region: peer memory"),
        "verbs+gpu-no-rdma": (False, "ibv_reg_mr on the device pointer: Bad address"),
        "verbs-striped+gpu-staged": (False, "GPU memory: GPUDirect RDMA turned off (PORTEP_IB_GPUDIRECT=0)"),
    }
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
    assert rc == 0 and set(results) == set(verbs_deepep_inside.SCENARIOS), (
        f"guest rc {rc} after {seconds:.0f} s:\n{output[-6000:]}"
    )
    for name, r in results.items():
        assert "exception" not in r, f"{name}:\n{r['exception']}"
        assert not r["failures"], f"{name}: " + "\n".join(r["failures"])
        assert min(r["checks"]) >= 100, f"{name}: only {r['checks']} checks"
    print(f"guest run: {seconds:.0f} s; " + ", ".join(f"{n} {r['seconds']} s" for n, r in results.items()))


def guest_results(name):
    rc, results, output, seconds = inside_run()
    assert name in results, f"guest rc {rc} after {seconds:.0f} s, no {name}:\n{output[-6000:]}"
    for rank, v in enumerate(results[name]["ranks"]):
        assert "exception" not in v, f"{name} rank {rank}:\n{v['exception']}"
    return results[name]["ranks"]


@in_guest
@pytest.mark.parametrize("transport", ["verbs", "verbs-striped"])
def test_incast_under_inflight_caps(transport):
    """3 senders into rank 0 with 64 KiB / 2 messages per QP: every byte and every signal arrives exactly, a 200 KB
    message (above the byte cap) went alone, and over one QP per peer the caps held posts back (striped, a post
    moves on to the next QP, so deferrals there depend on timing)."""
    receiver, *senders = guest_results(f"incast/{transport}")
    assert receiver["bad"] == [], receiver["bad"]
    assert len(receiver["slots"]) == 3 * 4 and all(got == want for got, want in receiver["slots"].values()), receiver[
        "slots"
    ]
    for v in senders:
        assert "PORTEP_IB_MAX_INFLIGHT_BYTES=65536, PORTEP_IB_MAX_INFLIGHT_MSGS=2" in v["describe"], v["describe"]
        assert v["deferred"] > 0 or transport == "verbs-striped", v["describe"]


@in_guest
def test_retry_exceeded_names_the_caps():
    err = guest_results("retry_exceeded/verbs")[0]["error"]
    assert "transport retry counter exceeded" in err and "PORTEP_IB_RETRY_CNT=1" in err, err
    assert "PORTEP_IB_MAX_INFLIGHT_BYTES=unlimited" in err and "PORTEP_IB_MAX_INFLIGHT_MSGS=256" in err, err


@in_guest
def test_unusable_explicit_gid_index_is_an_error():
    err = guest_results("bad_gid_index/verbs")[0]["error"]
    assert err and "PORTEP_IB_GID_INDEX=200 is unusable" in err, err


@in_guest
@pytest.mark.parametrize("transport", ["verbs", "verbs-striped"])
def test_pyverbs_peer(transport):
    """A pyverbs RC peer (no portep code on its side of the wire) and a portep rank: its writes with immediate
    become portep signals, its fetch-and-adds land in portep's slots, and portep's writes reach it exactly."""
    v = guest_results(f"pyverbs_peer/{transport}")[0]
    if "skipped" in v:  # verbs_foreign_peer.py found no pyverbs in the guest
        ci_expect.require_or_skip("pyverbs", False, v["skipped"])
    assert v["bad_offsets_a"] == [], v
    assert v["slots"] == {"0": 5 + (1 << 32), "1": 4 + (1 << 32)}, v["slots"]
    if v["atomic_slot"] is not None:
        assert v["fetched"] == [0, 7] and v["atomic_slot"] == 9 + (1 << 32), v
    assert v["received"]["problems"] == [], v["received"]
    # immediates only where portep does not signal natively: 5 writes and 2 signals
    assert v["received"]["writes_seen"] == (0 if v["native_signals"] else 5), v["received"]
    assert v["received"]["signals_seen"] == (0 if v["native_signals"] else 2), v["received"]
    assert v["native_signals"] == (transport == "verbs")
