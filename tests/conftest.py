"""The host-backend suites run on CPU tensors on every machine: Buffers they create without an explicit backend
use the host backend even where a GPU would make "cuda" the default (spawned ranks inherit the environment).
GPU tests pass backend="cuda" themselves."""

import os

os.environ.setdefault("PORTEP_BACKEND", "host")
