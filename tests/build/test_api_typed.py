"""Type hints and docstrings on portep's API (issue 35 item 6): every function and public method of the modules a
user reaches (portep's and deep_ep's exports, and every public module of the package) has a hint on each
parameter, a return hint and a docstring. The engines (portep.backends) are internal and not held to it yet; the
test names them."""

import importlib
import inspect
import pkgutil

import portep

NOT_YET = ("portep.backends",)  # internal: the engines


def _functions(obj):
    """(name, function) of a class's public methods and properties (and __init__)."""
    for name, member in vars(obj).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property):
            member = member.fget
        elif isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member):
            yield name, member


def missing_hints(fn, name):
    """What `fn` lacks: a hint per parameter (self and cls aside), a return hint (not for __init__), a docstring."""
    out = []
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
            out.append(f"{name}: parameter {p.name} has no type hint")
    if sig.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
        out.append(f"{name}: no return type hint")
    if not inspect.getdoc(fn):
        out.append(f"{name}: no docstring")
    return out


def module_violations(module):
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            out += missing_hints(obj, f"{module.__name__}.{name}")
        elif inspect.isclass(obj):
            for method_name, fn in _functions(obj):
                out += missing_hints(fn, f"{module.__name__}.{name}.{method_name}")
    return out


def _public_modules():
    names = ["portep"]
    for info in pkgutil.walk_packages(portep.__path__, "portep."):
        if not info.name.rsplit(".", 1)[-1].startswith("_") and not info.name.startswith(NOT_YET):
            names.append(info.name)
    return [importlib.import_module(n) for n in names]


def test_the_exports_of_portep_and_deep_ep_are_typed_and_documented():
    import deep_ep

    out = []
    for module in (portep, deep_ep):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                out += missing_hints(obj, f"{module.__name__}.{name}")
            elif inspect.isclass(obj):
                out += [v for m, fn in _functions(obj) for v in missing_hints(fn, f"{module.__name__}.{name}.{m}")]
    assert out == []


def test_every_public_module_is_typed_and_documented():
    modules = _public_modules()
    assert len(modules) >= 12, [m.__name__ for m in modules]
    assert [v for m in modules for v in module_violations(m)] == []


def test_the_check_finds_what_is_missing():
    def untyped(a, b: int):
        return a

    def typed(a: int) -> int:
        """Documented."""
        return a

    found = missing_hints(untyped, "untyped")
    assert found == ["untyped: parameter a has no type hint", "untyped: no return type hint", "untyped: no docstring"]
    assert missing_hints(typed, "typed") == []
