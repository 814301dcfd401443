"""Tests by what they test: unit/ (wire formats, ordering logic, FIFOs, pure backend pieces), host/ (the host
backend end to end, multi-process), gpu/ (CUDA, skipped without a GPU), verbs/ (a qemu guest with soft-RoCE), build/
(the build variants, the kernels' compile check, the CLIs, the examples); support/ holds what they share; native/ is
the portep_testing module of test hooks.

The host-backend suites run on CPU tensors on every machine: Buffers they create without an explicit backend
use the host backend even where a GPU would make "cuda" the default (spawned ranks inherit the environment).
GPU tests pass backend="cuda" themselves."""

import os
import sys
from pathlib import Path

os.environ.setdefault("PORTEP_BACKEND", "host")

# tests/support: the rank workers, references and adapters the suites share (spawned ranks inherit sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
