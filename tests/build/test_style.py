"""The house style, enforced: ruff's lint and format on every Python file, clang-format on every C++/CUDA/HIP
source, and no line of code over 120 columns in any language (issue 35 item 6). The tools are the versions the
test extra pins (pyproject.toml), so a newer formatter cannot fail a tree nobody changed."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import ci_expect

ROOT = Path(__file__).resolve().parents[2]
MAX_COLUMNS = 120
CPP_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
CODE_SUFFIXES = CPP_SUFFIXES | {".py", ".cmake", ".sh", ".toml"}
CODE_NAMES = {"CMakeLists.txt", "run"}  # run: .ci/run


def _clang_format():
    spec = importlib.util.find_spec("clang_format")
    exe = Path(spec.origin).parent / "data" / "bin" / "clang-format" if spec and spec.origin else None
    return exe if exe and exe.is_file() else None


HAVE_RUFF = importlib.util.find_spec("ruff") is not None
pytestmark = ci_expect.needs(
    "style",
    HAVE_RUFF and _clang_format() is not None,
    "ruff or clang-format is not installed (pip install '.[test]' brings the pinned versions)",
)


def _tracked_files():
    """The repository's files: git's list where this is a checkout, else every file outside hidden and build dirs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "dist", "__pycache__"}
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") and part != ".ci" or part in skip for part in p.relative_to(ROOT).parts)
        ]


def _code_files(suffixes, names=()):
    return sorted(p for p in _tracked_files() if p.suffix in suffixes or p.name in names)


def _run(cmd):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return res.returncode, (res.stdout + res.stderr)[-6000:]


def test_ruff_lint_passes():
    rc, out = _run([sys.executable, "-m", "ruff", "check", "."])
    assert rc == 0, out


def test_ruff_format_leaves_every_python_file_unchanged():
    rc, out = _run([sys.executable, "-m", "ruff", "format", "--check", "--diff", "."])
    assert rc == 0, out


def test_clang_format_leaves_every_cpp_source_unchanged():
    files = _code_files(CPP_SUFFIXES)
    assert len(files) > 50, f"found only {len(files)} C++/CUDA sources under {ROOT}"
    rc, out = _run([str(_clang_format()), "--dry-run", "--Werror", *map(str, files)])
    assert rc == 0, out


def test_no_line_of_code_is_over_120_columns():
    files = _code_files(CODE_SUFFIXES, CODE_NAMES)
    long_lines = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if len(line) > MAX_COLUMNS:
                long_lines.append(f"{path.relative_to(ROOT)}:{number}: {len(line)} columns")
    assert len(files) > 150, f"found only {len(files)} code files under {ROOT}"
    assert not long_lines, "\n".join(long_lines)


@pytest.mark.parametrize("tool", ["ruff", "clang-format"])
def test_the_tools_are_the_pinned_versions(tool):
    pins = dict(line.strip().strip('",').split("==") for line in _test_extra() if "==" in line)
    assert tool in pins, f"pyproject.toml's test extra pins no {tool} version"
    if tool == "ruff":
        rc, out = _run([sys.executable, "-m", "ruff", "--version"])
    else:
        rc, out = _run([str(_clang_format()), "--version"])
    assert rc == 0 and pins[tool] in out, f"{tool}: want {pins[tool]}, have {out.strip()}"


def _test_extra():
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("test = [")
    return text[start + len("test = [") : text.index("]", start)].split(",")


def test_a_planted_violation_fails_each_check(tmp_path):
    """Each check can fail: a badly formatted file of each kind is reported."""
    bad_py = tmp_path / "bad.py"
    bad_py.write_text("x = ( 1,2 )\n")
    rc, out = _run(
        [sys.executable, "-m", "ruff", "format", "--check", "--config", str(ROOT / "pyproject.toml"), str(bad_py)]
    )
    assert rc != 0 and "bad.py" in out
    bad_cpp = tmp_path / "bad.cpp"
    bad_cpp.write_text("int  f( int x ){return x;}\n")
    rc, out = _run(
        [str(_clang_format()), "--dry-run", "--Werror", f"--style=file:{ROOT / '.clang-format'}", str(bad_cpp)]
    )
    assert rc != 0 and "bad.cpp" in out
