"""The shm transport's GPU path without a GPU: the data region is "emulated device memory" (shared host memory
whose copies run on worker threads, in issue order, some delayed), so every notification, atomic add and
ordering decision of the CUDA-IPC + copy-engine path runs here. The receivers check each message at the moment
its signal becomes visible, so a signal delivered before its copy completed is caught."""

import pytest

import channel_workers as w
from native_channel import native_channel
from dist_util import run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "shm-unordered"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_signal_covers_its_copies(world, transport):
    producers, messages = 4, 1200
    out = run_ranks(
        w.traffic,
        world,
        args=(transport, producers, messages, 300, 5, 41 + world, 2, False, 48, "emulated"),
        timeout=240,
    )
    total_checked = 0
    for rank, r in out.items():
        check = r["check"]
        assert check["violations"] == 0, check["first_violation"]
        assert check["streams_final"] == world * producers
        total_checked += check["messages_checked"]
        assert r["native_signals"] == (transport == "shm")
        assert r["shm_while_running"] == [] and r["shm_after_destroy"] == []
        assert r["live_threads"] == 0
        # after the closing barrier nothing is in flight, and the transport's backlog report agrees
        for s in r["stats"]:
            assert (s["in_flight"], s["queued"], s["copying"], s["notify_full"]) == (0, 0, 0, 0), s
        assert sum(s["writes"] for s in r["stats"]) > 0
        # the timing counters: every write and signal was posted and seen complete (barriers add more), the
        # mean post -> complete time lies under the largest, and time was spent posting and polling
        for s in r["stats"]:
            assert s["completed"] >= s["writes"] + s["signals"], s
            assert 0 < s["op_latency_ns"] <= s["op_latency_max_ns"] * s["completed"], s
            assert s["polls"] > 0 and s["post_ns"] > 0 and s["poll_ns"] > 0, s
    assert total_checked == world * producers * messages


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "shm-unordered"])
def test_python_api_moves_bytes_exactly_through_copy_workers(transport):
    out = run_ranks(w.python_api, 3, args=(transport, 9, "emulated"), timeout=120)
    for rank, r in out.items():
        assert r["mismatches"] == []
        for src, slot in enumerate(r["slots"]):
            assert slot & 0xFFFFFFFF == r["expected"][src]
            assert slot >> 32 == 1


@pytest.mark.parametrize("transport", ["shm", "shm-unordered"])
def test_unregistrable_emulated_device_memory_is_refused_outside_verbs(transport):
    # device=-3 (kEmulatedDeviceWithoutRdma) stands for GPU memory no NIC can register; only the verbs transports
    # have a way around that (host staging, tests/verbs/verbs_inside.py), so shm must say so instead of touching it
    with pytest.raises(RuntimeError, match=r"device=-3 .* is for the verbs transports only"):
        native_channel(transport=transport, device=-3)
