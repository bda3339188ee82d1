"""The command line: tables, JSON, budgets, and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from memfit.cli import main


def test_estimate_json_with_budget(capsys):
    assert main(["estimate", "gpt2", "--seq-len", "64", "--budget", "24GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["fits"] is True
    assert data["budget"]["margin_bytes"] == 24 * 2**30 - data["peak_bytes"]
    assert data["method"] == "depth"


def test_estimate_table_says_whether_it_fits(capsys):
    assert main(["estimate", "bert-base", "--seq-len", "64", "--budget", "1GB", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "does not fit in" in out and "optimizer_state" in out and "bytes/param" in out


def test_models_lists_the_catalog(capsys):
    assert main(["models", "--json"]) == 0
    assert "llama-3.1-8b" in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "lama-3-8b"], "did you mean"),
    (["estimate", "gpt2", "--budget", "lots"], "24GiB"),
    (["estimate", "gpt2", "--seq-len", "0"], "positive"),
    (["estimate", "gpt2", "--optimizer", "lion"], "adamw"),
    (["estimate", "gpt2", "--gpu", "rtx-9999"], "rtx-4090"),
])
def test_errors_are_one_line_with_status_2(argv, needle, capsys):
    # in this process (each a subprocess took ~5 s of imports); test_conflicting_flags_name_both_fields below and
    # test_fuzz.py's test_real_processes_exit_2_with_one_line run python -m memfit.cli as a real process
    try:
        status = main(list(argv))
    except SystemExit as exit_:  # argparse's errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_recipe_file_and_flags_compose(tmp_path, capsys):
    (tmp_path / "r.yaml").write_text("precision: bf16-mixed\ncheckpointing: blocks\n")
    argv = ["estimate", "gpt2", "--seq-len", "64", "--batch-size", "2", "--recipe", str(tmp_path / "r.yaml"),
            "--grad-accum-steps", "2",
            "--json"]
    assert main(argv) == 0
    recipe = json.loads(capsys.readouterr().out)["settings"]["recipe"]
    assert (recipe["precision"], recipe["checkpointing"], recipe["grad_accum_steps"]) == ("bf16-mixed", "blocks", 2)


def test_conflicting_flags_name_both_fields():
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", "gpt2", "--optimizer-in-backward",
                           "--grad-accum-steps", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "optimizer_in_backward" in proc.stderr and "grad_accum_steps" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_estimate_for_a_gpu_uses_its_memory_and_counts_reserved_and_context(capsys):
    assert main(["estimate", "gpt2", "--seq-len", "64", "--gpu", "rtx-4090", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cuda" and data["gpu"] == "rtx-4090"
    assert data["device_bytes"] == data["reserved_bytes"] + data["outside_bytes"] >= data["peak_bytes"]
    assert data["budget"]["budget_bytes"] == 25_757_220_864  # the card's memory when no --budget
    assert data["budget"]["margin_bytes"] == 25_757_220_864 - data["device_bytes"]


def test_gpus_lists_the_catalog(capsys):
    assert main(["gpus", "--json"]) == 0
    names = {g["name"] for g in json.loads(capsys.readouterr().out)}
    assert {"rtx-4090", "h100-sxm", "a100-80gb", "t4"} <= names
