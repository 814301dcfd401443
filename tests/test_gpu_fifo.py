"""The GPU side of the command FIFO against host consumer threads. Needs a CUDA GPU: skipped elsewhere."""

import pytest

from portep import native

needs_gpu = pytest.mark.skipif(not native.build_info()["cuda_built"] or native.cuda_devices()[0] == 0,
                               reason="needs the CUDA kernels built and a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_fifos,threads,warps,per_warp", [(1, 1, 1, 5000), (8, 1, 256, 500), (32, 4, 1024, 200)])
def test_every_gpu_command_arrives_in_order(num_fifos, threads, warps, per_warp):
    r = native.cuda_fifo_probe(num_fifos, threads, warps, per_warp, 60.0)
    assert not r["producer_timeout"]
    assert r["popped"] == warps * per_warp
    assert r["out_of_order"] == 0


@pytest.mark.gpu
@needs_gpu
def test_gpu_round_trip_is_measured_for_every_command():
    ns = native.cuda_fifo_rtt(2000, 30.0)
    assert len(ns) == 2000 and all(v > 0 for v in ns)
