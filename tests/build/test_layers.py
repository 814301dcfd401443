"""The architecture of docs/design.md §1 holds, read from the sources (no build, no compiler):

- native code: a layer includes only itself and the layers below it (ordering < transport < proxy < gpu_kernels <
  python/src), every quoted include is a path from the repository root that exists (one include tree, no `../`,
  no `portep/` prefix, no -I into a subfolder), and no product file includes test code;
- the Python package: no import cycle (imports inside functions count), the host and CUDA backends do not import
  each other, `backends.common` neither of them, the lower modules neither `buffer` nor the backends, nothing
  below `elastic` (DeepEP V2's API, on `buffer`) imports it, and portep
  never reaches portep_bench or portep_testing, nor does any product Python reach test code;
- the wheel: `_C` is installed into `portep`; nothing outside if(PORTEP_BUILD_TESTING) installs test code (a
  target defined under tests/, built from or linking sources there, or files from there); portep_testing is not
  installed into `portep`; wheel.packages names no tests.

Each checker returns the violations as "file:line: what" lines; the tests at the bottom feed them small synthetic
trees with one violation each, so a checker that stopped finding anything would fail there."""

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ---- native code ----

NATIVE_LAYERS = ["ordering", "transport", "proxy", "gpu_kernels", "python/src"]  # bottom up
NATIVE_SUFFIXES = {".h", ".hpp", ".c", ".cc", ".cpp", ".cu", ".cuh"}
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def _layer(relpath):
    """Index of the layer a root-relative path (str) belongs to, or None outside the layers."""
    for i, folder in enumerate(NATIVE_LAYERS):
        if relpath.startswith(folder + "/"):
            return i
    return None


def _native_files(root, folders):
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in NATIVE_SUFFIXES and path.is_file():
                yield path


def _quoted_includes(path):
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = QUOTED_INCLUDE.match(line)
        if m:
            yield lineno, m.group(1)


def upward_includes(root):
    """Product native files that include a file of a higher layer."""
    found = []
    for path in _native_files(root, NATIVE_LAYERS):
        rel = path.relative_to(root).as_posix()
        for lineno, target in _quoted_includes(path):
            own, theirs = _layer(rel), _layer(target)
            if theirs is not None and theirs > own:
                found.append(
                    f"{rel}:{lineno}: layer {NATIVE_LAYERS[own]}/ includes {target} of the higher layer "
                    f"{NATIVE_LAYERS[theirs]}/"
                )
    return found


def native_includes_of_test_code(root):
    """Product native files that include anything under tests/."""
    return [
        f"{path.relative_to(root).as_posix()}:{lineno}: includes test code {target}"
        for path in _native_files(root, NATIVE_LAYERS)
        for lineno, target in _quoted_includes(path)
        if target.startswith("tests/")
    ]


def includes_not_from_the_root(root):
    """Quoted includes (product and tests/native) that are not an existing path from the repository root."""
    found = []
    for path in _native_files(root, NATIVE_LAYERS + ["tests/native"]):
        rel = path.relative_to(root).as_posix()
        for lineno, target in _quoted_includes(path):
            if ".." in Path(target).parts or target.startswith(("./", "/")):
                found.append(f"{rel}:{lineno}: relative or absolute include {target}")
            elif target.startswith("portep/"):
                found.append(f"{rel}:{lineno}: include {target} from the old portep/ include folders")
            elif not (root / target).is_file():
                found.append(f"{rel}:{lineno}: include {target} is no file from the repository root")
    return found


# ---- CMake ----


def _cmake_commands(path):
    """(line, name, arguments) of every command of a CMake file, comments dropped, parentheses balanced."""
    text = "\n".join(re.sub(r"#.*", "", line) for line in path.read_text().splitlines())
    command, i = re.compile(r"\b(\w+)\s*\("), 0
    while m := command.search(text, i):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text.count("\n", 0, m.start()) + 1, m.group(1).lower(), text[m.end() : i - 1].split()


def _cmake_files(root):
    candidates = [root / "CMakeLists.txt", *root.glob("cmake/*.cmake"), *root.glob("tests/**/CMakeLists.txt")]
    return sorted(p for p in candidates if p.is_file())


def include_dirs_besides_the_root(root):
    """include_directories / target_include_directories naming a folder of the source tree other than the root
    (a relative path, or one under a *SOURCE_DIR variable). Paths found outside the tree (${PORTEP_TORCH_DIR}/...,
    ${PORTEP_IBVERBS_INCLUDE}) are fine."""
    keywords = {"SYSTEM", "BEFORE", "AFTER", "PUBLIC", "PRIVATE", "INTERFACE"}
    found = []
    for path in _cmake_files(root):
        rel = path.relative_to(root).as_posix()
        root_spelling = "${CMAKE_CURRENT_SOURCE_DIR}" if rel == "CMakeLists.txt" else "${CMAKE_SOURCE_DIR}"
        for lineno, name, args in _cmake_commands(path):
            if name not in ("include_directories", "target_include_directories"):
                continue
            for d in args[1:] if name == "target_include_directories" else args:
                in_tree = not d.startswith("${") or re.match(r"\$\{\w*SOURCE_DIR\}", d)
                if (
                    d not in keywords
                    and in_tree
                    and d not in (root_spelling, "${CMAKE_SOURCE_DIR}", "${PROJECT_SOURCE_DIR}")
                ):
                    found.append(f"{rel}:{lineno}: include directory {d} besides the repository root")
    return found


TARGET_COMMANDS = {"add_library", "add_executable", "pybind11_add_module", "python_add_library"}


def _cmake_build(root):
    """Walks CMakeLists.txt and the folders it adds, expanding ${VAR} from set() and list(APPEND) (the union over
    every branch). Returns (commands, targets): commands as (file:line, name, args, under if(PORTEP_BUILD_TESTING)),
    targets as name -> {"defined": file, "sources": root-relative paths, "links": names}."""
    commands, targets, variables = [], {}, {}

    def expand(token):
        whole = re.fullmatch(r"\$\{(\w+)\}", token)
        if whole:
            return variables.get(whole.group(1), [])
        return [re.sub(r"\$\{(\w+)\}", lambda m: ";".join(variables.get(m.group(1), [m.group(0)])), token)]

    def walk(path, testing):
        rel = path.relative_to(root).as_posix()
        stack = []  # per open if(): whether its current branch is the PORTEP_BUILD_TESTING one
        for lineno, name, raw in _cmake_commands(path):
            args = [a for token in raw for a in expand(token)]
            if name == "if":
                stack.append(raw == ["PORTEP_BUILD_TESTING"])
            elif name in ("elseif", "else"):
                stack[-1] = False
            elif name == "endif":
                stack.pop()
            elif name == "set" and args:
                variables[args[0]] = variables.get(args[0], []) + args[1:]
            elif name == "list" and args[:1] == ["APPEND"]:
                variables[args[1]] = variables.get(args[1], []) + args[2:]
            elif name in TARGET_COMMANDS | {"target_sources", "target_link_libraries"} and args:
                target = targets.setdefault(args[0], {"defined": None, "sources": [], "links": []})
                if name in TARGET_COMMANDS:
                    target["defined"] = rel
                if name == "target_link_libraries":
                    target["links"] += args[1:]
                else:
                    target["sources"] += [
                        (path.parent / a).relative_to(root).as_posix()
                        for a in args[1:]
                        if Path(a).suffix in NATIVE_SUFFIXES and not a.startswith(("$", "/"))
                    ]
            commands.append((f"{rel}:{lineno}", name, args, testing or any(stack)))
            subdir = path.parent / args[0] / "CMakeLists.txt" if name == "add_subdirectory" else None
            if subdir and subdir.is_file():
                walk(subdir, testing or any(stack))

    walk(root / "CMakeLists.txt", False)
    return commands, targets


def _test_code_in_target(targets, name, seen=()):
    """Why a target holds test code (a file under tests/ defines it, one of its sources or of the targets it links
    is under tests/), or None."""
    target = targets.get(name)
    if target is None or name in seen:
        return None
    if (target["defined"] or "").startswith("tests/"):
        return f"{name} is defined in {target['defined']}"
    source = next((s for s in target["sources"] if s.startswith("tests/")), None)
    if source:
        return f"{name} is built from {source}"
    return next(filter(None, (_test_code_in_target(targets, link, (*seen, name)) for link in target["links"])), None)


def installed_test_code(root):
    """What outside if(PORTEP_BUILD_TESTING) would put test code into the wheel: an add_subdirectory(tests...), an
    install of a target holding test code, an install of files under tests/."""
    commands, targets = _cmake_build(root)
    found = []
    for where, name, args, testing in commands:
        if testing:
            continue
        if name == "add_subdirectory" and args[0].startswith("tests"):
            found.append(f"{where}: add_subdirectory({args[0]}) outside if(PORTEP_BUILD_TESTING)")
        elif name == "install" and args[0] == "TARGETS":
            found += [
                f"{where}: install(TARGETS {t}) outside if(PORTEP_BUILD_TESTING), but {why}"
                for t in args[1:]
                if t not in INSTALL_KEYWORDS
                for why in [_test_code_in_target(targets, t)]
                if why
            ]
        elif name == "install":
            found += [
                f"{where}: install({args[0]} {a}) outside if(PORTEP_BUILD_TESTING)"
                for a in args[1:]
                if a.startswith("tests/") or "/tests/" in a
            ]
    return found


INSTALL_KEYWORDS = {
    "EXPORT",
    "ARCHIVE",
    "LIBRARY",
    "RUNTIME",
    "OBJECTS",
    "FRAMEWORK",
    "BUNDLE",
    "PUBLIC_HEADER",
    "PRIVATE_HEADER",
    "RESOURCE",
    "FILE_SET",
    "DESTINATION",
    "COMPONENT",
    "OPTIONAL",
    "INCLUDES",
}


def installed_targets(root, testing=False):
    """(target, destination) of every install(TARGETS ...) outside (or, testing=True, under)
    if(PORTEP_BUILD_TESTING)."""
    commands, _ = _cmake_build(root)
    found = []
    for _, name, args, under in commands:
        if name == "install" and args[0] == "TARGETS" and under == testing:
            end = next(i for i, a in enumerate(args) if a in INSTALL_KEYWORDS)
            found += [(t, args[args.index("DESTINATION") + 1]) for t in args[1:end]]
    return found


def wheel_packages(root):
    """[tool.scikit-build] wheel.packages of pyproject.toml (read without tomllib, which Python < 3.11 lacks)."""
    m = re.search(r"^\s*wheel\.packages\s*=\s*(\[[^\]]*\])", (root / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml: no wheel.packages = [...] line"
    return ast.literal_eval(m.group(1))


def wheel_packages_with_tests(root):
    return [
        f"pyproject.toml: wheel.packages lists {p}"
        for p in wheel_packages(root)
        if "tests" in Path(p).parts or Path(p).name in ("conftest", "portep_testing")
    ]


# ---- Python ----


@functools.lru_cache(maxsize=None)
def _parse(path):
    return ast.parse(path.read_text(), str(path))


def _python_modules(package_dir, package):
    """Dotted module name -> path for every .py file of a package folder."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(path, module):
    """(line, absolute dotted name) of every import in a file, those inside functions too; `from X import n`
    gives X.n (n may be a module or a name in X)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def import_graph(root, folder, package):
    """module -> [(imported module, file:line)] within the package in root/folder. An import resolves to the
    longest module prefix of the name; imports of a module's own parent packages are left out (Python runs them
    first anyway)."""
    modules = _python_modules(root / folder, package)
    graph = {}
    for module, path in modules.items():
        edges = []
        for lineno, name in _imported_names(path, module):
            parts = name.split(".")
            target = next(
                (".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None
            )
            if target and target != module and not module.startswith(target + "."):
                edges.append((target, f"{path.relative_to(root).as_posix()}:{lineno}"))
        graph[module] = edges
    return graph


def import_cycles(graph):
    """Each import cycle found by a depth-first walk, as 'a (file:line) -> b (file:line) -> a' (the first import
    line of each step)."""
    cycles, state, stack = {}, {}, []

    def visit(module):
        state[module] = "open"
        for target, where in graph.get(module, []):
            stack.append((module, where))
            if state.get(target) == "open":
                start = next(i for i, (m, _) in enumerate(stack) if m == target)
                modules = tuple(m for m, _ in stack[start:])
                cycles.setdefault(modules, " -> ".join(f"{m} ({w})" for m, w in stack[start:]) + f" -> {target}")
            elif target not in state:
                visit(target)
            stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return list(cycles.values())


def _within(module, prefix):
    return module == prefix or module.startswith(prefix + ".")


def forbidden_imports(graph, rules):
    """Imports from a module under `importer` of one under `imported`, for each (importer, imported) rule."""
    return [
        f"{where}: {module} imports {target} ({importer} must not import {imported})"
        for module, edges in sorted(graph.items())
        for target, where in edges
        for importer, imported in rules
        if _within(module, importer) and _within(target, imported)
    ]


LOWER_MODULES = [
    "channel",
    "nccl_library",
    "nccl_device",
    "bootstrap",
    "config",
    "lockstep",
    "topology",
    "errors",
    "event",
    "deepep_config",
    "validation",
    "_native",
]
PORTEP_RULES = [
    ("portep.backends.host", "portep.backends.cuda"),
    ("portep.backends.cuda", "portep.backends.host"),
    ("portep.backends.common", "portep.backends.host"),
    ("portep.backends.common", "portep.backends.cuda"),
    ("portep.backends", "portep.buffer"),
]
PORTEP_RULES += [(f"portep.{m}", upper) for m in LOWER_MODULES for upper in ("portep.buffer", "portep.backends")]
# portep.elastic (DeepEP V2's API) sits on portep.buffer: nothing below it may import it
PORTEP_RULES += [(f"portep.{m}", "portep.elastic") for m in LOWER_MODULES + ["buffer", "backends"]]


def _string_constants(tree):
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def uses_of_modules(folder, names, root):
    """Files under folder that import one of the top-level module names, or hold a string that names one (an
    importlib / __import__ / `-m` argument) or a path under one of them ('tests/support')."""
    found = []
    names = set(names)
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported = [node.module]
            else:
                continue
            found += [f"{rel}:{node.lineno}: imports {n}" for n in imported if n.split(".")[0] in names]
        for lineno, value in _string_constants(tree):
            if re.split(r"[./]", value.strip())[0] in names:
                found.append(f"{rel}:{lineno}: names {value!r}")
    return found


def names_of_test_modules(root):
    """The names by which product code could reach test code: the tests package, and every module under tests/
    (tests/support is on sys.path during the tests, so its modules import by their bare names)."""
    return {"tests", "conftest"} | {p.stem for p in (root / "tests").rglob("*.py") if p.stem != "__init__"}


PRODUCT_PYTHON = ["python/portep", "python/deep_ep", "bench/portep_bench"]


# ---- the tree as it is ----


def _report(violations):
    return "\n".join(violations)


def test_native_includes_point_down_the_layers():
    violations = upward_includes(ROOT)
    assert not violations, _report(violations)


def test_every_native_include_is_an_existing_path_from_the_root():
    violations = includes_not_from_the_root(ROOT)
    assert not violations, _report(violations)


def test_the_only_include_directory_is_the_root():
    violations = include_dirs_besides_the_root(ROOT)
    assert not violations, _report(violations)


def test_no_product_native_file_includes_test_code():
    violations = native_includes_of_test_code(ROOT)
    assert not violations, _report(violations)


def test_the_layer_checks_see_the_native_sources():
    """Guards the checks above against a move that leaves them nothing to look at."""
    for folder in NATIVE_LAYERS:
        assert list(_native_files(ROOT, [folder])), f"no native sources under {folder}/"
    included = {target for path in _native_files(ROOT, NATIVE_LAYERS) for _, target in _quoted_includes(path)}
    assert {"ordering/imm.h", "transport/transport.h", "proxy/fifo.h", "gpu_kernels/portability.cuh"} <= included


def test_python_package_has_no_import_cycle():
    cycles = import_cycles(import_graph(ROOT, "python/portep", "portep"))
    assert not cycles, _report(cycles)


def test_python_imports_point_down():
    graph = import_graph(ROOT, "python/portep", "portep")
    named = {m for rule in PORTEP_RULES for m in rule}
    assert not named - set(graph), f"the rules name modules that do not exist: {sorted(named - set(graph))}"
    violations = forbidden_imports(graph, PORTEP_RULES)
    assert not violations, _report(violations)


def test_portep_never_reaches_the_benchmarks_or_the_test_hooks():
    violations = uses_of_modules(ROOT / "python" / "portep", {"portep_bench", "portep_testing"}, ROOT)
    assert not violations, _report(violations)


def test_no_product_python_reaches_test_code():
    """portep_testing (the hooks built from tests/native) is meant for the benchmarks too, so bench may use it."""
    names = names_of_test_modules(ROOT)
    violations = [v for folder in PRODUCT_PYTHON for v in uses_of_modules(ROOT / folder, names, ROOT)]
    assert not violations, _report(violations)


def test_the_extension_is_installed_into_portep():
    assert ("_C", "portep") in installed_targets(ROOT)


def test_no_test_code_is_installed_unless_testing():
    violations = installed_test_code(ROOT)
    assert not violations, _report(violations)


def test_the_test_hooks_are_installed_only_when_testing_and_not_into_portep():
    assert "portep_testing" not in {t for t, _ in installed_targets(ROOT)}
    destinations = [d for t, d in installed_targets(ROOT, testing=True) if t == "portep_testing"]
    assert destinations and not any(d.split("/")[0] == "portep" for d in destinations), destinations


def test_the_wheel_packages_hold_no_tests():
    assert "python/portep" in wheel_packages(ROOT)
    violations = wheel_packages_with_tests(ROOT)
    assert not violations, _report(violations)


# ---- the checkers find what they look for (synthetic trees) ----


def _tree(tmp_path, files):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_checker_finds_an_upward_include(tmp_path):
    root = _tree(
        tmp_path,
        {
            "ordering/imm.h": "",
            "transport/t.h": '#include "ordering/imm.h"\n',
            "proxy/p.cpp": '#include "transport/t.h"\n\n#include "python/src/bind_util.h"\n',
            "python/src/bind_util.h": '#include "proxy/p.h"\n',
        },
    )
    assert upward_includes(root) == [
        "proxy/p.cpp:3: layer proxy/ includes python/src/bind_util.h of the higher layer python/src/"
    ]


def test_checker_finds_includes_not_from_the_root(tmp_path):
    root = _tree(
        tmp_path,
        {
            "proxy/fifo.h": "",
            "proxy/a.cpp": '#include "../proxy/fifo.h"\n',
            "proxy/b.cpp": '#include "fifo.h"\n',
            "gpu_kernels/c.cu": '# include "portep/fifo.h"\n',
            "tests/native/d.cpp": '#include "proxy/fifo.h"\n#include "proxy/gone.h"\n',
        },
    )
    assert includes_not_from_the_root(root) == [
        "proxy/a.cpp:1: relative or absolute include ../proxy/fifo.h",
        "proxy/b.cpp:1: include fifo.h is no file from the repository root",
        "gpu_kernels/c.cu:1: include portep/fifo.h from the old portep/ include folders",
        "tests/native/d.cpp:2: include proxy/gone.h is no file from the repository root",
    ]


def test_checker_finds_a_product_include_of_test_code(tmp_path):
    root = _tree(
        tmp_path,
        {
            "tests/native/probe.h": "",
            "gpu_kernels/k.cu": '#include "tests/native/probe.h"\n',
            "tests/native/x.cpp": '#include "tests/native/probe.h"\n',
        },
    )
    assert native_includes_of_test_code(root) == ["gpu_kernels/k.cu:1: includes test code tests/native/probe.h"]


def test_checker_finds_an_include_directory_besides_the_root(tmp_path):
    root = _tree(
        tmp_path,
        {
            "CMakeLists.txt": "target_include_directories(a PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})\n"
            "target_include_directories(b PRIVATE ${PORTEP_IBVERBS_INCLUDE})\n"
            "target_include_directories(c PUBLIC proxy/include)\n",
            "tests/native/CMakeLists.txt": "include_directories(${CMAKE_CURRENT_SOURCE_DIR})\n",
        },
    )
    assert include_dirs_besides_the_root(root) == [
        "CMakeLists.txt:3: include directory proxy/include besides the repository root",
        "tests/native/CMakeLists.txt:1: include directory ${CMAKE_CURRENT_SOURCE_DIR} besides the repository root",
    ]


def test_checker_finds_an_import_cycle_through_a_function(tmp_path):
    pkg = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\n",
            "pkg/a.py": "from .b import x\n",
            "pkg/b.py": "def f():\n    from pkg import a\n",
            "pkg/c.py": "from . import __version__\n",
        },
    )
    assert import_cycles(import_graph(pkg, "pkg", "pkg")) == ["pkg.a (pkg/a.py:1) -> pkg.b (pkg/b.py:2) -> pkg.a"]


def test_checker_finds_an_import_against_the_rules(tmp_path):
    pkg = _tree(
        tmp_path,
        {
            "portep/__init__.py": "",
            "portep/buffer.py": "",
            "portep/backends/__init__.py": "",
            "portep/backends/common.py": "",
            "portep/backends/host/__init__.py": "",
            "portep/backends/host/engine.py": (
                "from ...channel import Channel\nfrom ..common import X\nfrom ..cuda import engine\n"
            ),
            "portep/backends/cuda/__init__.py": "",
            "portep/backends/cuda/engine.py": "",
            "portep/channel.py": "def late():\n    import portep.backends.common as hb\n",
        },
    )
    assert forbidden_imports(import_graph(pkg, "portep", "portep"), PORTEP_RULES) == [
        "portep/backends/host/engine.py:3: portep.backends.host.engine imports portep.backends.cuda.engine "
        "(portep.backends.host must not import portep.backends.cuda)",
        "portep/channel.py:2: portep.channel imports portep.backends.common (portep.channel must not import "
        "portep.backends)",
    ]


def test_checker_finds_uses_of_the_benchmarks_and_the_test_hooks(tmp_path):
    root = _tree(
        tmp_path,
        {
            "python/portep/a.py": '"""portep_testing is not used here."""\nimport portep_bench.spawn\n',
            "python/portep/b.py": 'import importlib\nimportlib.import_module("portep_testing")\n',
            "python/portep/c.py": "def f():\n    from portep_testing import wire\n",
        },
    )
    assert uses_of_modules(root / "python" / "portep", {"portep_bench", "portep_testing"}, root) == [
        "python/portep/a.py:2: imports portep_bench.spawn",
        "python/portep/b.py:2: names 'portep_testing'",
        "python/portep/c.py:2: imports portep_testing",
    ]


def test_checker_finds_product_python_reaching_test_code(tmp_path):
    root = _tree(
        tmp_path,
        {
            "tests/support/dist_util.py": "",
            "bench/portep_bench/x.py": 'import sys\nsys.path.insert(0, "tests/support")\nfrom dist_util import spawn\n',
        },
    )
    assert uses_of_modules(root / "bench", names_of_test_modules(root), root) == [
        "bench/portep_bench/x.py:3: imports dist_util",
        "bench/portep_bench/x.py:2: names 'tests/support'",
    ]


def test_checker_finds_installed_test_code(tmp_path):
    root = _tree(
        tmp_path,
        {
            "CMakeLists.txt": """
add_library(core STATIC proxy/a.cpp)
set(SOURCES python/src/module.cpp)
list(APPEND SOURCES tests/native/hooks.cpp)
pybind11_add_module(_C ${SOURCES})
add_library(clean STATIC proxy/b.cpp)
target_link_libraries(clean PRIVATE core)
install(TARGETS _C clean LIBRARY DESTINATION portep)
if(PORTEP_BUILD_TESTING)
  add_subdirectory(tests/native)
else()
  install(TARGETS probes LIBRARY DESTINATION portep)
endif()
add_subdirectory(tests/other)
""",
            "tests/native/CMakeLists.txt": (
                "add_library(probes STATIC probe.cu)\ninstall(TARGETS probes DESTINATION .)\n"
            ),
            "tests/other/CMakeLists.txt": "install(FILES tests/other/hooks.py DESTINATION portep)\n",
        },
    )
    assert installed_test_code(root) == [
        "CMakeLists.txt:8: install(TARGETS _C) outside if(PORTEP_BUILD_TESTING), but _C is built from "
        "tests/native/hooks.cpp",
        "CMakeLists.txt:12: install(TARGETS probes) outside if(PORTEP_BUILD_TESTING), but probes is defined in "
        "tests/native/CMakeLists.txt",
        "CMakeLists.txt:14: add_subdirectory(tests/other) outside if(PORTEP_BUILD_TESTING)",
        "tests/other/CMakeLists.txt:1: install(FILES tests/other/hooks.py) outside if(PORTEP_BUILD_TESTING)",
    ]
    assert installed_targets(root, testing=True) == [("probes", ".")]


def test_checker_finds_test_code_linked_into_an_installed_target(tmp_path):
    root = _tree(
        tmp_path,
        {
            "CMakeLists.txt": "add_library(hooks STATIC tests/native/h.cpp)\n"
            "pybind11_add_module(_C python/src/m.cpp)\n"
            "target_link_libraries(_C PRIVATE hooks)\n"
            "install(TARGETS _C LIBRARY DESTINATION portep)\n"
        },
    )
    assert installed_test_code(root) == [
        "CMakeLists.txt:4: install(TARGETS _C) outside if(PORTEP_BUILD_TESTING), but hooks is built from "
        "tests/native/h.cpp"
    ]


def test_checker_finds_tests_in_the_wheel_packages(tmp_path):
    root = _tree(
        tmp_path, {"pyproject.toml": '[tool.scikit-build]\nwheel.packages = ["python/portep", "tests/support"]\n'}
    )
    assert wheel_packages_with_tests(root) == ["pyproject.toml: wheel.packages lists tests/support"]
