"""The README's example MoE layers (V1's Buffer and V2's ElasticBuffer) run as a newcomer would run them (torchrun,
2 ranks, host backend) and their own float64 checks pass on every rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("example", ["moe_layer.py", "moe_layer_v2.py"])
def test_the_moe_layer_example_runs_and_checks_out(example):
    from dist_util import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PORTEP_BACKEND="host")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(ROOT / "examples" / example),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(": OK") == 2, r.stdout[-2000:]
