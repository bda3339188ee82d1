"""train() on two processes under torchrun (gloo on this CPU): FSDP2 and DDP runs equal the
one-process run of the same global batches; out-of-memory errors injected on either rank, in
forward, backward and the optimizer step, are redone by both ranks and change nothing; a 2-rank
checkpoint resumes on 1 and on 4 ranks with the same losses; a rank killed with SIGKILL is restarted
by torchrun and resumes; ``memfit train --nproc-per-node 2`` launches torchrun and rank 0 reports.
The many-run versions (100 faults, 30 kills) are ``bench/faults/train_ranks.py``."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from memfit.training.lockstep import even_micro_batches, split_by_tokens

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import _ranks_worker as worker  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
RECIPE = {"micro_batch_size": 2}


def _torchrun(nproc, case, restarts=0, popen=False):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={restarts}", str(ROOT / "tests" / "_ranks_worker.py"), json.dumps(case)]
    if popen:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    if isinstance(case, list):
        return None
    return [json.loads(Path(case["out_dir"], f"result-{r}.json").read_text()) for r in range(nproc)]


def _examples(out_dir):
    seen = {}
    for line in open(Path(out_dir) / "metrics.jsonl"):
        row = json.loads(line)
        seen[row["step"]] = row["examples"]
    return seen


def _weights(out_dir):
    return load_file(sorted(glob.glob(f"{out_dir}/step-*/model.safetensors"))[-1])


def _close(a, b, tol=1e-5):
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=tol)


# runs the tests only read: one 2-rank torchrun for all (``_ranks_worker.run_many``), each in its own folder
PLAIN = ("fsdp", "ddp")
INJECT = {
    "fsdp": {"1": [[0, 0, "forward", 7], [2, 1, "backward", 3]], "0": [[1, 1, "forward", 2], [3, 0, "optimizer", 2]]},
    "ddp": {"0": [[0, 0, "forward", 3]], "1": [[1, 1, "backward", 4], [2, 0, "optimizer", 1]]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{(parallel, kind): (out_dir, each rank's result)}``: 4 steps of 8 examples on 2 ranks, FSDP2 and DDP, plain
    (kind None) and with out-of-memory errors injected (``INJECT``); and FSDP2's 2 constant steps (its checkpoint)."""
    keys = [(p, None) for p in PLAIN] + [(p, "oom") for p in INJECT] + [("fsdp", "constant")]
    cases = []
    for parallel, kind in keys:
        case = {"out_dir": str(tmp_path_factory.mktemp(f"{parallel}-{kind}")), "steps": 4,
                "recipe": dict(RECIPE, parallel=parallel)}
        if kind == "oom":
            case["inject"] = INJECT[parallel]
        if kind == "constant":  # the checkpoint the resume test copies: 2 steps, a constant schedule
            case.update(steps=2, schedule="constant")
        cases.append(case)
    _torchrun(2, cases)
    return {key: (Path(case["out_dir"]), [json.loads(Path(case["out_dir"], f"result-{r}.json").read_text())
                                          for r in range(2)]) for key, case in zip(keys, cases)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run: 4 steps of 8 examples, 2 rows per micro-batch."""
    out = tmp_path_factory.mktemp("one")
    model, result = worker.run({"out_dir": str(out), "steps": 4, "recipe": RECIPE})
    return {"losses": result["losses"], "examples": _examples(out),
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_shares_hold_every_example_once_balanced_by_tokens():
    lengths = np.array([64, 3, 40, 40, 9, 1, 17, 22, 5, 64])
    ids = [9, 0, 2, 4, 6, 8, 1, 3, 5, 7]
    shares = split_by_tokens(ids, lengths, 3)
    assert sorted(i for share in shares for i in share) == sorted(ids)
    loads = [sum(int(lengths[i]) for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(lengths[ids])  # greedy by tokens, longest first
    assert split_by_tokens(ids, lengths, 3) == shares  # the same on every rank
    assert split_by_tokens([4], lengths, 2) == [[4], []]  # fewer examples than ranks


def test_even_micro_batches_split_the_largest_then_borrow():
    assert even_micro_batches([[[1], [2], [3], [4]]], 3) == [[[1]], [[2]], [[3], [4]]]
    assert even_micro_batches([[[1]]], 3) == [[[1]], None, None]
    assert even_micro_batches([], 2) == [None, None]


@pytest.mark.parametrize("parallel", PLAIN)
def test_two_ranks_equal_one_process(runs, reference, parallel):
    tmp_path, results = runs[parallel, None]
    assert [r["world_size"] for r in results] == [2, 2]
    np.testing.assert_allclose(results[0]["losses"], reference["losses"], rtol=1e-6)
    assert results[0]["losses"] == results[1]["losses"]  # the world's loss, on every rank
    assert _examples(tmp_path) == reference["examples"]  # none lost or repeated
    _close(_weights(tmp_path), reference["weights"])
    line = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert [r["rank"] for r in line["ranks"]] == [0, 1] and line["micro_batches"] >= 2
    assert not (tmp_path / "result-1.json").read_text() == ""  # every rank ran to the end


@pytest.mark.parametrize("parallel", INJECT)
def test_ooms_on_either_rank_are_redone_by_both(runs, reference, parallel):
    inject = INJECT[parallel]
    tmp_path, results = runs[parallel, "oom"]
    for rank, faults in inject.items():
        own = [e for e in results[int(rank)]["ooms"] if e["phase"] != "another rank's"]
        assert [e["phase"] for e in own] == [f[2] for f in faults]
    peers = [e for r in results for e in r["ooms"] if e["phase"] == "another rank's"]
    assert len(peers) == sum(f[2] != "optimizer" for faults in inject.values() for f in faults)
    assert _examples(tmp_path) == reference["examples"]
    _close(_weights(tmp_path), reference["weights"])


def test_a_two_rank_checkpoint_resumes_on_one_and_on_four(tmp_path, runs):
    constant = {"schedule": "constant", "recipe": dict(RECIPE, parallel="fsdp")}
    _, straight = worker.run({"out_dir": str(tmp_path / "one"), "steps": 4, "schedule": "constant",
                              "recipe": RECIPE})
    shutil.copytree(runs["fsdp", "constant"][0], tmp_path / "two")  # 2 steps on 2 ranks
    assert (tmp_path / "two" / "step-000000002" / ".metadata").is_file()
    shutil.copytree(tmp_path / "two", tmp_path / "four")
    _, alone = worker.run({"out_dir": str(tmp_path / "two"), "steps": 4, "schedule": "constant", "recipe": RECIPE})
    assert alone["resumed_from"] == 2
    np.testing.assert_allclose(alone["losses"], straight["losses"][2:], rtol=1e-6)
    four = _torchrun(4, dict(constant, out_dir=str(tmp_path / "four"), steps=4))
    assert four[0]["resumed_from"] == 2
    np.testing.assert_allclose(four[0]["losses"], straight["losses"][2:], rtol=1e-6)


def test_a_killed_rank_is_restarted_and_resumes(tmp_path, reference):
    case = {"out_dir": str(tmp_path / "killed"), "steps": 4, "checkpoint_every": 2, "slow_checkpoint": 0.3,
            "recipe": dict(RECIPE, parallel="fsdp")}
    process = _torchrun(2, case, restarts=2, popen=True)
    began = time.monotonic()
    while not (tmp_path / "killed" / "step-000000002").exists() and time.monotonic() - began < 120:
        time.sleep(0.02)
    time.sleep(0.1)  # inside the last checkpoint's write (0.3 s before each fsync)
    pids = subprocess.run(["pgrep", "-f", "_ranks_worker.py"], capture_output=True, text=True).stdout.split()
    victims = [int(p) for p in pids if int(p) != process.pid and str(tmp_path) in _cmdline(int(p))]
    assert victims, "no training process found to kill"
    os.kill(victims[-1], signal.SIGKILL)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-3000:]
    result = json.loads((tmp_path / "killed" / "result-0.json").read_text())
    assert result["resumed_from"] == 2 and result["steps"] == 4
    assert _examples(tmp_path / "killed") == reference["examples"]
    _close(_weights(tmp_path / "killed"), reference["weights"])


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_cli_launches_torchrun_and_rank_zero_reports(tmp_path, train_in_process):
    """``memfit train --nproc-per-node 2`` in this process (``train_in_process``, tests/conftest.py): only the ranks
    start Python; what they print is this process's stdout, which is rank 0's summary
    alone. (``python -m memfit.cli``'s exit status is main's: tests/test_cli.py runs it.)"""
    out = tmp_path / "run"
    code, printed = train_in_process([ROOT / "examples" / "tiny-llama" / "config.json", "--seq-len", "64",
                                      "--global-batch-size", "4", "--steps", "3", "--out-dir", out,
                                      "--nproc-per-node", "2", "--parallel", "fsdp", "--json"])
    assert code == 0, printed.err[-3000:]
    summary = json.loads(printed.out)  # rank 0 alone prints
    assert summary["processes"] == 2 and summary["steps"] == 3
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [x["step"] for x in lines] == [1, 2, 3] and all(len(x["ranks"]) == 2 for x in lines)
    assert (out / "step-000000003" / "model.safetensors").is_file()


def test_cli_launch_errors_are_one_line(tmp_path, monkeypatch, capfd):
    # in this process (each is refused before torchrun starts; a subprocess paid ~4 s of imports for each):
    # ``python -m memfit.cli`` exits with main's status (tests/test_cli.py runs it)
    from memfit.cli import main

    monkeypatch.chdir(tmp_path)
    model = str(ROOT / "examples" / "tiny-llama" / "config.json")
    for extra, words in ((["--nnodes", "2", "--nproc-per-node", "2", "--parallel", "fsdp"], "--rdzv-endpoint"),
                         (["--nproc-per-node", "2"], "--parallel fsdp"),
                         (["--max-restarts", "2"], "--nproc-per-node")):
        capfd.readouterr()
        status = main(["train", model, "--data", "x.bin", "--seq-len", "8", "--steps", "1", "--global-batch-size", "2",
                       *extra])
        err = capfd.readouterr().err
        assert status == 2 and words in err and len(err.strip().splitlines()) == 1, err
