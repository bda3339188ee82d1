"""One shape for every results file in bench/results/, and the one function that writes it.

    {"meta": {"command", "device", "torch", "transformers", "date", ...},   # how it was run
     "rows": [{...}, ...],                                                  # one dict per case
     "summary": {...}}                                                      # totals, worst errors

``write`` fills meta itself: the command as run (``python -m bench NAME ...``), the device (the GPU's
name when the bench used CUDA, else the CPU's model), the installed torch and transformers, today's
date; a bench adds its own settings (model, batch, seq_len) as keywords. A file with several tables
keeps them all in ``rows``, each row tagged with its ``part`` (``tables``); a table keyed by case name
becomes rows with a ``name`` (``named``). Readers take them back with ``read``, ``table``, ``by_name``.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

DIR = Path(__file__).resolve().parent / "results"
ROOT = DIR.parents[1]
META_KEYS = ("command", "device", "torch", "transformers", "date")

# set by ``python -m bench NAME`` so meta records the runner's command rather than the module's path
COMMAND: str | None = None


def _version(package: str) -> str | None:
    if package in sys.modules and hasattr(sys.modules[package], "__version__"):
        return sys.modules[package].__version__  # the one imported, even from a path beside the installed one
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def device_name() -> str:
    """The GPU's name when this process has used CUDA, else the CPU's model and its core count."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    return _cpu_model()


def command() -> str:
    if COMMAND:
        return COMMAND
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


def meta(**extra) -> dict:
    """meta for a file written now: the five keys first, then the bench's own settings."""
    base = {"command": command(), "device": device_name(), "torch": _version("torch"),
            "transformers": _version("transformers"), "date": datetime.date.today().isoformat()}
    return {**base, **extra}


def path(name: str | os.PathLike) -> Path:
    """A bare file name is one in bench/results/; a path (an --out folder's file) is kept."""
    name = Path(name)
    return DIR / name if name.parent == Path(".") else name


def write(name, rows: list, summary: dict | None = None, **extra) -> Path:
    """Write {"meta", "rows", "summary"} to ``name`` (see ``path``); ``extra`` goes into meta."""
    out = path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta(**extra), "rows": list(rows), "summary": dict(summary or {})}
    partial = out.with_name(out.name + ".tmp")  # a bench killed mid-write leaves the last good file
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, out)
    return out


def read(name) -> dict:
    with open(path(name)) as f:
        return json.load(f)


def named(cases: dict) -> list:
    """{name: {...}} as rows, each with its ``name`` first."""
    return [{"name": key, **value} for key, value in cases.items()]


def by_name(rows: list) -> dict:
    """The inverse of ``named``: {name: row without its name}."""
    return {row["name"]: {k: v for k, v in row.items() if k != "name"} for row in rows}


def tables(**parts: list) -> list:
    """Several tables as one list of rows, each tagged with its ``part``: tables(tiny=[...], full=[...])."""
    return [{"part": name, **row} for name, rows in parts.items() for row in rows]


def table(data: dict, name: str) -> list:
    """One part's rows back, without their tag."""
    return [{k: v for k, v in row.items() if k != "part"} for row in data["rows"] if row.get("part") == name]


def merge(name, parts: dict[str, dict], **extra) -> Path:
    """Rewrite some parts of a file and keep the others as last written (a bench run one mode at a
    time). Each part is a dict of totals, with its table under "rows" if it has one: the rows go into
    ``rows`` tagged with the part, the totals into ``summary[part]``; ``extra`` goes into meta."""
    old = read(name) if path(name).exists() else {"rows": [], "summary": {}}
    rows = [row for row in old["rows"] if row.get("part") not in parts]
    summary = dict(old["summary"])
    for part, value in parts.items():
        totals = {k: v for k, v in value.items() if k != "rows"}
        rows += tables(**{part: value.get("rows", [])})
        summary[part] = totals
    return write(name, rows, summary, **extra)
