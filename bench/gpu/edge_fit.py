"""The largest micro-batch ``memfit fit`` says fits a real card, and the next one, each run for real.

    python -m bench edge_fit estimate --gpu h200 --out DIR   # no GPU needed: DIR/fit-edge-estimates.json
    python -m bench edge_fit measure --estimates FILE --out DIR   # on the GPU: DIR/fit-edge-<card>.json
    python -m bench edge_fit one CASE BATCH BUDGET               # one run in this process (what measure spawns)

Issue 53's question for the verdict: at the largest batch memfit says fits, does it fit, and does the
next one fail? Three models, as people train them: an LLM with bf16 autocast and fused AdamW
(Llama-3.2-1B at 2048 tokens), a LoRA fine-tune (Llama-3.2-3B, rank 16, bf16 autocast), and a
convolutional net (ResNet-50 at 224 x 224, fp32, from Hugging Face's ``ResNetConfig``: the config is
written here, no hub). Each under two budgets: the whole card, and one a little past what micro-batch 1
needs (40, 48 and 24 GiB) as ``memfit train --budget`` enforces one: ``set_per_process_memory_fraction``
of what the budget leaves the allocator once the process's memory outside it is taken off
(``estimator.verdict.limits``).

``estimate`` runs ``memfit.fit`` for each (case, budget) in its own process (``--jobs`` at a time, with
``CUDA_VISIBLE_DEVICES=""``): the answer B, the estimate at B and the one at B + 1 (``Fit.next_bytes``).
``measure`` runs B and B + 1 for three optimizer steps, each in a fresh process (an empty caching
allocator), and records whether it raised ``torch.OutOfMemoryError`` and the allocator's peaks. The
budget runs go first, ``--parallel`` at a time (their caps sum to less than the card); the whole-card
runs then one at a time, after the processes ``--wait-pids`` names have ended (nothing else on the
card). Graded: right when B completes and B + 1 runs out. B + 1 completing means memfit was
conservative by at least one sample; B running out, optimistic.

``memfit fit --longest`` the same way (``LONGEST``): the longest sequence it says fits at one row, and ``MULTIPLE``
tokens more, each run for real, under a budget only (the whole card would take a sequence too long to run in a
lease).

Left out: the expandable-segments rerun ``edge.py`` makes (fit answers for the default allocator).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
from bench import _results  # noqa: E402

RESULTS = ("fit-edge-estimates.json", "fit-edge-<card>.json")
GiB = 1 << 30
STEPS = 3
RESNET50 = {"architectures": ["ResNetForImageClassification"], "model_type": "resnet", "num_channels": 3,
            "embedding_size": 64, "hidden_sizes": [256, 512, 1024, 2048], "depths": [3, 4, 6, 3],
            "layer_type": "bottleneck", "hidden_act": "relu", "downsample_in_first_stage": False,
            "num_labels": 1000, "image_size": 224}
# name -> (model, sequence length, Recipe fields, the budget beside the whole card: a little past micro-batch 1)
CASES = {
    "llama1b-bf16-fused": ("llama-3.2-1b", 2048, {"precision": "bf16-mixed", "optimizer_impl": "fused"}, 40 * GiB),
    "llama3b-lora16": ("llama-3.2-3b", 2048, {"precision": "bf16-mixed", "lora": "lora:16"}, 48 * GiB),
    "resnet50-fp32": ("resnet-50", None, {}, 24 * GiB),
    # fit --longest: the sequence searched at one row (the "batch" of these cases is the sequence length)
    "llama1b-longest": ("llama-3.2-1b", None, {"precision": "bf16-mixed", "checkpointing": "blocks",
                                               "chunked_loss": 8}, 32 * GiB),
}
LONGEST = {"llama1b-longest"}
MULTIPLE = 64  # the longest cases' step: the answer, then this many tokens more


def _model(name: str) -> str:
    """A catalog name, or the ResNet-50 config written to a folder of its own (the same on both machines)."""
    if name != "resnet-50":
        return name
    folder = os.path.join(tempfile.gettempdir(), "memfit-edge-resnet-50")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(RESNET50, f)
    return folder


# -- estimates (no GPU) -------------------------------------------------------------------------------
def fit_one(case: str, budget: int | None, card: str) -> dict:
    import memfit

    name, seq, fields, _ = CASES[case]
    start = time.perf_counter()
    if case in LONGEST:  # the batch of a longest case is its sequence length
        found = memfit.longest(_model(name), hardware=memfit.Hardware(gpu=card, budget=budget),
                               recipe=memfit.Recipe(**fields), multiple=MULTIPLE)
        return {"case": case, "budget": budget, "card": card, "batch": found.seq_len, "step": MULTIPLE,
                "allocated": found.allocated_bytes, "reserved": found.reserved_bytes, "device": found.device_bytes,
                "budget_bytes": found.budget_bytes, "next_bytes": found.next_bytes,
                "at_limit": found.next_bytes is None,
                "tight": getattr(found.report, "tight", None), "seconds": round(time.perf_counter() - start, 1)}
    found = memfit.fit(_model(name), hardware=memfit.Hardware(gpu=card, budget=budget),
                       data=memfit.Data(seq_len=seq), recipe=memfit.Recipe(**fields))
    return {"case": case, "budget": budget, "card": card, "batch": found.micro_batch_size, "step": 1,
            "allocated": found.allocated_bytes, "reserved": found.reserved_bytes, "device": found.device_bytes,
            "budget_bytes": found.budget_bytes, "next_bytes": found.next_bytes, "at_limit": found.at_limit,
            "tight": getattr(found.report, "tight", None),
            "seconds": round(time.perf_counter() - start, 1)}


def estimate_all(card: str, out: str, jobs: int) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    work = [(case, budget) for case in CASES for budget in (CASES[case][3], None)
            if budget or case not in LONGEST]

    def spawn(item):
        case, budget = item
        proc = subprocess.run([sys.executable, __file__, "fit", case, str(budget or 0), "--gpu", card],
                              capture_output=True, text=True, env=env)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("MEMFIT ")), None)
        if line is None:
            return {"case": case, "budget": budget, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        return json.loads(line[7:])

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        rows = list(pool.map(spawn, work))
    for row in rows:
        print(json.dumps(row), flush=True)
    path = _results.write(os.path.join(out, RESULTS[0]), rows, gpu_semantics=card, steps=STEPS)
    print(f"wrote {path}")


# -- truths (on the GPU) ------------------------------------------------------------------------------
def measure_one(case: str, batch: int, budget: int | None) -> dict:
    """One run of ``batch`` in this fresh process, capped as ``memfit train --budget`` caps it."""
    import torch

    from memfit import Recipe
    from memfit.estimator.verdict import limits, run_outside
    from memfit.hardware.gpus import visible_gpu
    from memfit.models.source import resolve
    from memfit.techniques.apply import run_steps

    name, seq, fields, _ = CASES[case]
    recipe = Recipe(**fields)
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = None
    if budget:
        card = visible_gpu()
        allowed = limits(card, min(budget, card.memory_bytes), run_outside(card, recipe, 1).bytes)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total))
    source = resolve(_model(name))
    torch.manual_seed(0)
    rows, seq = (1, batch) if case in LONGEST else (batch, seq)  # a longest case's "batch" is its length
    data = source.make_batch(rows, seq)
    data = {k: v.cuda() for k, v in data.items()} if isinstance(data, dict) else data.cuda()
    oom, error = False, None
    start = time.perf_counter()
    try:
        with torch.device("cuda"):
            model = source.build()
        run_steps(model, data, recipe=recipe, steps=STEPS)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as err:
        oom, error = True, str(err).splitlines()[0][:200]
    stats = torch.cuda.memory_stats()
    free, _ = torch.cuda.mem_get_info()
    return {"oom": oom, "error": error, "allocated": stats["allocated_bytes.all.peak"],
            "reserved": stats["reserved_bytes.all.peak"], "retries": stats.get("num_alloc_retries", 0),
            "allowed": allowed, "total_memory": total, "used_now": total - free,
            "seconds": round(time.perf_counter() - start, 1)}


def _spawn(case: str, batch: int, budget: int | None) -> dict:
    proc = subprocess.run([sys.executable, __file__, "one", case, str(batch), str(budget or 0)],
                          capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("MEMFIT ")), None)
    if line is None:
        return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(line[7:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _grade(fits: dict, next_: dict) -> str:
    if "failed" in fits or "failed" in next_:
        return "failed"
    if not fits["oom"] and next_["oom"]:
        return "right"
    return "optimistic" if fits["oom"] else "conservative"


def measure_all(estimates: str, out: str, parallel: int, wait_pids: list[int]) -> None:
    import torch

    rows = [r for r in _results.read(estimates)["rows"] if "error" not in r]
    runs = {}  # (case, budget, batch) -> truth

    def run(key):
        runs[key] = _spawn(*key)
        print(json.dumps({"run": key, **runs[key]}), flush=True)
        _results.write(os.path.join(out, "fit-edge-partial.json"),  # if the lease ends first
                       [{"case": k[0], "batch": k[1], "budget": k[2], **v} for k, v in runs.items()])

    keys = [(r["case"], r["batch"] + d * r.get("step", 1), r["budget"]) for r in rows for d in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        list(pool.map(run, [k for k in keys if k[2]]))
    while any(_alive(pid) for pid in wait_pids):
        time.sleep(2)
    for key in keys:
        if not key[2]:
            run(key)
    graded = []
    for r in rows:
        fits = runs[(r["case"], r["batch"], r["budget"])]
        next_ = runs[(r["case"], r["batch"] + r.get("step", 1), r["budget"])]
        graded.append({**r, "truth_at_batch": fits, "truth_at_next": next_, "grade": _grade(fits, next_),
                       "reserved_error_pct": None if "failed" in fits or fits["oom"] else
                       round(100 * (r["reserved"] - fits["reserved"]) / fits["reserved"], 3)})
    summary = {"cases": len(graded), "right": sum(g["grade"] == "right" for g in graded),
               "grades": {g["case"] + ("" if not g["budget"] else f"@{g['budget'] // GiB}GiB"): g["grade"]
                          for g in graded}}
    tag = torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0]
    path = _results.write(os.path.join(out, f"fit-edge-{tag}.json"), graded, summary, cuda=torch.version.cuda,
                          device=torch.cuda.get_device_name(), estimates_from=_results.read(estimates)["meta"])
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("estimate", "measure", "fit", "one"))
    parser.add_argument("case", nargs="?")
    parser.add_argument("numbers", nargs="*", type=int,
                        help="fit: BUDGET; one: BATCH (a longest case's: its length) BUDGET (0: the whole card)")
    parser.add_argument("--gpu", default="h200", help="estimate/fit: the card whose semantics and memory")
    parser.add_argument("--out", default=str(_results.DIR))
    parser.add_argument("--estimates", default=os.path.join(str(_results.DIR), RESULTS[0]))
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--parallel", type=int, default=1, help="measure: budget runs at a time")
    parser.add_argument("--wait-pids", default="", help="measure: the whole-card runs wait for these processes")
    args = parser.parse_args()
    if args.stage == "estimate":
        estimate_all(args.gpu, args.out, args.jobs)
    elif args.stage == "measure":
        measure_all(args.estimates, args.out, args.parallel, [int(p) for p in args.wait_pids.split(",") if p])
    elif args.stage == "fit":
        print("MEMFIT " + json.dumps(fit_one(args.case, args.numbers[0] or None, args.gpu)), flush=True)
    else:
        print("MEMFIT " + json.dumps(measure_one(args.case, args.numbers[0], args.numbers[1] or None)), flush=True)


if __name__ == "__main__":
    main()
