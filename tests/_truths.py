"""Every module's 2-rank truths (``memfit.distributed.truth``) run in ONE ``torchrun`` per test session.

A torchrun launch costs about 20 CPU seconds before its first case (the launcher and two ranks importing torch,
transformers and memfit, the first model built and profiled); a further tiny case about 1. Each module declares
its cases when it is imported (``register``: pytest imports every test module at collection, on every xdist
worker, so each worker knows the same list), and the first module fixture to ask (``results``) runs them all in
one ``launch_many``; every other module, on this worker or the other, reads the same file. The workers share a
folder (the parent of their ``basetemp``); a file lock makes the second wait for the first's launch rather than
start its own. The cases are graded exactly as before: each case on a process group of its own, its own profiler
window, each rank's peak from its own allocator events (``truth.py``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from memfit.distributed.truth import launch_many

_GROUPS: dict[str, list[tuple[dict, dict]]] = {}
_LAST: set[str] = set()


def register(group: str, cases: list[tuple[dict, dict]], last: bool = False) -> None:
    """``cases``: (model config, truth case without its ``model``), each a 2-rank truth of module ``group``;
    ``last``: run after every other group's (DeepSpeed's: importing it patches torch in the ranks' processes)."""
    _GROUPS[group] = [(dict(config), dict(case)) for config, case in cases]
    if last:
        _LAST.add(group)


def _root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's basetemp is a folder of the run's own (pytest-of-user/pytest-N/popen-gw0)
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _written(root: Path, config: dict) -> str:
    text = json.dumps(config, sort_keys=True)
    folder = root / "truth-configs" / hashlib.sha256(text.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    if not path.exists():
        path.write_text(text)
    return str(path)


def results(tmp_path_factory, group: str) -> list[list[dict]]:
    """Per case of ``group`` (as registered), each rank's result: from this session's one launch of every group."""
    groups = sorted(_GROUPS, key=lambda name: (name in _LAST, name))
    listed = [(name, config, case) for name in groups for config, case in _GROUPS[name]]
    key = hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()[:16]
    root = _root(tmp_path_factory)
    done = root / f"truths-{key}.json"
    with open(root / f"truths-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            cases = [dict(case, model=_written(root, config)) for _, config, case in listed]
            ran = launch_many(cases, 2)
            found: dict[str, list] = {}
            for (name, _, _), ranks in zip(listed, ran):
                found.setdefault(name, []).append(ranks)
            partial = done.with_suffix(".partial")
            partial.write_text(json.dumps(found))
            partial.replace(done)
    return json.loads(done.read_text())[group]
