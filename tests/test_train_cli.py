"""memfit train plans for speed by default (issue 34 items 2 and 4): with a budget and no recipe file
the fastest recipe that fits is planned around the recipe flags given, said in the first line, stored,
and a rerun reads the stored plan and the run's stored micro-batch estimates instead of estimating."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples" / "tiny-llama" / "config.json")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """examples/tiny-llama with 2 blocks instead of 4: each estimate the planner and the run make costs its ops."""
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(json.loads(Path(CONFIG).read_text()) | {"num_hidden_layers": 2}))
    return str(path)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tokens.py"), str(path)], check=True,
                   capture_output=True)
    return str(path)


def _train(config, tokens, out, *extra):
    return ["train", config, "--data", tokens, "--seq-len", "64", "--global-batch-size", "4", "--steps", "2",
            "--out-dir", str(out), "--json", *extra]


def _first_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("memfit train:"))


def test_a_budget_plans_the_fastest_recipe_and_a_rerun_reads_it_back(config, tokens, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    # the planner's own choice (calibration may pick another on shared cores: a predicted plan, which the run
    # then checks with estimates of its own; tests/test_train_plan.py times candidates)
    assert main(_train(config, tokens, out, "--budget", "96MiB", "--precision", "bf16-mixed", "--no-calibrate")) == 0
    captured = capsys.readouterr()
    line = _first_line(captured.err)
    assert "fastest recipe that fits" in line and "planned in" in line and "tokens/s" in line
    assert "kept as given: precision=bf16-mixed" in line
    summary = json.loads(captured.out)
    assert summary["recipe"]["precision"] == "bf16-mixed" and summary["steps"] == 2
    assert summary["peak_bytes"] <= 96 * 2**20
    first = [json.loads(x) for x in open(out / "metrics.jsonl")]
    # rows of one length, the plan made for it: its micro-batch and full estimate size the run (no estimate)
    assert all(line["estimate_seconds"] == 0 for line in first) and not (out / "estimates.json").exists()
    peak = max(line["memory_peak"] for line in first)
    assert abs(first[0]["predicted"] - peak) <= peak / 1000  # the plan's full estimate is the run's peak
    # the plan's predicted step time beside each measured one
    assert all(line["predicted_step_seconds"] > 0 and line["seconds"] > 0 for line in first)
    stored = list((tmp_path / "cache" / "plans").glob("*.json"))
    assert len(stored) == 1

    # the same question again: the stored plan (nothing estimated)
    assert main(_train(config, tokens, out, "--budget", "96MiB", "--precision", "bf16-mixed", "--no-calibrate",
                       "--no-resume")) == 0
    captured = capsys.readouterr()
    assert "the stored plan" in _first_line(captured.err)
    assert json.loads(captured.out)["recipe"] == summary["recipe"]
    again = [json.loads(x) for x in open(out / "metrics.jsonl")][len(first):]
    assert again and all(line["estimate_seconds"] == 0 for line in again)
    assert [line["predicted_step_seconds"] for line in again] == [line["predicted_step_seconds"] for line in first]



def test_a_plan_is_stored_under_everything_its_answer_depends_on(tmp_path, monkeypatch):
    from memfit.models.source import resolve
    from memfit.planner.stored import load_plan, plan_key

    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    source = resolve(CONFIG)
    question = dict(budget=2**27, gpu=None, device="cpu", global_batch_size=4, seq_len=64, fixed={"precision": "bf16"})
    key = plan_key(source, **question)
    assert key == plan_key(source, **dict(question))
    for change in ({"budget": 2**28}, {"fixed": {"precision": "bf16", "checkpointing": "blocks"}}, {"seq_len": 128},
                   {"gpu": "h100-sxm", "device": "cuda"}):
        assert plan_key(source, **{**question, **change}) != key
    config = tmp_path / "deeper" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(json.loads(open(CONFIG).read()) | {"num_hidden_layers": 3}))
    other = resolve(str(config))
    assert plan_key(other, **question) != key
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / f"{key}.json").write_text("{not json")
    assert load_plan(key) is None  # a damaged file is a miss, never an error


@pytest.mark.parametrize("recipe, flags, device, budget, gpu, plans", [
    (None, {}, "cpu", 2**26, None, True),            # a budget: planned
    (None, {}, "cpu", None, None, False),            # CPU, nothing to fit: the default recipe
    (None, {}, "cuda", None, None, True),            # the GPU it trains on
    (None, {}, "cpu", None, "h100-sxm", True),       # a card named
    ("r.yaml", {}, "cpu", 2**26, None, False),       # a recipe file is the user's recipe
    ("auto", {}, "cpu", 2**26, None, True),
    (None, {"no_plan": True}, "cpu", 2**26, None, False),
    (None, {"parallel": "fsdp"}, "cpu", 2**26, None, False),  # many processes: plan --gpus N plans those
])
def test_when_train_plans(recipe, flags, device, budget, gpu, plans):
    import argparse

    from memfit.cli.train import _plans

    args = argparse.Namespace(no_plan=flags.get("no_plan", False))
    changes = {k: v for k, v in flags.items() if k != "no_plan"}
    assert _plans(args, {"gpu": gpu}, recipe, device, budget, changes) is plans


def test_no_plan_trains_the_flags_as_given(config, tokens, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    assert main(_train(config, tokens, tmp_path / "a", "--budget", "96MiB", "--no-plan", "--precision", "bf16-mixed")) == 0
    captured = capsys.readouterr()
    assert "memfit train:" not in captured.err and json.loads(captured.out)["recipe"]["precision"] == "bf16-mixed"
    assert not (tmp_path / "cache").exists()
