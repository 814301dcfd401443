"""Tests by what they test: unit/ (wire formats, ordering logic, FIFOs, pure backend pieces), host/ (the host
backend end to end, multi-process), gpu/ (CUDA, skipped without a GPU), verbs/ (a qemu guest with soft-RoCE), build/
(the build variants, the kernels' compile check, the CLIs, the examples); support/ holds what they share; native/ is
the portep_testing module of test hooks.

The host-backend suites run on CPU tensors on every machine: Buffers they create without an explicit backend
use the host backend even where a GPU would make "cuda" the default (spawned ranks inherit the environment).
GPU tests pass backend="cuda" themselves.

What CI is meant to test fails instead of skipping where it is missing: tests/support/ci_expect.py (PORTEP_CI_EXPECT,
set by .ci/run); its needs() marks a missing piece CI expects ci_missing, which fails here at the test's setup."""

import os
import sys
from pathlib import Path

os.environ.setdefault("PORTEP_BACKEND", "host")

# tests/support: the rank workers, references and adapters the suites share (spawned ranks inherit sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import ci_expect  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "ci_missing(message): fails at setup: CI expects a piece this machine lacks "
        "(tests/support/ci_expect.py's needs)",
    )
    try:
        ci_expect.expected()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)  # before the skip marks: a piece CI expects fails even where another is skipped
def pytest_runtest_setup(item):
    ci_expect.check_marks(item)
