"""The seams between portep's Python modules (issue 35 item 3), read from the sources:

- no module touches another module's private attributes: `x._name` only on self, cls or another instance of the
  same class (`other`), or where the file itself defines `_name`; a private submodule of the package
  (`portep._C`, `portep._ll_torch`) is a module, not an attribute; NamedTuple's API (`_fields`, `_make`) is public;
  third-party modules (torch._C) are not checked;
- both engines implement backends.common.Engine, the contract buffer.py calls them through, with the same parameters.

A planted violation of each kind must be found, so a checker that stopped finding anything fails."""

import ast
import inspect
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("python/portep", "python/deep_ep")
OWN_NAMES = {"self", "cls", "other"}
NAMEDTUPLE_API = {"_fields", "_make", "_asdict", "_replace", "_field_defaults"}  # public, despite the underscore


def _private_modules(root):
    """Names of the package's private modules (files and compiled extensions whose name starts with '_')."""
    names = {"_C", "_ll_torch"}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("_*.py"):
            if not path.name.startswith("__"):
                names.add(path.stem)
    return names


def _third_party_roots(tree):
    """Names this module binds to imports from outside the package (import torch; from os import path)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(("portep", "deep_ep")):
                    roots.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith(("portep", "deep_ep")):
                roots.update(alias.asname or alias.name for alias in node.names)
    return roots


def _defined_privates(tree):
    """Private functions, methods and classes this file defines (an object of a class from this file may be reached
    through them); attributes it assigns on self do not count: another file's object may have one of that name."""
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return {n for n in names if n.startswith("_")}


def _root_name(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_access_violations(root):
    private_modules = _private_modules(root)
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            own, third_party = _defined_privates(tree), _third_party_roots(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
                    continue
                base = _root_name(node.value)
                if isinstance(node.value, ast.Name) and node.value.id in OWN_NAMES:
                    continue
                is_submodule = node.attr in private_modules and base in ("portep", "deep_ep")
                if node.attr in own or node.attr in NAMEDTUPLE_API or is_submodule or base in third_party:
                    continue
                rel = path.relative_to(root)
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)} reaches another module's private attribute")
    return out


def test_no_module_touches_another_modules_private_attributes():
    assert private_access_violations(ROOT) == []


def test_the_private_access_check_sees_the_package():
    files = sum(1 for pkg in PACKAGES for _ in (ROOT / pkg).rglob("*.py"))
    assert files > 25


def test_checker_finds_a_private_attribute_of_another_module(tmp_path):
    pkg = tmp_path / "python" / "portep"
    pkg.mkdir(parents=True)
    (tmp_path / "python" / "deep_ep").mkdir()
    (pkg / "_native.py").write_text("")  # a private module named as the attribute: still an attribute
    (pkg / "channel.py").write_text("class Channel:\n    def __init__(self):\n        self._native = 1\n")
    (pkg / "engine.py").write_text(
        "import torch\nimport portep._C\n\n"
        "def run(self, channel, other):\n"
        "    self._native = channel\n"  # assigning one's own attribute of that name does not license the access
        "    torch._C.foo()\n"  # third party: not checked
        "    portep._C.bar()\n"  # a private submodule: fine
        "    other._x = 1\n"  # another instance of one's own class: fine
        "    return channel._native\n"
    )
    found = private_access_violations(tmp_path)
    assert len(found) == 1 and "engine.py:9: channel._native" in found[0], found


# ---- the engine contract ----


def _engines():
    from portep.backends.common import Engine
    from portep.backends.cuda.engine import CudaEngine
    from portep.backends.host.engine import HostEngine

    return Engine, (HostEngine, CudaEngine)


def contract_violations(protocol, engine_classes):
    """Each of the protocol's methods, on each engine, with the protocol's parameters (names, order, defaults
    aside); each of its attributes declared by each engine (assigned in __init__ or a property)."""
    out = []
    methods = {n: f for n, f in vars(protocol).items() if callable(f) and not n.startswith("_")}
    attributes = set(getattr(protocol, "__annotations__", {}))
    for cls in engine_classes:
        assigned = set()
        for c in cls.__mro__[:-1]:  # the class and its bases but object
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(c)))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        assigned.add(node.attr)
        for name, method in methods.items():
            impl = getattr(cls, name, None)
            if impl is None:
                out.append(f"{cls.__name__} lacks {name}()")
                continue
            want = list(inspect.signature(method).parameters)
            have = list(inspect.signature(impl).parameters)
            if want != have:
                out.append(f"{cls.__name__}.{name}{tuple(have)} differs from the contract's {tuple(want)}")
        for name in sorted(attributes):
            if name not in assigned and not isinstance(getattr(cls, name, None), property):
                out.append(f"{cls.__name__} does not set {name}")
    return out


def test_both_engines_implement_the_engine_contract():
    protocol, engines = _engines()
    assert contract_violations(protocol, engines) == []


def test_the_contract_covers_what_the_buffer_calls():
    """Every engine method buffer.py calls is in the contract."""
    protocol, _ = _engines()
    tree = ast.parse((ROOT / "python/portep/buffer.py").read_text())
    getters = {"_engine", "_ll_engine", "_shrink_engine"}  # Buffer's methods that return its engine

    def is_engine(node):
        if isinstance(node, ast.Name):
            return node.id in ("engine", "runtime")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr == "runtime"
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in getters

    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_engine(node.value)}
    assert len(used) > 10, f"buffer.py uses only {sorted(used)} of its engine: update this test"
    declared = set(vars(protocol)) | set(protocol.__annotations__)
    missing = sorted(used - declared)
    assert not missing, f"buffer.py uses engine members outside backends.common.Engine: {missing}"


def test_checker_finds_a_broken_contract():
    class Contract:
        size: int

        def dispatch(self, x, handle): ...

    class Good:
        def __init__(self):
            self.size = 1

        def dispatch(self, x, handle): ...

    class Bad:
        def dispatch(self, *args): ...

    assert contract_violations(Contract, [Good]) == []
    found = contract_violations(Contract, [Bad])
    assert len(found) == 2 and "Bad.dispatch('self', 'args')" in found[0] and "size" in found[1], found
