"""DeepEP's Buffer(group=None, comm=...) with an mpi4py communicator: under mpirun with Open MPI (the LL and HT bodies,
checked against the reference, with no torch.distributed in the processes), and with a one-rank stand-in for the
communicator where there is no MPI."""

import json
import os
import shutil
import subprocess
import sys

import ci_expect

HERE = os.path.dirname(os.path.abspath(__file__))
INSIDE = os.path.join(HERE, "..", "mpi", "mpi_inside.py")


def _have_mpi():
    if not shutil.which("mpirun"):
        return False, "mpirun is not on PATH (Debian: apt install openmpi-bin)"
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return False, f"mpi4py is not importable ({exc}; pip install mpi4py, or portep[mpi])"
    return True, ""


_HAVE, _WHY = _have_mpi()


@ci_expect.needs("mpi", _HAVE, _WHY)
def test_buffer_bootstraps_over_an_mpi_communicator_under_mpirun(tmp_path):
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    proc = subprocess.run(
        ["mpirun", "-n", "2", sys.executable, INSIDE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1], ranks
    for r in ranks:
        assert r["failures"] == [], r["failures"]
        assert r["checks"] > 500, r
        assert r["rank"] == 1 - r["world_rank"], "the communicator's ranks are the world's reversed"
        assert r["torch_distributed"] is False


def test_a_one_rank_communicator_needs_no_torch_distributed():
    """A stand-in with mpi4py's three methods: construction and an LL round trip on one rank, in a process where
    torch.distributed was never initialized."""
    code = """
import torch, torch.distributed as dist, portep

class OneRankComm:
    def Get_rank(self): return 0
    def Get_size(self): return 1
    def allgather(self, obj): return [obj]

T, H, E = 8, 512, 4
buf = portep.Buffer(None, 0, portep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), low_latency_mode=True,
                    comm=OneRankComm(), backend="host", explicitly_destroy=True)
g = torch.Generator().manual_seed(3)
x = torch.randn(T, H, generator=g).to(torch.bfloat16)
idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
w = torch.rand(T, 2, generator=g)
recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
ref = (x.double() * w.double().sum(1, keepdim=True))
assert not dist.is_initialized()
assert int(count.sum()) == 2 * T, count
assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2), (out.double() - ref).abs().max()
buf.destroy()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-3000:]
