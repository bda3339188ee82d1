"""The package reads as a pipeline: each layer imports only the layers below it.

Every module under src/memfit is parsed (not imported) and every import it makes is collected,
function-level ones included. Three rules:

* a module imports only modules of a lower rank, or of its own package (``memfit/__init__.py``,
  the public face, may import anything);
* a private name (``_x``, or a private module) is imported only within its own package;
* no import cycle between modules (function-level imports count: they are cycles deferred).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"

# Package (or top-level module) -> rank. A module may import a lower rank, or its own package
# (the top-level modules errors, units, categories and scoped are all of package ``memfit``).
RANKS = {
    # vocabulary: errors, sizes, the category and phase names every layer speaks, and scoped patches
    # (changes to torch undone on exit) every layer may make
    "memfit.errors": 0, "memfit.units": 0, "memfit.categories": 0, "memfit.scoped": 0,
    # what the step runs on and what it trains: GPUs and CUDA semantics; models and their sources
    "memfit.hardware": 1, "memfit.models": 1,
    # bytes of a step: the ledger, kernel scratch, the replay and the allocator models
    "memfit.accounting": 2,
    # the step itself and its memory techniques: recipe, apply, precision, optimizer, LoRA...
    "memfit.techniques": 3,
    # what an estimate says: the Report and its verdict vocabulary, and its tables
    "memfit.report": 4,
    # estimating a step: fake tensors, the trace, depth fast path, verdict, truth
    "memfit.estimator": 5,
    # searching recipes: plan, fit, composed candidates, cost model
    "memfit.planner": 6,
    # later stages on top of the planner
    "memfit.training": 7, "memfit.profiling": 7, "memfit.distributed": 7, "memfit.generation": 7,
    # the user's trainers: their config files read into memfit's terms (and, later, plans written back)
    "memfit.trainers": 7,
    # a user's own script on fake tensors: the profiler's watch under a device shim (``memfit.script``)
    "memfit.script": 8,
    # the local page (Gradio) over the public API
    "memfit.ui": 8,
    # the command line (``memfit ui`` serves the page)
    "memfit.cli": 9,
}
TOP = "memfit"  # memfit/__init__.py: the public API, may import anything


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "memfit").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str | None:
    """The entry of RANKS a module belongs to (None for ``memfit`` itself, or an unranked module)."""
    for name in sorted(RANKS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


def _package(module: str) -> str:
    """``memfit.x`` for a module of sub-package x, ``memfit`` for a top-level module."""
    parts = module.split(".")
    if len(parts) > 1 and (len(parts) > 2 or _is_package(module)):
        return ".".join(parts[:2])
    return "memfit"


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of ``module``.

    ``from memfit.a import b`` names module ``memfit.a.b`` where that is a module, else the name
    ``b`` of module ``memfit.a``."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    here = module if _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "memfit" or alias.name.startswith("memfit."):
                    out.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != "memfit" and not source.startswith("memfit."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    out.append((sub, None, node.lineno))
                else:
                    out.append((source, alias.name, node.lineno))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT.parent)}:{line} ({module})"


def test_every_module_has_a_rank():
    missing = [m for m in MODULES if m != TOP and _layer(m) is None]
    assert not missing, f"modules with no rank in RANKS: {missing}"
    unknown = sorted({t for imports in GRAPH.values() for t, _, _ in imports if t not in MODULES})
    assert not unknown, f"imports of modules that do not exist: {unknown}"


def test_imports_go_down_the_layers():
    bad = []
    for module, imports in GRAPH.items():
        if module == TOP or _layer(module) is None:  # unranked: test_every_module_has_a_rank says so
            continue
        mine, rank = _package(module), RANKS[_layer(module)]
        for target, name, line in imports:
            what = f"{target}" + (f".{name}" if name else "")
            if target == TOP:
                bad.append(f"{_where(module, line)} imports {what}: the public package sits on top of every "
                           "layer; import the module that defines it")
                continue
            if target not in MODULES or _layer(target) is None:
                continue
            theirs, above = _package(target), RANKS[_layer(target)]
            if theirs == mine:
                continue
            if above > rank:
                bad.append(f"{_where(module, line)} imports {what}: {theirs} (rank {above}) is above "
                           f"{mine} (rank {rank})")
            elif above == rank:
                bad.append(f"{_where(module, line)} imports {what}: {theirs} is a different package of the same "
                           f"rank ({rank})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_private_names_stay_in_their_package():
    bad = []
    for module, imports in GRAPH.items():
        for target, name, line in imports:
            if _package(target) == _package(module):
                continue
            private = [p for p in target.split(".") if p.startswith("_")]
            if name is not None and name.startswith("_"):
                private.append(name)
            if private:
                bad.append(f"{_where(module, line)} imports private {', '.join(private)} from {target}: make it "
                           "public or keep it in its package")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def _edges() -> dict[str, list[str]]:
    return {m: sorted({t for t, _, _ in imports if t in MODULES and t != m}) for m, imports in GRAPH.items()}


def _cycles(edges) -> list[list[str]]:
    """One cycle (a path back to its start) in each group of modules that reach one another."""
    def reach(start):
        seen, todo, parent = {start}, [start], {}
        while todo:
            m = todo.pop(0)
            for t in edges[m]:
                if t == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if t not in seen:
                    seen.add(t)
                    parent[t] = m
                    todo.append(t)
        return None

    out, covered = [], set()
    for m in sorted(edges):
        if m in covered:
            continue
        cycle = reach(m)
        if cycle:
            out.append(cycle)
            covered.update(cycle)
    return out


def test_no_import_cycles():
    bad = []
    for cycle in _cycles(_edges()):
        lines = {(m, t): min(line for tt, _, line in GRAPH[m] if tt == t) for m, t in zip(cycle, cycle[1:])}
        steps = "\n".join(f"  {_where(m, lines[m, t])} imports {t}" for m, t in zip(cycle, cycle[1:]))
        bad.append(f"import cycle {' -> '.join(cycle)}:\n{steps}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_should():
    """The analysis itself: packages and ranks, function-level imports, and a cycle found."""
    assert any(t == "memfit.planner.plan" for t, _, _ in GRAPH[TOP])
    assert _package("memfit.estimator.estimate") == _package("memfit.estimator") == "memfit.estimator"
    assert _package("memfit.errors") == _package("memfit.units") == "memfit"
    assert RANKS[_layer("memfit.planner.plan")] > RANKS[_layer("memfit.estimator.depth")]
    # one trace imports the depth fast path inside the function
    assert any(t == "memfit.estimator.depth" for t, _, _ in GRAPH["memfit.estimator.traced"])
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": ["b"], "b": []}) == []


# A module a reader can hold: over this many lines it is split by concept (issue 50), unless its docstring says why
# it must stay whole (a sentence with "whole" and the limit, e.g. "kept whole past 450 lines: ...").
LONGEST = 450


def _too_long(files) -> list[str]:
    out = []
    for path in files:
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > LONGEST and not ("whole" in doc and str(LONGEST) in doc):
            out.append(f"{path}: {lines} lines")
    return out


def test_no_module_past_the_longest_a_reader_holds(tmp_path):
    assert not _too_long(sorted(ROOT.rglob("*.py"))), _too_long(sorted(ROOT.rglob("*.py")))
    # the check itself: a long module fails, the same with its reason passes
    long = tmp_path / "long.py"
    long.write_text('"""A module."""\n' + "x = 1\n" * (LONGEST + 1))
    kept = tmp_path / "kept.py"
    kept.write_text(f'"""A module, kept whole past {LONGEST} lines: one state machine."""\n' + "x = 1\n" * (LONGEST + 1))
    assert _too_long([long, kept]) == [f"{long}: {LONGEST + 2} lines"]
