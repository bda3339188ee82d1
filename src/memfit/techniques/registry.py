"""The registered techniques: every module of ``memfit.techniques`` that defines ``TECHNIQUE``.

Found by walking the package on first use (``pkgutil``), so a technique is one new module; a
technique defined elsewhere (a plug-in, a test) joins with ``register`` and leaves with
``unregister`` or the ``registered`` context manager. Names and field names are unique.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil

from memfit.errors import MemfitError
from memfit.techniques.spec import KINDS, TRACES, Field, Technique

__all__ = ["techniques", "fields", "field", "register", "unregister", "registered"]

_REGISTRY: dict[str, Technique] = {}
_FOUND = False
_SORTED: dict = {}  # "techniques" / "fields": the sorted lists, until the registry changes


def _discover() -> None:
    global _FOUND
    if _FOUND:
        return
    _FOUND = True
    import memfit.techniques as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name in ("spec", "registry", "recipe", "apply"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        declared = getattr(module, "TECHNIQUE", None)
        if isinstance(declared, Technique) and declared.name not in _REGISTRY:
            register(declared)


def register(technique: Technique) -> Technique:
    """Add ``technique``: its fields join ``Recipe``, the CLI, ``apply`` and the planner."""
    _discover()
    if not isinstance(technique, Technique):
        raise MemfitError(f"register takes a memfit Technique, got {type(technique).__name__}")
    if technique.name in _REGISTRY:
        raise MemfitError(f"a technique named {technique.name!r} is registered already")
    taken = {f.name for f in fields()}
    for f in technique.fields:
        if f.name in taken:
            raise MemfitError(f"technique {technique.name!r}: the field {f.name!r} belongs to another technique")
        if f.kind not in KINDS:
            raise MemfitError(f"technique {technique.name!r}: field {f.name!r} has kind {f.kind!r}, not one of {KINDS}")
    if technique.trace not in TRACES:
        raise MemfitError(f"technique {technique.name!r}: trace {technique.trace!r} is not one of {TRACES}")
    _REGISTRY[technique.name] = technique
    _SORTED.clear()
    return technique


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    _SORTED.clear()


@contextlib.contextmanager
def registered(technique: Technique):
    """``technique`` registered for the ``with`` block only."""
    register(technique)
    try:
        yield technique
    finally:
        unregister(technique.name)


def techniques() -> tuple[Technique, ...]:
    """Every technique, in apply's order."""
    _discover()
    if "techniques" not in _SORTED:
        _SORTED["techniques"] = tuple(sorted(_REGISTRY.values(), key=lambda t: (t.order, t.name)))
    return _SORTED["techniques"]


def fields() -> tuple[Field, ...]:
    """Every Recipe field, in the recipe's order."""
    _discover()
    if "fields" not in _SORTED:
        _SORTED["fields"] = tuple(sorted((f for t in _REGISTRY.values() for f in t.fields),
                                         key=lambda f: (f.slot, f.name)))
    return _SORTED["fields"]


def field(name: str) -> Field | None:
    return next((f for f in fields() if f.name == name), None)
