"""DeepEP's Buffer(group=None, comm=...) on the CUDA backend: a one-rank communicator (a stand-in with mpi4py's three
methods, and mpi4py's own COMM_WORLD where mpi4py and an MPI library load without mpirun), construction and an LL
round trip on the GPU in a process where torch.distributed was never initialized, the combined rows checked against
a float64 reference on the CPU with expert outputs that differ per expert. The two-rank case under mpirun is
tests/host/test_mpi_comm.py (host backend, in CI). Needs a GPU."""

import subprocess
import sys

import pytest
import torch

from ci_expect import gpu_skip_reason
from portep import native

needs_gpu = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or native.cuda_devices()[0] == 0 or not torch.cuda.is_available(),
    reason=gpu_skip_reason(1),
)

ROUND_TRIP = """
import sys, torch, torch.distributed as dist, portep

class OneRankComm:
    def Get_rank(self): return 0
    def Get_size(self): return 1
    def allgather(self, obj): return [obj]

if sys.argv[1] == "mpi4py":
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    assert comm.Get_size() == 1, comm.Get_size()
else:
    comm = OneRankComm()
T, H, K, E = 128, 7168, 8, 32
buf = portep.Buffer(None, 0, portep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), low_latency_mode=True,
                    comm=comm, backend="cuda", explicitly_destroy=True)
g = torch.Generator().manual_seed(5)
x = torch.randn(T, H, generator=g).to(torch.bfloat16)
idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
idx[3, 5] = -1
w = torch.rand(T, K, generator=g)
scale = 1 + torch.arange(E, dtype=torch.float64) / 8
recv_x, count, handle, _, _ = buf.low_latency_dispatch(x.cuda(), idx.cuda(), T, E, use_fp8=False)
count = count.cpu()
assert int(count.sum()) == T * K - 1, count
y = (recv_x.double() * scale.cuda().view(E, 1, 1)).to(torch.bfloat16)
out, _, _ = buf.low_latency_combine(y, idx.cuda(), w.cuda(), handle)
torch.cuda.synchronize()
valid = idx >= 0
expert_scale = torch.where(valid, scale[idx.clamp(min=0)], 0.0)
ref = x.double() * (w.double() * expert_scale).sum(1, keepdim=True)
err = (out.double().cpu() - ref).norm() / ref.norm()
assert not dist.is_initialized()
assert out.shape == (T, H) and err < 1e-2, float(err)
buf.destroy()
print("ok", float(err))
"""


def _mpi4py_missing():
    """Why mpi4py's COMM_WORLD cannot serve one rank here without mpirun ('' where it can)."""
    probe = "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 1"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    return "" if proc.returncode == 0 else f"mpi4py's COMM_WORLD did not start one rank: {proc.stderr.strip()[-300:]}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("comm", ["stand-in", "mpi4py"])
def test_cuda_buffer_bootstraps_over_a_one_rank_communicator(comm):
    if comm == "mpi4py":
        why = _mpi4py_missing()
        if why:
            pytest.skip(why)
    proc = subprocess.run([sys.executable, "-c", ROUND_TRIP, comm], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("ok"), (proc.stdout + proc.stderr)[-3000:]
