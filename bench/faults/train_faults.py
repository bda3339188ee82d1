"""memfit.train under faults: injected out-of-memory errors and SIGKILL at random moments.

    python -m bench train_faults inject 200   # OOM at a random (step, micro-batch, phase, nth allocation),
                                              # until 200 runs had their fault fire
    python -m bench train_faults kill 50      # SIGKILL at a random moment (every 4th run as a checkpoint
                                              # is being written), then resume to the end, until 50 runs
                                              # were killed before they finished

inject: each run must finish, draw exactly the fault-free run's examples in every step (no sample
lost or repeated: the metrics' example ids), and end within summation-order tolerance of the
fault-free weights. kill: each resumed run must end bit for bit on the uninterrupted run's weights.
Results go to bench/results/train-faults.json (merged by mode).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this tree's memfit; bench/ a package when run as a file

from memfit import Recipe  # noqa: E402
from memfit.training.loop import train  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "train-faults.json"
STEPS = 5


class Tokens(torch.utils.data.Dataset):
    """Long-tailed lengths, token ids fixed by index."""

    def __init__(self, n=64, seed=0):
        rng = random.Random(seed)
        self.ids = [torch.randint(1, 128, (min(64, int(rng.paretovariate(1.3) * 8)),),
                                  generator=torch.Generator().manual_seed(i)) for i in range(n)]
        self.lengths = np.array([len(x) for x in self.ids])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=128, max_position_embeddings=128)
    return tf.LlamaForCausalLM(cfg)


def run(out_dir, **kw):
    m = model()
    args = dict(global_batch_size=8, steps=STEPS, lr=1e-3, out_dir=out_dir, progress=False, seed=1,
                recipe=Recipe(micro_batch_size=4, grad_accum_steps=2), seq_len=64, checkpoint_every=1)
    args.update(kw)
    result = train(m, Tokens(), **args)
    lines = [json.loads(x) for x in open(Path(out_dir) / "metrics.jsonl")]
    return m, result, lines


def inject(n: int) -> dict:
    rng = random.Random(1234)
    tmp = Path(tempfile.mkdtemp())
    ref, _, ref_lines = run(tmp / "ref")
    ref_ids = [x["examples"] for x in ref_lines]
    rows, worst, k = [], 0.0, 0
    # n runs in which the fault fired: an nth past the place's allocations fires nothing, so draw again
    while sum(r["ooms"] > 0 for r in rows) < n and k < 3 * n:
        k += 1
        phase = rng.choice(["forward", "backward", "optimizer"])
        fault = (rng.randrange(STEPS), rng.randrange(2) if phase != "optimizer" else 0, phase, rng.randint(1, 40))
        crash, lost, diff, ooms = None, None, None, 0
        try:
            m, result, lines = run(tmp / f"r{k}", inject=[fault])
            ooms = len(result.ooms)
            lost = [x["examples"] for x in lines] != ref_ids
            diff = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), m.parameters()))
            worst = max(worst, diff)
        except Exception as err:  # a crash is what this counts
            crash = f"{type(err).__name__}: {err}"
        rows.append({"fault": list(fault), "ooms": ooms, "crash": crash, "samples_differ": lost, "max_abs_diff": diff})
        shutil.rmtree(tmp / f"r{k}", ignore_errors=True)
        print(f"{k} fault={fault} ooms={ooms} crash={crash} lost={lost} diff={diff}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"runs": len(rows), "crashes": sum(r["crash"] is not None for r in rows),
            "runs_with_samples_lost_or_repeated": sum(bool(r["samples_differ"]) for r in rows),
            "faults_fired": sum(r["ooms"] > 0 for r in rows), "max_abs_weight_diff": worst, "rows": rows}


WORKER = """
import sys, torch
sys.path[:0] = [{src!r}, {root!r}]
from bench.faults import train_faults as T
m, result, _ = T.run(sys.argv[1])
torch.save({{k: v for k, v in m.state_dict().items()}}, sys.argv[1] + "/final.pt")
"""


def _started(out: Path, proc) -> None:
    while not (out / "metrics.jsonl").exists() and proc.poll() is None:
        time.sleep(0.01)


def kill(n: int) -> dict:
    rng = random.Random(99)
    tmp = Path(tempfile.mkdtemp())
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = WORKER.format(src=str(ROOT / "src"), root=str(ROOT))
    whole = tmp / "whole"
    proc = subprocess.Popen([sys.executable, "-c", code, str(whole)], env=env)
    _started(whole, proc)
    start = time.perf_counter()
    assert proc.wait() == 0
    duration = time.perf_counter() - start  # from the first step's start to the end
    reference = torch.load(whole / "final.pt")
    rows, k = [], 0
    # n runs actually killed: a delay past the run's end kills nothing (counted apart, drawn again)
    while sum(r["killed"] for r in rows) < n and k < 3 * n:
        k += 1
        out = tmp / f"k{k}"
        proc = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env)
        _started(out, proc)  # imports done: the kill lands somewhere in training or saving
        delay = rng.uniform(0.0, duration)
        if k % 4 == 0:  # every 4th run aims at a checkpoint write: killed as a .partial-* directory appears
            began = time.perf_counter()
            while proc.poll() is None and not list(out.glob(".partial-*")) and time.perf_counter() - began < duration:
                time.sleep(0.0002)
            delay = time.perf_counter() - began
        else:
            time.sleep(delay)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        checkpoints = sorted(p.name for p in out.glob("step-*")) if out.exists() else []
        partial = bool(list(out.glob(".partial-*"))) if out.exists() else False  # killed while saving
        done = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True)
        ok, equal = done.returncode == 0, False
        if ok:
            final = torch.load(out / "final.pt")
            equal = all(torch.equal(final[key], reference[key]) for key in reference)
        rows.append({"delay_s": round(delay, 3), "killed": killed, "checkpoints_at_kill": checkpoints,
                     "partial_checkpoint_at_kill": partial,
                     "resumed_ok": ok, "bitwise_equal": equal, "stderr": None if ok else done.stderr[-500:]})
        print(f"{k} ({sum(r['killed'] for r in rows)}/{n} killed) after {delay:.2f}s (had {checkpoints}) resumed={ok} equal={equal}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    killed = [r for r in rows if r["killed"]]
    return {"runs": len(rows), "killed": len(killed), "killed_resumed": sum(r["resumed_ok"] for r in killed),
            "killed_bitwise_equal": sum(r["bitwise_equal"] for r in killed),
            "resumed": sum(r["resumed_ok"] for r in rows), "bitwise_equal": sum(r["bitwise_equal"] for r in rows),
            "killed_while_saving": sum(r["partial_checkpoint_at_kill"] for r in killed), "rows": rows}


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    result = {"inject": inject, "kill": kill}[mode](n)
    _results.merge(RESULTS, {mode: result})
    summary = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
