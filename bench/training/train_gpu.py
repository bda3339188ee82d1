"""`memfit train` on a GPU as a new user runs it: the command line end to end, the time to its first step
with and without a cached plan, and its speed against the best hand-written loop in the same budget.

    python -m bench train_gpu --out DIR          # on a machine with one CUDA GPU -> DIR/train-gpu-<card>.json
    python -m bench train_gpu --smoke --out DIR  # here: a tiny model on the CPU, the plumbing without a GPU

1. **The command line.** ``memfit train MODEL --data tokens.bin --budget B`` (random ``uint32`` tokens, the
   planner choosing every field, calibration on) twice in fresh output folders sharing one plan cache: the
   first plans, the second finds the stored plan. For each: exit status, the first line it printed (what
   it chose), seconds from launch to the first line of ``metrics.jsonl`` (the first step done), tokens/s
   and peak from ``metrics.jsonl``.
2. **The speed.** ``bench/training/train_speed.py``'s comparison (memfit's choice against a grid of plain loops under
   ``set_per_process_memory_fraction``) for one model and a few budgets.

The JSON is rewritten after every run, so a run cut short by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
from bench import _results  # noqa: E402
SRC = os.path.join(ROOT, "src")
RESULTS = "train-gpu-<card>.json"

# (model, seq_len, global batch, budget): the two commands
RUNS = [("llama-3.2-1b", 2048, 16, "24GiB"), ("qwen3-0.6b", 1024, 32, "16GiB")]


def _tokens(path: str, n: int, vocab: int) -> None:
    import numpy as np

    np.random.default_rng(0).integers(1, vocab, n, dtype=np.uint32).tofile(path)


def cli_run(model: str, data: str, out: str, *, seq: int, batch: int, budget: str, steps: int, cache: str,
            device: str, extra=()) -> dict:
    """One ``memfit train`` process; seconds to its first step = launch to metrics.jsonl's first line."""
    cmd = [sys.executable, "-m", "memfit.cli", "train", model, "--data", data, "--dtype", "uint32", "--seq-len",
           str(seq), "--global-batch-size", str(batch), "--steps", str(steps), "--budget", budget, "--out-dir", out,
           "--device", device, "--no-tensorboard", *extra]
    env = {**os.environ, "MEMFIT_CACHE": cache, "PYTHONPATH": SRC}
    metrics = os.path.join(out, "metrics.jsonl")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = None
    while proc.poll() is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            first = time.perf_counter() - start
        time.sleep(0.05)
    total = time.perf_counter() - start
    stdout, stderr = proc.communicate()
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    if first is None and lines:
        first = total
    later = lines[1:] or lines
    return {"command": "memfit " + " ".join(cmd[4:]), "exit": proc.returncode,
            "first_line": (stderr.strip().splitlines() or [""])[0], "stderr_tail": stderr.strip().splitlines()[-6:],
            "seconds_to_first_step": None if first is None else round(first, 1), "seconds": round(total, 1),
            "steps": len(lines), "tokens_per_second": round(sum(x["tokens"] for x in later)
                                                            / max(1e-9, sum(x["seconds"] for x in later)))
            if lines else None,
            "peak_bytes": max((x.get("memory_peak") or 0 for x in lines), default=None),
            "predicted_step_seconds": next((x.get("predicted_step_seconds") for x in lines), None),
            "measured_step_seconds": [x["seconds"] for x in lines]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(_results.DIR))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the plumbing without a GPU")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: cli, speed")
    parser.add_argument("--speed-model", default="qwen3-0.6b")
    parser.add_argument("--budgets", default="16GiB,40GiB")
    parser.add_argument("--cli-models", default=",".join(r[0] for r in RUNS), help="which of the command-line runs")
    args = parser.parse_args()
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("train_gpu: no CUDA GPU visible to torch: skipped (run it on a machine with one, or --smoke)")
        return
    os.makedirs(args.out, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        os.environ["MEMFIT_DEVICE"] = "cuda"
    from memfit.hardware.gpus import visible_gpu

    card = visible_gpu()
    name = "cpu" if card is None else card.name
    path = os.path.join(args.out, f"train-gpu-{name}.json")
    result = {"cli": [], "speed": None}
    on = torch.cuda.get_device_name(0) if device == "cuda" else _results.device_name()

    def save():
        speed = result["speed"] or {"rows": []}
        shape = {k: v for k, v in speed.items() if k != "rows"}
        _results.write(path, _results.tables(cli=result["cli"], speed=speed["rows"]), {"speed": shape} if shape else {},
                       device=on, card=name)

    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    wanted = {x.strip() for x in args.cli_models.split(",")}
    runs = [("tiny", 64, 4, "64MiB")] if args.smoke else [r for r in RUNS if r[0] in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        if "cli" not in skip:
            for model, seq, batch, budget in runs:
                if model == "tiny":
                    from bench.training.train_speed import tiny_config

                    model = os.path.join(tmp, "tiny")
                    tiny_config(layers=2, hidden=64).save_pretrained(model)
                data = os.path.join(tmp, "tokens.bin")
                _tokens(data, seq * batch * 6 + 1, 512 if args.smoke else 32000)
                cache = os.path.join(tmp, f"cache-{os.path.basename(model)}")
                for attempt in ("planned", "cached plan"):
                    out = os.path.join(tmp, f"run-{os.path.basename(model)}-{attempt.split()[0]}")
                    got = cli_run(model, data, out, seq=seq, batch=batch, budget=budget, steps=4, cache=cache,
                                  device=device)
                    got.update(model=os.path.basename(model) if args.smoke else model, attempt=attempt)
                    print(f"{got['model']} {attempt}: exit {got['exit']}, first step after "
                          f"{got['seconds_to_first_step']} s, {got['tokens_per_second']} tok/s; {got['first_line']}",
                          flush=True)
                    result["cli"].append(got)
                    save()
        if "speed" not in skip:
            from bench.training import train_speed
            from memfit.units import parse_size

            config = train_speed.tiny_config(layers=2, hidden=64) if args.smoke else train_speed._config(args.speed_model)
            budgets = [parse_size(b) for b in ("40MiB", "96MiB")] if args.smoke else \
                [parse_size(b) for b in args.budgets.split(",")]
            shape = dict(batch=4, seq=64) if args.smoke else dict(batch=32, seq=1024)
            result["speed"] = {"model": "tiny" if args.smoke else args.speed_model, **shape, "rows": []}

            def keep(rows):
                result["speed"]["rows"] = list(rows)
                save()

            train_speed.compare(config, device, budgets, **shape, on_row=keep,
                                log=lambda line: print(line, flush=True))
    save()
    print(f"-> {path}")


if __name__ == "__main__":
    main()
