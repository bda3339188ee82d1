"""Data-parallel training under torchrun on this CPU (gloo), graded against fault-free runs.

    python -m bench train_ranks faults [--runs 100]   OOMs injected on a random rank, step, micro-batch, phase
    python -m bench train_ranks kills [--runs 30]     kill -9 of a random rank at a random moment
    python -m bench train_ranks speed                 the trainer vs a hand-written FSDP2 loop, same recipe
    python -m bench train_ranks exits [--runs 200]    `memfit train --nproc-per-node 2`: every run exits 0, no abort
    python -m bench train_ranks all

Faults: each run is a 2-rank FSDP2 (or, every fourth, DDP) training of a tiny Llama (4 steps of 8
examples, 2 rows per micro-batch) with one out-of-memory error injected (``VirtualBudget``'s fault
injection: the nth allocation at a place fails) on a random rank, at a random step, micro-batch,
phase and allocation; graded: the run ends by itself within its time limit (a hang would not), exit
code 0, the example ids of every step equal to the fault-free run's, the final weights (the exported
``model.safetensors``) within 1e-5 of the fault-free run's.

Kills: each run is a 2-rank FSDP2 training (40 steps, a checkpoint every 4; every other run with a
50 ms sleep before each fsync, so that more kills land inside a checkpoint write) under ``torchrun
--max-restarts 3``; at a random moment after training began one rank's process gets SIGKILL; torchrun restarts both and
they resume from the newest complete checkpoint. Graded: exit code 0, the examples of every step
(the last time each step ran) equal to the fault-free run's, the final weights within 1e-5, and
whether a checkpoint was being written (a ``.partial-*`` directory existed) at the kill.

Speed: a Llama of width 256, 4 blocks, rows of 256 tokens, 8 rows a step in micro-batches of 2, on
2 ranks, FSDP2 over the blocks and the root, AdamW; the hand-written loop is torchtitan's shape
(``fully_shard`` per block then the root, ``set_requires_gradient_sync`` on the last micro-batch,
``opt.step``); the trainer's is ``memfit.train`` with ``parallel=fsdp``. Median step time over
steps 3..N of each, each rank's slowest.

Exits: `memfit train` of the repository's tiny Llama, 2 steps on 2 processes (FSDP2 over gloo), the
command a user types, run ``--runs`` times; counted: exit codes other than 0 and "terminate called" (the
C++ abort at interpreter exit of issue 34 item 6) anywhere in the output.

Results go to ``bench/results/train-ranks-cpu.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ a package when run as a file (memfit: the workers' own import)
from bench import _results  # noqa: E402

WORKER = ROOT / "tests" / "_ranks_worker.py"
RESULTS = "train-ranks-cpu.json"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def torchrun(nproc: int, case: dict, timeout: float, restarts: int = 0, popen: bool = False):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={restarts}", str(WORKER), json.dumps(case)]
    if popen:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                                start_new_session=True)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def weights(out_dir: str) -> dict:
    from safetensors.torch import load_file

    found = sorted(glob.glob(f"{out_dir}/step-*/model.safetensors"))
    return load_file(found[-1]) if found else {}


def steps_examples(out_dir: str) -> dict:
    seen = {}
    for line in open(f"{out_dir}/metrics.jsonl"):
        row = json.loads(line)
        seen[row["step"]] = row["examples"]  # a step redone after a restart: its last run
    return seen


def worst(a: dict, b: dict) -> float:
    if set(a) != set(b) or not a:
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def faults(runs: int) -> dict:
    base = {"steps": 4, "global_batch_size": 8}
    refs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("fsdp", "ddp"):
            case = dict(base, out_dir=f"{tmp}/ref-{kind}", recipe={"parallel": kind, "micro_batch_size": 2})
            done = torchrun(2, case, 300)
            assert done.returncode == 0, done.stderr[-2000:]
            refs[kind] = (weights(case["out_dir"]), steps_examples(case["out_dir"]))
        rows = []
        for i in range(runs):
            rng = random.Random(i)
            kind = "ddp" if i % 4 == 3 else "fsdp"
            rank, step, phase = rng.randrange(2), rng.randrange(4), rng.choice(("forward", "backward", "optimizer"))
            micro = 0 if phase == "optimizer" else rng.randrange(2)
            nth = rng.randint(1, 8 if phase == "optimizer" else 30)
            case = dict(base, out_dir=f"{tmp}/run-{i}", recipe={"parallel": kind, "micro_batch_size": 2},
                        inject={str(rank): [[step, micro, phase, nth]]})
            began = time.monotonic()
            stderr = ""
            try:
                done = torchrun(2, case, 120)
                code, hang, stderr = done.returncode, False, done.stderr
            except subprocess.TimeoutExpired:
                code, hang = None, True
            seconds = time.monotonic() - began
            row = {"run": i, "parallel": kind, "rank": rank, "step": step, "micro_batch": micro, "phase": phase,
                   "nth": nth, "exit_code": code, "hang": hang, "seconds": round(seconds, 1)}
            if code == 0:
                ref_weights, ref_examples = refs[kind]
                results = [json.load(open(f"{case['out_dir']}/result-{r}.json")) for r in range(2)]
                own = [e for e in results[rank]["ooms"] if e.get("phase") == phase]
                row.update(fired=bool(own), events=sum(len(r["ooms"]) for r in results),
                           examples_equal=steps_examples(case["out_dir"]) == ref_examples,
                           max_weight_difference=worst(weights(case["out_dir"]), ref_weights))
            else:  # how far it got: each rank's result file is written after train() returned
                row["results_written"] = [Path(case["out_dir"], f"result-{r}.json").is_file() for r in range(2)]
                row["final_checkpoint"] = Path(case["out_dir"], "step-000000004", "model.safetensors").is_file()
                noise = ("Warning", "warn(", "Enum", "torchao", "return func")
                row["stderr"] = "\n".join(line for line in stderr.splitlines() if not any(n in line for n in noise))[-3000:]
            rows.append(row)
            shutil.rmtree(case["out_dir"], ignore_errors=True)
            print(json.dumps(row), flush=True)
    ok = [r for r in rows if r["exit_code"] == 0 and r["examples_equal"] and r["max_weight_difference"] <= 1e-5]
    return {"runs": runs, "fired": sum(bool(r.get("fired")) for r in rows), "hangs": sum(r["hang"] for r in rows),
            "crashes": sum(r["exit_code"] not in (0, None) for r in rows),
            "examples_lost_or_repeated": sum(r.get("examples_equal") is False for r in rows),
            "weights_off": sum(r.get("max_weight_difference", 0) > 1e-5 for r in rows),
            "ok": len(ok), "worst_weight_difference": max(r.get("max_weight_difference", 0) for r in rows),
            "rows": rows}


def kills(runs: int) -> dict:
    base = {"steps": 40, "global_batch_size": 8, "checkpoint_every": 4, "recipe": {"parallel": "fsdp",
                                                                                   "micro_batch_size": 2}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref = dict(base, out_dir=f"{tmp}/ref")
        done = torchrun(2, ref, 300)
        assert done.returncode == 0, done.stderr[-2000:]
        ref_weights, ref_examples = weights(ref["out_dir"]), steps_examples(ref["out_dir"])
        for i in range(runs):
            rng = random.Random(1000 + i)
            # every other run writes its checkpoints slowly (a sleep before each fsync): kills land in writes
            slow = 0.05 if i % 2 else 0
            case = dict(base, out_dir=f"{tmp}/run-{i}", slow_checkpoint=slow)
            process = torchrun(2, case, 0, restarts=3, popen=True)
            began = time.monotonic()
            while not Path(case["out_dir"], "metrics.jsonl").exists() and time.monotonic() - began < 120:
                time.sleep(0.02)  # training has begun
            window = 2.5 + (40 / 4) * 8 * slow  # the steps, and the checkpoints' sleeps
            at = rng.uniform(0, window)
            time.sleep(at)
            victims = subprocess.run(["pgrep", "-f", f"run-{i}\""], capture_output=True, text=True).stdout.split()
            victims = [int(v) for v in victims if int(v) != process.pid]
            writing = bool(glob.glob(f"{case['out_dir']}/.partial-*"))
            killed = None
            if victims:
                killed = rng.choice(victims)
                try:
                    os.kill(killed, signal.SIGKILL)
                except ProcessLookupError:
                    killed = None
            try:
                _, err = process.communicate(timeout=300)
                code, hang = process.returncode, False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code, hang, err = None, True, ""
            row = {"run": i, "slow_checkpoint": bool(slow), "kill_after_s": round(at, 2), "killed": killed is not None,
                   "during_checkpoint_write": writing, "exit_code": code, "hang": hang}
            if code == 0:
                results = [json.load(open(f"{case['out_dir']}/result-{r}.json")) for r in range(2)]
                row.update(resumed_from=results[0]["resumed_from"],
                           examples_equal=steps_examples(case["out_dir"]) == ref_examples,
                           max_weight_difference=worst(weights(case["out_dir"]), ref_weights))
            else:
                row["stderr"] = (err or "")[-600:]
            rows.append(row)
            shutil.rmtree(case["out_dir"], ignore_errors=True)
            print(json.dumps(row), flush=True)
    good = [r for r in rows if r["exit_code"] == 0 and r.get("examples_equal") and
            r.get("max_weight_difference", 1) <= 1e-5]
    return {"runs": runs, "killed": sum(r["killed"] for r in rows),
            "resumed_after_kill": sum(r["killed"] and r.get("resumed_from", 0) > 0 for r in good),
            "during_checkpoint_write": sum(r["during_checkpoint_write"] for r in rows), "ok": len(good),
            "hangs": sum(r["hang"] for r in rows), "rows": rows}


def _speed_worker(mode: str, out: str) -> None:
    """One rank of the speed comparison (run under torchrun)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import transformers as tf

    torch.set_num_threads(1)
    steps, rows, micro, length = 12, 8, 2, 256

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = [torch.randint(1, 512, (length,), generator=torch.Generator().manual_seed(i)) for i in range(512)]
            self.lengths = np.full(len(self.ids), length)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i]}

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512, max_position_embeddings=length)
    model = tf.LlamaForCausalLM(cfg)
    data = Rows()
    if mode == "memfit":
        from memfit import Recipe
        from memfit.training.loop import train

        result = train(model, data, recipe=Recipe(parallel="fsdp", micro_batch_size=micro), seq_len=length,
                       global_batch_size=rows, steps=steps, lr=1e-4, out_dir=out, progress=False, checkpoint_every=10**6,
                       export=False, chunks=None if os.environ.get("PLAIN_STEP") else 8)
        if result.rank == 0:
            times = [json.loads(x)["seconds"] for x in open(f"{out}/metrics.jsonl")]
            Path(out, "times.json").write_text(json.dumps(times))
        return
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    times = []
    for step in range(steps):
        began = time.perf_counter()
        ids = order[step * rows:(step + 1) * rows][rank::world]
        parts = [ids[j:j + micro] for j in range(0, len(ids), micro)]
        for k, part in enumerate(parts):
            batch = torch.stack([data[i]["input_ids"] for i in part])
            model.set_requires_gradient_sync(k == len(parts) - 1)
            loss = model(input_ids=batch, labels=batch).loss / len(parts)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def speed() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in (("hand", {}), ("memfit", {}), ("memfit", {"PLAIN_STEP": "1"}),
                            ("hand", {}), ("memfit", {})):
            folder = tempfile.mkdtemp(dir=tmp)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       __file__, "speed-worker", mode, folder]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(ENV, **extra))
            assert done.returncode == 0, done.stderr[-3000:]
            times = json.loads(Path(folder, "times.json").read_text())[2:]
            name = mode + (" (plain optimizer step)" if extra else "")
            out.setdefault(name, []).append(round(statistics.median(times), 4))
            print(name, out[name][-1], flush=True)
    best = {k: min(v) for k, v in out.items()}
    return {"median_step_seconds": out, "best_of_runs": best,
            "memfit_over_hand": round(best["memfit"] / best["hand"] - 1, 4),
            "memfit_plain_step_over_hand": round(best["memfit (plain optimizer step)"] / best["hand"] - 1, 4)}


def exits(runs: int) -> dict:
    root = ROOT
    work = Path(tempfile.mkdtemp(prefix="memfit-exits-"))
    data = work / "tokens.bin"
    subprocess.run([sys.executable, str(root / "examples" / "make_tokens.py"), str(data)], check=True,
                   capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    codes, aborts, seconds = {}, 0, []
    for i in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "memfit.cli", "train", str(root / "examples" / "tiny-llama" /
                               "config.json"), "--data", str(data), "--seq-len", "64", "--global-batch-size", "4",
                               "--steps", "2", "--out-dir", str(work / f"run-{i}"), "--nproc-per-node", "2",
                               "--parallel", "fsdp", "--no-tensorboard"], capture_output=True, text=True,
                              timeout=300, env=env)
        seconds.append(time.perf_counter() - start)
        codes[done.returncode] = codes.get(done.returncode, 0) + 1
        aborted = "terminate called" in done.stdout + done.stderr
        aborts += aborted
        if done.returncode or aborted:
            print(f"run {i}: exit {done.returncode}{', abort' if aborted else ''}: {done.stderr[-400:]}", flush=True)
        shutil.rmtree(work / f"run-{i}", ignore_errors=True)
        if (i + 1) % 20 == 0:
            print(f"{i + 1} runs: exit codes {codes}, aborts {aborts}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return {"runs": runs, "exit_codes": {str(k): v for k, v in codes.items()}, "aborts": aborts,
            "median_seconds": round(sorted(seconds)[len(seconds) // 2], 1)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "speed-worker":
        _speed_worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("faults", "kills", "speed", "exits", "all"))
    parser.add_argument("--runs", type=int, default=None)
    args = parser.parse_args()
    results = {}
    if args.what in ("faults", "all"):
        results["faults"] = faults(args.runs or 100)
    if args.what in ("kills", "all"):
        results["kills"] = kills(args.runs or 30)
    if args.what in ("speed", "all"):
        results["speed"] = speed()
    if args.what in ("exits", "all"):
        results["exits"] = exits(args.runs or 200)
    summary = _results.read(_results.merge(RESULTS, results, device=f"{_results.device_name()}, gloo"))["summary"]
    print(json.dumps({part: summary[part] for part in results}, indent=1))


if __name__ == "__main__":
    main()
