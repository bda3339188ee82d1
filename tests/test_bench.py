"""bench/: every bench is listed by `python -m bench list` from its own docstring and RESULTS, every results
file has one owner and one shape ({"meta", "rows", "summary"}), and bench/_results.py writes that shape."""

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _results  # noqa: E402
from bench.__main__ import benches  # noqa: E402

RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


def _pattern(name: str) -> str:
    """A declared name as a glob: <card> (any placeholder) stands for any text."""
    while "<" in name:
        name = name[:name.index("<")] + "*" + name[name.index(">") + 1:]
    return name


def test_every_bench_module_is_listed():
    modules = {p.relative_to(ROOT / "bench").with_suffix("").as_posix()
               for p in (ROOT / "bench").glob("*/*.py") if not p.name.startswith("_")}
    listed = {f"{b.group}/{b.name}" for b in benches()}
    assert listed == modules
    assert len({b.name for b in benches()}) == len(listed), "a bench's name must be unique across folders"
    for bench in benches():
        assert bench.purpose, bench.path
        assert (ROOT / "bench" / bench.group / "__init__.py").exists()


def test_results_names_are_unique_and_every_file_has_one_owner():
    listed = benches()
    declared = [name for b in listed for name in b.results]
    assert len(declared) == len(set(declared))
    for path in RESULTS:
        owners = {b.name for b in listed for n in b.results if fnmatch.fnmatch(path.name, _pattern(n))}
        assert len(owners) == 1, f"{path.name} written by {owners or 'no bench'}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_results_file_has_the_one_schema(path):
    data = json.loads(path.read_text())
    assert set(data) == {"meta", "rows", "summary"}
    assert set(_results.META_KEYS) <= set(data["meta"])
    assert isinstance(data["rows"], list) and all(isinstance(row, dict) for row in data["rows"])
    assert isinstance(data["summary"], dict)


def test_python_m_bench_list_runs():
    done = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for bench in benches():
        assert f"  {bench.name} " in done.stdout
        for name in bench.results:
            assert name in done.stdout


def test_write_fills_meta_and_merge_keeps_the_other_parts(tmp_path):
    out = tmp_path / "x.json"
    _results.write(out, _results.tables(a=[{"v": 1}], b=[{"v": 2}]), {"a": {"n": 1}}, model="m")
    data = _results.read(out)
    assert data["meta"]["command"] and data["meta"]["device"] and data["meta"]["torch"]
    assert data["meta"]["model"] == "m" and data["meta"]["date"]
    _results.merge(out, {"a": {"n": 3, "rows": [{"v": 3}]}})
    data = _results.read(out)
    assert _results.table(data, "a") == [{"v": 3}] and _results.table(data, "b") == [{"v": 2}]
    assert data["summary"]["a"] == {"n": 3}
    assert _results.by_name(_results.named({"k": {"v": 1}})) == {"k": {"v": 1}}
