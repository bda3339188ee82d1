"""``memfit estimate SCRIPT.py`` on users' unchanged scripts (tests/scripts/), on this CPU.

    python -m bench scripts            # every part; writes bench/results/scripts-cpu.json
    python -m bench scripts truth      # only the five scripts against their real runs (also: ranks, speed)

* truth: each script run for real on this CPU under the allocator's own events (``memfit.script.truth``), stopped
  after the same optimizer steps, against ``memfit.estimate_script(..., device="cpu")``;
* ranks: a torchrun script (FSDP2, DDP) as each of 2 ranks against ``torchrun`` over gloo;
* speed: the issue's two timings, ``memfit estimate --gpu h100-sxm`` of a 124M-parameter nanoGPT-style script at
  batch 12 x 1024 with 40 accumulation micro-steps (``--steps 2``), and of a plain loop over Llama-3.2-1B
  loaded with ``from_pretrained`` (its config only) at 1 x 2048, bf16 autocast and fused AdamW;
* agreement: that same Llama loop against ``memfit.estimate`` of the catalog model with the same recipe (two paths
  through memfit, not an independent truth: the GPU session grades both against ``max_memory_allocated``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
from bench import _results  # noqa: E402
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
RESULTS = "scripts-cpu.json"

RANKS = [("ddp_train --fsdp", ["--fsdp"]), ("ddp_train (DDP)", [])]
TRUTH = [("plain_loop", [], 2), ("gpt_train", [], 4), ("hf_trainer", ["out"], 2), ("accelerate_train", [], 2),
         ("lightning_train", ["out"], 2),
         # torch.compile(model) in the script: the truth compiles for real (about 80 s on 2 cores)
         ("gpt_train", ["--compile=True", "--dtype=float32", "--grad_accum=1", "--eval_interval=100"], 2)]
GPT_124M = ["--n_layer=12", "--n_head=12", "--n_embd=768", "--block_size=1024", "--batch_size=12", "--grad_accum=40",
            "--vocab_size=50304", "--dtype=bfloat16", "--eval_interval=1000"]


def _data(folder: str, tokens: int = 300_000, vocab: int = 50_000) -> None:
    import numpy as np

    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, vocab, size=tokens).astype(np.uint16).tofile(os.path.join(folder, "data", f"{split}.bin"))


def truth() -> list[dict]:
    import memfit
    from memfit.script.truth import script_peak

    rows = []
    for name, argv, steps in TRUTH:
        with tempfile.TemporaryDirectory() as folder:
            os.chdir(folder)
            _data(folder, 20_000, 1024)
            path = os.path.join(SCRIPTS, f"{name}.py")
            real, _ = script_peak(path, argv, steps=steps)
            began = time.perf_counter()
            estimate = memfit.estimate_script(path, argv, steps=steps, device="cpu").peak_bytes
            rows.append({"script": " ".join([name, *argv]), "steps": steps, "truth_bytes": real, "estimate_bytes": estimate,
                         "error_pct": round(100 * (estimate - real) / real, 4),
                         "seconds": round(time.perf_counter() - began, 1)})
            print(rows[-1], flush=True)
            os.chdir(HERE)
    return rows


def ranks() -> list[dict]:
    """The torchrun script over 2 gloo ranks, 3 launches each: FSDP2's peak is the same in every launch; DDP's is
    either the estimate's or one parameter copy more (gloo, launch to launch): each launch is recorded."""
    import memfit
    from memfit.script.truth import ranks_peak

    rows = []
    path = os.path.join(SCRIPTS, "ddp_train.py")
    for name, flags in RANKS:
        launches = [[r["peak_bytes"] for r in ranks_peak(path, flags, nproc=2, steps=2)] for _ in range(3)]
        estimates = [memfit.estimate_script(path, flags, gpus=2, rank=r, device="cpu", steps=2).peak_bytes
                     for r in (0, 1)]
        rows.append({"script": name, "truth_bytes_per_launch": launches, "estimate_bytes": estimates,
                     "error_pct_lowest": [round(100 * (e - min(l[r] for l in launches)) / min(l[r] for l in launches), 4)
                                          for r, e in enumerate(estimates)]})
        print(rows[-1], flush=True)
    return rows


def _timed(command: list[str], folder: str) -> tuple[dict, float]:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", "--json", *command], cwd=folder,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
    seconds = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout), seconds


def speed() -> list[dict]:
    from transformers import AutoConfig

    from memfit.models.catalog import lookup

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        _data(folder)
        data, seconds = _timed(["--gpu", "h100-sxm", "--steps", "2", os.path.join(SCRIPTS, "gpt_train.py"), *GPT_124M],
                               folder)
        rows.append({"case": "nanoGPT 124M, 12 x 1024, 40 micro-steps, --steps 2", "seconds": round(seconds, 1),
                     "limit_seconds": 120, "peak_bytes": data["peak_bytes"], "reserved_bytes": data["reserved_bytes"]})
        print(rows[-1], flush=True)
        entry = lookup("llama-3.2-1b")
        AutoConfig.for_model(entry.model_type, **entry.config).save_pretrained(os.path.join(folder, "llama-3.2-1b"))
        data, seconds = _timed(["--gpu", "h100-sxm", os.path.join(SCRIPTS, "hf_loop.py"), "llama-3.2-1b"], folder)
        rows.append({"case": "Llama-3.2-1B loop, 1 x 2048, bf16 autocast, fused AdamW", "seconds": round(seconds, 1),
                     "limit_seconds": 30, "peak_bytes": data["peak_bytes"], "reserved_bytes": data["reserved_bytes"]})
        print(rows[-1], flush=True)
    return rows


def agreement(script_row: dict) -> dict:
    import memfit

    recipe = memfit.Recipe(precision="bf16-mixed", optimizer_impl="fused")
    named = memfit.estimate("llama-3.2-1b", gpu="h100-sxm", seq_len=2048, recipe=recipe)
    row = {"script_peak_bytes": script_row["peak_bytes"], "named_peak_bytes": named.peak_bytes,
           "script_reserved_bytes": script_row["reserved_bytes"], "named_reserved_bytes": named.reserved_bytes,
           "note": "the named estimate's labels are a tensor of their own (the script passes ids as labels)"}
    print(row, flush=True)
    return row


def main(parts: list[str]) -> None:
    parts = parts or ["truth", "ranks", "speed"]
    out = {}
    if "truth" in parts:
        out["truth"] = truth()
    if "ranks" in parts:
        out["ranks"] = ranks()
    if "speed" in parts:
        out["speed"] = speed()
        out["agreement"] = agreement(out["speed"][1])
    agreed = out.pop("agreement", None)
    path = _results.write(RESULTS, _results.tables(**out), {"agreement": agreed} if agreed else {})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
