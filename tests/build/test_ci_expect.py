"""What CI expects (tests/support/ci_expect.py): a missing piece skips, saying what is missing, except where
PORTEP_CI_EXPECT names it, where it fails; a misspelt piece is an error, never an empty expectation; .ci/run expects
exactly the pieces the module knows. The guest's own case is in tests/verbs/test_verbs.py."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ci_expect
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_piece_skips_saying_why_unless_ci_expects_it(monkeypatch):
    monkeypatch.setenv("PORTEP_CI_EXPECT", "verbs, pyverbs")
    ci_expect.require_or_skip("verbs", True, "never said")
    with pytest.raises(pytest.fail.Exception, match=r"^CI expects pyverbs but it is missing: no pyverbs here\n"):
        ci_expect.require_or_skip("pyverbs", False, "no pyverbs here")
    with pytest.raises(pytest.skip.Exception, match=r"^hip missing: no hipcc here$"):
        ci_expect.require_or_skip("hip", False, "no hipcc here")
    with pytest.raises(ValueError, match="unknown pieces"):
        ci_expect.require_or_skip("pyverb", True, "a typo")


def test_needs_marks_a_skip_or_a_failure_at_setup(monkeypatch):
    monkeypatch.setenv("PORTEP_CI_EXPECT", "verbs-guest")
    here, skipped = ci_expect.needs("hip", True, "-"), ci_expect.needs("hip", False, "no hipcc")
    assert here.name == skipped.name == "skipif"
    assert here.args == (False,) and skipped.args == (True,) and skipped.kwargs["reason"] == "hip missing: no hipcc"
    expected = ci_expect.needs("verbs-guest", False, "no qemu")
    assert expected.name == "ci_missing"
    item = SimpleNamespace(iter_markers=lambda name: [expected.mark] if name == "ci_missing" else [])
    with pytest.raises(pytest.fail.Exception, match="CI expects verbs-guest but it is missing: no qemu"):
        ci_expect.check_marks(item)


def test_a_misspelt_piece_is_an_error(monkeypatch):
    monkeypatch.setenv("PORTEP_CI_EXPECT", "cuda-kernels,verb")
    with pytest.raises(ValueError, match=r"PORTEP_CI_EXPECT: unknown pieces \['verb'\]"):
        ci_expect.expected()
    env = dict(os.environ, PORTEP_CI_ALLOW_MISSING="hip,pyverb")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests/support/ci_expect.py"), "PORTEP_CI_ALLOW_MISSING"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "PORTEP_CI_ALLOW_MISSING: unknown pieces ['pyverb']" in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", __file__],
        cwd=ROOT,
        env=dict(os.environ, PORTEP_CI_EXPECT="verbs-gust"),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 4 and "unknown pieces ['verbs-gust']" in r.stdout + r.stderr, r.stdout + r.stderr


def test_ci_run_expects_the_pieces_this_module_knows():
    script = (ROOT / ".ci" / "run").read_text()
    expected = set(re.findall(r"^\s*expect_piece ([a-z-]+) ", script, re.M))
    assert expected == set(ci_expect.PIECES)
    for names in re.findall(r"PORTEP_CI_EXPECT=([a-z,-]+) ", script):
        ci_expect.parse(names)


def test_a_gpu_test_without_a_gpu_says_no_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("PORTEP_TEST_SHARE_GPU", raising=False)
    assert ci_expect.gpu_skip_reason(2).startswith("no GPU: 0 CUDA GPUs here, 2 needed (1 with PORTEP_TEST_SHARE_GPU")
    monkeypatch.setenv("PORTEP_TEST_SHARE_GPU", "1")
    assert ci_expect.gpu_skip_reason(4).startswith("no GPU: 0 CUDA GPUs here, 1 needed")
