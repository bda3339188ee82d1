"""The one way in: ``python -m bench list`` names every bench; ``python -m bench NAME [ARGS...]`` runs one.

    python -m bench list                  # each bench: its folder, purpose and results file(s)
    python -m bench accuracy              # = make bench NAME=accuracy
    python -m bench cuda_gap estimate     # ARGS go to the bench as its own command line

The list is read from the benches themselves, never kept by hand: every public module in a folder of
bench/ is a bench, its purpose is its docstring's first sentence and its results are its ``RESULTS``
constant (file names in bench/results/; ``<card>`` stands for the GPU's short name). Both are read
with ``ast``, so listing imports neither torch nor the benches. A bench runs in this process as
``__main__`` (``runpy``), so its own ``python bench/G/NAME.py`` workers still work.
"""
from __future__ import annotations

import ast
import runpy
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    name: str  # the module's name: what `python -m bench NAME` takes
    group: str  # its folder: what it measures
    purpose: str  # its docstring's first paragraph, on one line
    results: tuple[str, ...]  # what it writes in bench/results/ (none: it prints, or writes elsewhere)
    path: Path

    @property
    def module(self) -> str:
        return f"bench.{self.group}.{self.name}"


def _results_of(tree: ast.Module) -> tuple[str, ...]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RESULTS" for t in node.targets):
            value = ast.literal_eval(node.value)
            return () if value is None else (value,) if isinstance(value, str) else tuple(value)
    raise ValueError("declares no RESULTS")


def read(path: Path) -> Bench:
    tree = ast.parse(path.read_text(), str(path))
    doc = ast.get_docstring(tree)
    if not doc:
        raise ValueError(f"{path}: no docstring (its first line is the bench's purpose)")
    try:
        results = _results_of(tree)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (None when it writes nothing to bench/results/)") from None
    purpose = " ".join(doc.split("\n\n")[0].split())
    return Bench(path.stem, path.parent.name, purpose, results, path)


def benches() -> list[Bench]:
    return [read(p) for p in sorted(HERE.glob("*/*.py")) if not p.name.startswith("_")]


def find(name: str) -> Bench:
    found = [b for b in benches() if name in (b.name, f"{b.group}/{b.name}", b.module)]
    if len(found) != 1:
        raise SystemExit(f"no bench {name!r}: `python -m bench list` names them" if not found else
                         f"{name!r} is ambiguous: {', '.join(b.module for b in found)}")
    return found[0]


def show() -> None:
    group = None
    for bench in benches():
        if bench.group != group:
            group = bench.group
            doc = ast.get_docstring(ast.parse((HERE / group / "__init__.py").read_text())) or ""
            print(f"\n{group}/  {doc.splitlines()[0] if doc else ''}")
        lines = textwrap.wrap(bench.purpose, 96) + ([f"-> {', '.join(bench.results)}"] if bench.results else [])
        print(f"  {bench.name:20} " + f"\n  {'':20} ".join(lines))


def run(name: str, args: list[str]) -> None:
    bench = find(name)
    from bench import _results

    _results.COMMAND = " ".join(["python -m bench", bench.name, *args])
    sys.argv = [str(bench.path), *args]
    runpy.run_module(bench.module, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
    elif argv[0] == "list":
        show()
    else:
        run(argv[0], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
