"""The GPU side of the command FIFO against host consumer threads. Needs a CUDA GPU: skipped elsewhere."""

import pytest

from ci_expect import gpu_skip_reason
import portep_testing
from portep import native

needs_gpu = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or native.cuda_devices()[0] == 0, reason=gpu_skip_reason(1)
)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_fifos,threads,warps,per_warp", [(1, 1, 1, 5000), (8, 1, 256, 500), (32, 4, 1024, 200)])
def test_every_gpu_command_arrives_in_order(num_fifos, threads, warps, per_warp):
    r = portep_testing.cuda_fifo_probe(num_fifos, threads, warps, per_warp, 60.0)
    assert not r["producer_timeout"]
    assert r["popped"] == warps * per_warp
    assert r["out_of_order"] == 0


@pytest.mark.gpu
@needs_gpu
def test_gpu_round_trip_is_measured_for_every_command():
    t = portep_testing.cuda_fifo_rtt(2000, 30.0)
    assert all(len(t[k]) == 2000 for k in ("publish_ns", "pop_ns", "release_ns", "seen_ns"))
    for i in range(2000):
        # each clock runs forward: publish before seen (GPU), pop before release (host), one command after another
        assert 0 < t["publish_ns"][i] < t["seen_ns"][i]
        assert 0 < t["pop_ns"][i] <= t["release_ns"][i]
        if i:
            assert t["seen_ns"][i - 1] <= t["publish_ns"][i] and t["release_ns"][i - 1] <= t["pop_ns"][i]
    # the host popped and released each command within the GPU's round trip of it
    host = sorted(r - p for p, r in zip(t["pop_ns"], t["release_ns"]))
    gpu = sorted(s - p for p, s in zip(t["publish_ns"], t["seen_ns"]))
    assert host[len(host) // 2] < gpu[len(gpu) // 2]
    # the host clock the GPU read before each publish predates that command's pop, and runs forward
    before = t["host_clock_before_ns"]
    assert len(before) == 2000 and all(0 < b < p for b, p in zip(before, t["pop_ns"]))
    assert all(before[i - 1] <= before[i] for i in range(1, 2000))
    # a GPU read of host memory takes time, and less than a whole round trip through the host
    reads = sorted(t["host_read_ns"])
    assert len(reads) == 1000 and reads[0] > 0 and reads[len(reads) // 2] < gpu[len(gpu) // 2]
