"""portep._ll_torch built at first use, for installs that did not build it (issue 38).

The LL hot path (python/src/ll_torch_path.cpp, ll_torch_calls.cpp) links libtorch, so the build can make it only
where torch is importable, which pip's build isolation (the ordinary `pip install .`) prevents. The wheel therefore
carries its sources (portep/_ll_torch_src, installed by CMakeLists.txt), and the first Buffer that wants the fast
path compiles them with torch.utils.cpp_extension against the torch in use: the mechanism torch itself keeps for
extensions, which knows torch's include paths, libraries and C++ ABI, and locks a build directory against
concurrent builds. The result is cached per (sources, torch version, C++ ABI, Python) under
$PORTEP_CACHE_DIR (default $XDG_CACHE_HOME/portep, else ~/.cache/portep); later processes load it without compiling.
A cached module that does not load (a partial write, a torch rebuilt under the same version) is removed and built
again. PORTEP_LL_JIT=0 turns the compile off (the Python path is used)."""

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path

JIT_VAR = "PORTEP_LL_JIT"
CACHE_VAR = "PORTEP_CACHE_DIR"
MANIFEST = "python/src/ll_torch_files.txt"  # the one list of the module's files (CMakeLists.txt reads it too)
MODULE = "_ll_torch"  # the name its PyInit function carries

_loaded = None  # this process's module, once loaded


def manifest(root):
    """(sources, headers) the manifest under root lists, paths relative to root; None where it is missing."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    entries = [line.split(None, 1) for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return (
        tuple(f.strip() for kind, f in entries if kind == "source"),
        tuple(f.strip() for kind, f in entries if kind == "header"),
    )


def all_files(root):
    """Every file the manifest under root lists, the manifest included."""
    sources, headers = manifest(root)
    return (MANIFEST,) + sources + headers


def source_root():
    """The folder holding the manifest and every file it lists: the installed copy, else the source tree (an editable
    install or a run from the checkout)."""
    here = Path(__file__).resolve()
    for root in (here.parents[2] / "_ll_torch_src", here.parents[4]):
        if manifest(root) is not None and all((root / f).is_file() for f in all_files(root)):
            return root
    return None


def cache_key(root, torch_version, cxx11_abi):
    """What a built module depends on: its sources, torch's version and C++ ABI, the Python and the machine."""
    h = hashlib.sha256()
    for f in all_files(root):
        h.update(f.encode() + b"\0" + (root / f).read_bytes())
    h.update(f"{torch_version}|{int(cxx11_abi)}|{sys.version_info[:2]}|{sys.platform}|{os.uname().machine}".encode())
    return h.hexdigest()[:16]


def cache_base():
    explicit = os.environ.get(CACHE_VAR)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "portep"


def build_dir_for(root, torch):
    return cache_base() / f"ll_torch-{cache_key(root, torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI)}"


def describe(build_info):
    """The doctor's words for the fast path on this install and torch: built in, cached, or compiled at first use
    (and what is missing where it cannot be)."""
    built_for = build_info.get("ll_fast_path_torch", "")
    try:
        import torch
    except ImportError:
        return f"built against torch {built_for}" if built_for else "not built (no torch installed)"
    if built_for == torch.__version__:
        return f"built against torch {built_for}"
    why = (
        f"built against torch {built_for}, this is {torch.__version__}"
        if built_for
        else f"not built ({build_info.get('ll_fast_path_reason')})"
    )
    if os.environ.get(JIT_VAR, "1") == "0":
        return f"{why}; {JIT_VAR}=0: LL calls take the Python path"
    root = source_root()
    if root is None:
        return f"{why}; its sources are not in this install: LL calls take the Python path"
    build_dir = build_dir_for(root, torch)
    if (build_dir / f"{MODULE}.so").is_file():
        return f"{why}; compiled at first use against torch {torch.__version__} (cached in {build_dir})"
    missing = [tool for tool, found in (("c++", shutil.which("c++")), ("ninja", ninja_on_path())) if not found]
    if missing:
        return (
            f"{why}; cannot be compiled at first use: no {' and no '.join(missing)} on PATH: LL calls take the "
            "Python path"
        )
    return f"{why}; compiled at the first LL Buffer (about a minute, once; cached in {build_dir})"


def ninja_on_path():
    """Whether torch's extension builder finds ninja: on PATH, or the `ninja` package's (a dependency of portep), whose
    folder is put on PATH for this process (a venv's python run without activating the venv has it off PATH)."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return shutil.which("ninja") is not None


def _import(path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _compile(root, build_dir, torch):
    from torch.utils import cpp_extension

    ninja_on_path()
    print(
        f"portep: compiling the LL fast path against torch {torch.__version__} (once; cached in {build_dir})",
        file=sys.stderr,
        flush=True,
    )
    # the version is a C string literal: its quotes escaped for the build file's shell
    cflags = ["-O2", "-std=c++20", "-fvisibility=hidden", f'-DPORTEP_TORCH_VERSION=\\"{torch.__version__}\\"']
    return cpp_extension.load(
        name=MODULE,
        sources=[str(root / f) for f in manifest(root)[0]],
        extra_include_paths=[str(root)],
        extra_cflags=cflags,
        build_directory=str(build_dir),
        verbose=False,
        is_python_module=True,
    )


def load():
    """(module or None, why not, compiled): the cached module of this torch, built first where there is none (or the
    cached one does not load)."""
    global _loaded
    if _loaded is not None:
        return _loaded, "", False
    if os.environ.get(JIT_VAR, "1") == "0":
        return None, f"{JIT_VAR}=0", False
    import torch

    root = source_root()
    if root is None:
        return None, "its sources are not in this install (portep/_ll_torch_src)", False
    build_dir = build_dir_for(root, torch)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir.parent / f"{build_dir.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait and load its result
            return _load_locked(root, build_dir, torch)
    except OSError as e:
        return None, f"cannot use the cache {build_dir}: {e}", False


def _load_locked(root, build_dir, torch):
    global _loaded
    built = build_dir / f"{MODULE}.so"
    if built.is_file():
        try:
            _loaded = _import(built)
            return _loaded, "", False
        except ImportError:  # broken: build again from nothing
            shutil.rmtree(build_dir, ignore_errors=True)
            build_dir.mkdir(parents=True, exist_ok=True)
    try:
        _loaded = _compile(root, build_dir, torch)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed compile: the Python path still works
        return (
            None,
            (
                f"compiling it at first use failed ({type(e).__name__}: {str(e).strip().splitlines()[-1:]}); "
                "install a C++ compiler and ninja, or build portep with "
                "`pip install --no-build-isolation .` where torch is installed"
            ),
            False,
        )
    return _loaded, "", True
