"""portep._ll_torch compiled at first use (python/portep/backends/cuda/ll_jit.py) for installs that did not build it:
the installed sources compile once against the torch in use, later processes load the cached module without
compiling, a broken cache is rebuilt, the cache key follows torch's version and ABI and the sources, and an install
made the README's way (pip's build isolation, a fresh venv) gets the module at first use. Each probe is a separate
process with its own cache folder (PORTEP_CACHE_DIR)."""

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import ci_expect
from portep.backends.cuda import ll_jit

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]
TOOLS = shutil.which("c++") is not None and ll_jit.ninja_on_path()
needs_tools = ci_expect.needs("ll-fast-path", TOOLS, "no C++ compiler or no ninja to compile the LL fast path")

PROBE = """
import json, torch
from portep import native
from portep.backends.cuda import ll_jit
m, why, compiled = ll_jit.load()
info = native.build_info()
print(json.dumps({"module": m is not None, "why": why, "compiled": compiled, "torch": torch.__version__,
                  "version": getattr(m, "TORCH_VERSION", None), "calls": isinstance(getattr(m, "LLCalls", None), type),
                  "root": str(ll_jit.source_root()), "built_in": info["ll_fast_path_torch"],
                  "reason": info["ll_fast_path_reason"]}))
"""


def _probe(python, cache, own_path=False, **env):
    """ll_jit.load() in a new process of `python` with cache folder `cache`: (its report, its stderr). own_path: without
    the caller's PYTHONPATH, which may name another install of portep (a developer's run of the suite)."""
    cache.mkdir(parents=True, exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if not (own_path and k == "PYTHONPATH")}
    p = subprocess.run(
        [str(python), "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=cache,
        env={**inherited, ll_jit.CACHE_VAR: str(cache), **env},
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


HIP_PASS = os.environ.get("PORTEP_EXPECT_GPU_RUNTIME") == "hip"


@needs_tools
def test_compiled_once_then_loaded_from_the_cache_and_rebuilt_when_broken(tmp_path):
    if HIP_PASS:
        pytest.skip("ran in CI's CUDA pass: the same Python and sources")
    cache = tmp_path / "cache"
    first, err = _probe(sys.executable, cache)
    assert first["module"] and first["compiled"] and first["calls"], first
    assert first["version"] == first["torch"] and "compiling the LL fast path" in err
    assert Path(first["root"]).name == "_ll_torch_src" or Path(first["root"]) == REPO  # installed, or editable
    second, err = _probe(sys.executable, cache)
    assert second["module"] and not second["compiled"] and "compiling" not in err, second
    (built,) = cache.glob("ll_torch-*/_ll_torch.so")
    built.write_bytes(b"not a shared object")  # a partial write, say
    third, err = _probe(sys.executable, cache)
    assert third["module"] and third["compiled"] and third["calls"] and "compiling" in err, third
    off, _ = _probe(sys.executable, cache, PORTEP_LL_JIT="0")
    assert not off["module"] and off["why"] == "PORTEP_LL_JIT=0", off


def test_the_cache_key_follows_torch_and_the_sources(tmp_path):
    root = ll_jit.source_root()
    assert root is not None, "the LL fast path's sources are missing from this install (portep/_ll_torch_src)"
    key = ll_jit.cache_key(root, "2.13.0", True)
    assert key == ll_jit.cache_key(root, "2.13.0", True)
    assert len({key, ll_jit.cache_key(root, "2.14.0", True), ll_jit.cache_key(root, "2.13.0", False)}) == 3
    copy = tmp_path / "src"
    for f in ll_jit.all_files(root):
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / f, copy / f)
    assert ll_jit.cache_key(copy, "2.13.0", True) == key
    header = copy / ll_jit.manifest(root)[1][-1]
    header.write_text(header.read_text() + "\n// changed\n")
    assert ll_jit.cache_key(copy, "2.13.0", True) != key


def test_the_doctor_says_where_the_fast_path_comes_from(tmp_path, monkeypatch):
    from portep import native

    info = dict(native.build_info(), ll_fast_path_torch="", ll_fast_path_reason="torch was not importable")
    monkeypatch.setenv(ll_jit.CACHE_VAR, str(tmp_path))
    words = ll_jit.describe(info)
    assert words.startswith("not built (torch was not importable)") and str(tmp_path) in words
    assert ("compiled at the first LL Buffer" in words) == TOOLS
    monkeypatch.setenv(ll_jit.JIT_VAR, "0")
    assert ll_jit.describe(info).endswith("PORTEP_LL_JIT=0: LL calls take the Python path")
    built_in = dict(info, ll_fast_path_torch=torch.__version__)
    assert ll_jit.describe(built_in) == f"built against torch {torch.__version__}"


@pytest.mark.slow
@needs_tools
def test_an_isolated_install_in_a_fresh_venv_compiles_the_fast_path_at_first_use(tmp_path):
    """As the README installs: a fresh venv, torch, then `pip install .` with build isolation (torch not importable
    during the build, so the build leaves the module out, with the GPU kernels built where a GPU compiler is found,
    as CI's CUDACXX provides); the first use compiles it. The HIP pass of CI skips it (the same Python and sources
    ran in the CUDA pass)."""
    if HIP_PASS:
        pytest.skip("ran in CI's CUDA pass: the same Python and sources")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    for args in (["torch==2.13.0"], [str(REPO)]):
        p = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *args],
            capture_output=True,
            text=True,
            timeout=2400,
            cwd=tmp_path,
        )
        assert p.returncode == 0, p.stderr[-4000:]
    report, err = _probe(python, tmp_path / "cache", own_path=True, PATH="/usr/bin:/bin")  # the venv not activated
    if "no GPU kernels" in report["reason"]:  # no GPU compiler here: the build never looks for torch
        ci_expect.require_or_skip("cuda-kernels", False, f"the venv's build has no GPU kernels: {report['reason']}")
    assert report["built_in"] == "" and "build isolation" in report["reason"], report
    assert report["module"] and report["compiled"] and report["calls"], (report, err[-2000:])
    assert report["version"] == report["torch"] and Path(report["root"]).name == "_ll_torch_src"


def test_the_manifest_lists_every_project_header_the_sources_include():
    """The one list (python/src/ll_torch_files.txt) holds the closure of the sources' quoted includes, so the wheel's
    copy compiles; a header added to ll_plan.h's includes but not to the list fails here."""
    import re

    repo = Path(__file__).resolve().parents[2]
    sources, headers = ll_jit.manifest(repo)
    assert sources and headers
    seen, todo = set(), list(sources)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for inc in re.findall(r'^\s*#\s*include\s*"([^"]+)"', (repo / f).read_text(), re.M):
            if (repo / inc).is_file():
                todo.append(inc)
    missing = sorted(seen - set(sources) - set(headers))
    assert not missing, f"{ll_jit.MANIFEST} lacks {missing}"
    assert len(seen) == len(sources) + len(headers), sorted(set(sources + headers) - seen)
