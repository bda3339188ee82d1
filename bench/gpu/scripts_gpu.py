"""Users' unchanged scripts on a real GPU against ``memfit estimate SCRIPT.py`` made on that machine's CPU.

    PYTHONPATH=src python3 -m bench scripts_gpu    # on a machine with a GPU: bench/results/scripts-gpu-<card>.json
    python -m bench scripts_gpu regrade --truths FILE --out DIR   # the estimates again against recorded truths

For each case, two fresh processes: the script run on the card, stopped after the same optimizer steps, its
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` read at the end (``memfit.script.truth.card_peak``);
and ``memfit estimate --gpu CARD --json SCRIPT ...`` with ``CUDA_VISIBLE_DEVICES=""`` (the estimate sees no GPU),
four at a time while the truths run one by one.
The card is the catalog's entry for the GPU torch sees.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
from bench import _results  # noqa: E402
SRC = os.path.join(ROOT, "src")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
RESULTS = "scripts-gpu-<card>.json"

GPT_124M = ["--n_layer=12", "--n_head=12", "--n_embd=768", "--block_size=1024", "--batch_size=12", "--grad_accum=4",
            "--vocab_size=50304", "--eval_interval=1000"]
# (name, script, its arguments, optimizer steps)
CASES = [
    ("plain loop", "plain_loop.py", ["--batch-size", "32", "--seq", "512", "--width", "512"], 2),
    ("nanoGPT 124M bf16", "gpt_train.py", [*GPT_124M, "--dtype=bfloat16"], 2),
    ("nanoGPT 124M fp16 + GradScaler", "gpt_train.py", [*GPT_124M, "--dtype=float16"], 2),
    ("nanoGPT 124M compiled", "gpt_train.py", [*GPT_124M, "--dtype=bfloat16", "--compile=True"], 2),
    ("Llama-3.2-1B loop, from_pretrained config", "hf_loop.py", ["llama-3.2-1b", "--seq", "2048"], 2),
    ("HF Trainer", "hf_trainer.py", ["out"], 2),
    ("accelerate", "accelerate_train.py", [], 2),
    ("Lightning", "lightning_train.py", ["out"], 2),
]


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _data(folder: str) -> None:
    import numpy as np

    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 1024, size=300_000).astype(np.uint16).tofile(os.path.join(folder, "data", f"{split}.bin"))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.models.catalog import lookup

    entry = lookup("llama-3.2-1b")  # random bf16 weights: the script's real from_pretrained reads them
    config = AutoConfig.for_model(entry.model_type, **entry.config)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(os.path.join(folder, "llama-3.2-1b"))


def _truth(path, argv, steps, folder) -> dict:
    code = ("import json, sys; from memfit.script.truth import card_peak; "
            f"print('MEMFIT', json.dumps(card_peak({path!r}, {argv!r}, steps={steps})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, env=_env())
    line = next((l for l in done.stdout.splitlines() if l.startswith("MEMFIT ")), None)
    if line is None:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no result"}
    return json.loads(line[7:])


def _estimate(card: str, path, argv, steps, folder) -> dict:
    done = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", "--gpu", card, "--steps", str(steps),
                           "--json", path, *argv], cwd=folder, capture_output=True, text=True,
                          env=_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2"))
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    data = json.loads(done.stdout)
    return {"allocated": data["peak_bytes"], "reserved": data["reserved_bytes"], "verdict": data["verdict"]}


def main(jobs: int = 4) -> None:
    import torch

    from memfit.hardware.gpus import visible_gpu

    card = visible_gpu()
    if card is None:
        raise SystemExit("no GPU: this bench grades scripts run on a card (bench/accuracy/scripts.py is the CPU's)")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        _data(folder)
        # the estimates run on the CPU while the truths hold the card, in a folder of their own (the scripts
        # write their outputs beside them) that shares the data and the model
        blind = os.path.join(folder, "estimates")
        os.makedirs(blind)
        for shared in ("data", "llama-3.2-1b"):
            os.symlink(os.path.join(folder, shared), os.path.join(blind, shared))
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            estimates = [pool.submit(_estimate, card.name, os.path.join(SCRIPTS, script), argv, steps, blind)
                         for _, script, argv, steps in CASES]
            for (name, script, argv, steps), estimate in zip(CASES, estimates):
                path = os.path.join(SCRIPTS, script)
                real = _truth(path, argv, steps, folder)
                row = _grade({"case": name, "script": script, "argv": argv, "steps": steps, "truth": real},
                             estimate.result())
                rows.append(row)
                print(json.dumps(row), flush=True)
    path = _results.write(f"scripts-gpu-{card.name}.json", rows, device=torch.cuda.get_device_name(), card=card.name)
    print(f"wrote {path}")


def _grade(row: dict, estimate: dict) -> dict:
    row = {k: v for k, v in row.items() if not k.endswith("_error_pct")} | {"estimate": estimate}
    if "error" not in row["truth"] and "error" not in estimate:
        for key in ("allocated", "reserved"):
            row[f"{key}_error_pct"] = round(100 * (estimate[key] - row["truth"][key]) / row["truth"][key], 3)
    return row


def regrade(truths: str, out: str, jobs: int = 8) -> None:
    """The estimates made again (this machine, this memfit) against a GPU session's recorded truths."""
    recorded = _results.read(truths)
    card = recorded["meta"]["card"]
    with tempfile.TemporaryDirectory() as folder:
        _data(folder)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            estimates = [pool.submit(_estimate, card, os.path.join(SCRIPTS, row["script"]), row["argv"], row["steps"],
                                     folder) for row in recorded["rows"]]
            rows = []
            for row, estimate in zip(recorded["rows"], estimates):
                rows.append(_grade(row, estimate.result()))
                print(json.dumps({k: rows[-1][k] for k in ("case", "estimate")}
                                 | {k: v for k, v in rows[-1].items() if k.endswith("_pct")}), flush=True)
    # the truths' own session (a file regraded before names it under truths_from)
    truths_from = recorded["meta"].get("truths_from", recorded["meta"])
    meta = {k: v for k, v in recorded["meta"].items()
            if k not in ("command", "date", "torch", "transformers", "truths_from")}
    import torch

    meta["estimated_on"] = f"{platform.node() or 'this machine'}'s CPU, torch {torch.__version__} (no GPU visible)"
    path = _results.write(os.path.join(out, os.path.basename(truths)), rows, truths_from=truths_from, **meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="?", default="run", choices=("run", "regrade"),
                        help="run: truths on the card and estimates; regrade: estimates again against --truths")
    parser.add_argument("--truths", default=None, help="regrade: a scripts-gpu-<card>.json with the card's truths")
    parser.add_argument("--out", default=str(_results.DIR))
    args = parser.parse_args()
    if args.stage == "regrade":
        regrade(args.truths, args.out)
    else:
        main()
