"""A fast subset of bench/fuzz.py: malformed and edge inputs to the API and the CLI give a result
or one short MemfitError line (CLI: exit status 2), never a traceback.

The full run (>= 1000 cases, ``python bench/fuzz.py``) writes bench/results/fuzz.json.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import fuzz  # noqa: E402


def test_fuzz_subset_has_no_failures():
    # plans are left to the full run (bench/fuzz.py): a plan's first traces take 10 s or more
    result = fuzz.fuzz(seed=11, cases=500, kinds={"recipe", "recipe_load", "estimate", "cli_estimate", "cli_misc"})
    assert result["cases"] >= 350
    assert result["outcomes"].get("api result", 0) and result["outcomes"].get("api MemfitError", 0)
    assert result["failures"] == 0, [f["problem"] for f in result["failed"]]


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "fuzzfactories:raises"], "raised RuntimeError"),
    (["plan", "gpt2", "--global-batch-size", "1000000000", "--budget", "1GiB"], "global_batch_size"),
])
def test_real_processes_exit_2_with_one_line(tmp_path, argv, needle):
    import subprocess

    fuzz.Workspace(str(tmp_path))  # writes fuzzfactories.py
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(fuzz.ROOT, "src"), str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and fuzz._judge_cli(2, proc.stderr, argv) is None, proc.stderr
    assert needle in proc.stderr


def test_the_judge_fails_what_it_should():
    """The pass criterion itself: a traceback, two lines, a long line or another status fail."""
    assert fuzz._judge_cli(2, "memfit: error: bad --budget: write it like 24GiB\n", ["estimate"]) is None
    assert fuzz._judge_cli(0, "", ["gpus"]) is None
    assert fuzz._judge_cli(2, "Traceback (most recent call last):\n  File x\n", ["estimate"])
    assert fuzz._judge_cli(2, "memfit: error: one\nand two\n", ["estimate"])
    assert fuzz._judge_cli(2, "memfit: error: " + "x" * 1000 + "\n", ["estimate"])
    assert fuzz._judge_cli(1, "memfit: nothing fits\n", ["estimate"])
    assert fuzz._judge_cli(1, "memfit: nothing fits 1 GiB\n", ["plan"]) is None
    assert fuzz._api(lambda: {}["missing"]).startswith("KeyError")
    assert fuzz._api(lambda: (_ for _ in ()).throw(fuzz.MemfitError("fine"))) is None


def test_cases_are_the_same_for_a_seed(tmp_path):
    def kinds(folder):
        os.makedirs(folder)
        return [c["kind"] for c in fuzz.make_cases(3, 80, fuzz.Workspace(str(folder)))]

    first, again = kinds(tmp_path / "a"), kinds(tmp_path / "b")
    assert first == again and set(first) >= {"recipe", "recipe_load", "estimate", "plan", "cli_estimate"}
