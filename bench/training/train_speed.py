"""How close `memfit train`'s own choice comes to the fastest hand-written loop that fits the same budget.

For a model and a few budgets: memfit plans (``plan``, nothing fixed) and times its few most promising
recipes (``training/calibrate.py``), what ``memfit train --budget B`` does by default, then trains; a grid of plain PyTorch loops (micro-batch x accumulation,
activation checkpointing through transformers' ``gradient_checkpointing_enable``, bf16 autocast or fp32,
fused or foreach AdamW) each runs the same global batch of full-length rows under the same budget; the
best loop that did not run out of memory is the bar. Every run is its own fresh model. On the CPU the
budget is virtual (``VirtualBudget``: the live tensor bytes, an out-of-memory error past it, the model's
own bytes counted); on CUDA it is the process's memory, its CUDA context included as memfit's plan counts
it (the allocator gets the budget less the card's context: ``set_per_process_memory_fraction``), and the
figures are ``max_memory_allocated``.

    python -m bench train_speed                       # CPU, a small Llama, 3 virtual budgets -> results/train-speed-cpu.json
    python -m bench train_speed --device cuda --model qwen3-0.6b --budgets 16GiB,24GiB,40GiB --seq-len 1024 --batch 32

Speed is tokens per second of the steps after the first (warm-up, and memfit's planning and
micro-batch estimates are outside it: they are reported apart as ``plan_seconds``).
``tests/test_train_speed.py`` runs the CPU comparison on a tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
RESULTS = ("train-speed-cpu.json", "train-speed-gpu.json")
os.environ.setdefault("MEMFIT_DEVICE", "cpu")

import torch  # noqa: E402

from memfit.units import format_size, parse_size  # noqa: E402
from bench import _results  # noqa: E402


def tiny_config(layers: int = 4, hidden: int = 128, vocab: int = 512):
    import transformers as tf

    return tf.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                          max_position_embeddings=1024, architectures=["LlamaForCausalLM"])


def _config(name: str):
    if name == "tiny":
        return tiny_config()
    from memfit.models.source import resolve

    return resolve(name).config


def _build(config, device):
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config)
    return model


class FullRows(torch.utils.data.Dataset):
    """``n`` rows of exactly ``seq`` random tokens: every micro-batch the same shape, as the loops' are."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = [torch.randint(1, vocab, (seq,), generator=g) for _ in range(n)]
        import numpy as np

        self.lengths = np.full(n, seq)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


@contextlib.contextmanager
def _budget(device, cap: int, model):
    """The cap around a run: virtual on the CPU (the model's bytes resident), a memory fraction on CUDA."""
    if device == "cpu":
        from memfit.accounting.budget import VirtualBudget

        resident = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        with VirtualBudget(cap, resident=resident) as vb:
            yield lambda: vb.peak + resident
        return
    from memfit.hardware.gpus import target

    # the process's budget, its CUDA context included, as memfit's run keeps to it: the allocator gets the rest
    limit = target("cuda", None).gpu.allowed_bytes(cap)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / torch.cuda.get_device_properties(0).total_memory))
    torch.cuda.reset_peak_memory_stats()
    try:
        yield torch.cuda.max_memory_allocated
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def hand_loop(config, device, cap: int, *, batch: int, seq: int, micro: int, checkpointing: bool, bf16: bool,
              fused: bool, steps: int) -> dict:
    """A plain loop as a user writes it: AdamW, autocast, HF's own checkpointing, accumulation."""
    model = _build(config, device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    rows = FullRows(batch, seq, config.vocab_size).ids
    times = []
    try:
        with _budget(device, cap, model) as peak:
            for _ in range(steps):
                start = time.perf_counter()
                for i in range(0, batch, micro):
                    ids = torch.stack(rows[i:i + micro]).to(device)
                    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
                        loss = model(input_ids=ids, labels=ids).loss / (batch // micro)
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            used = peak()
    except torch.OutOfMemoryError:
        return {"fits": False}
    finally:
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"fits": True, "tokens_per_second": batch * seq / statistics.median(times[1:]), "peak_bytes": used}


def memfit_run(config, device, cap: int, *, batch: int, seq: int, steps: int, gpu: str | None, cache=None,
               keep=None) -> dict:
    """What ``memfit train --budget`` does by default: plan the fastest recipe that fits, then train it.
    ``cache``: an ``EngineCache`` the budgets of one model share (the planner's traces, not its answer);
    ``keep(plan)``: given the chosen ``Plan`` (``retime`` trains it again)."""
    from memfit.planner.plan import plan
    from memfit.training.loop import use_alloc_conf

    start = time.perf_counter()
    plans = plan(config, budget=cap, gpu=gpu, global_batch_size=batch, seq_len=seq,
                 device="cpu" if device == "cpu" else "cuda", cache=cache)
    planned = time.perf_counter() - start
    # on CUDA, as memfit train does: the allocator setting the plan fits with (the loops keep it)
    conf = use_alloc_conf(plans[:4]) if device == "cuda" else None
    from memfit.models.source import resolve
    from memfit.training.calibrate import calibrate

    source = resolve(config)
    timing = calibrate(plans, lambda: _build(config, device), source.make_batch(batch, seq), device=device, budget=cap,
                       gpu=gpu)
    chosen = next(p for p in plans if p.recipe == timing.recipe)
    if keep is not None:
        keep(chosen)
    ran = memfit_train(config, device, cap, chosen, batch=batch, seq=seq, steps=steps, gpu=gpu)
    return {"recipe": chosen.recipe.describe(), "predicted_tokens_per_second": chosen.tokens_per_second,
            "plan_first": plans.best.recipe.describe(), "timed": timing.to_dict(),
            "predicted_step_seconds": chosen.step_seconds, "measured_step_seconds": ran["measured_step_seconds"],
            "tokens_per_second": ran["tokens_per_second"], "peak_bytes": ran["peak_bytes"], "ooms": ran["ooms"],
            "alloc_conf": conf or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "plan_seconds": round(planned, 1),
            "calibrate_seconds": round(timing.seconds, 1), "estimate_seconds": ran["estimate_seconds"]}


def memfit_train(config, device, cap: int, chosen, *, batch: int, seq: int, steps: int, gpu: str | None) -> dict:
    """``memfit train``'s run of the chosen plan on a fresh model: the median step after the first."""
    from memfit.training.loop import train

    model = _build(config, device)
    with tempfile.TemporaryDirectory() as out:
        result = train(model, FullRows(batch * steps, seq, config.vocab_size), recipe=chosen.recipe, plan=chosen,
                       budget=cap, global_batch_size=batch, seq_len=seq, steps=steps, out_dir=out, progress=False,
                       gpu=gpu if device != "cpu" else None, tensorboard=False)
        lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    seconds = statistics.median(line["seconds"] for line in lines[1:])
    return {"measured_step_seconds": seconds, "tokens_per_second": batch * seq / seconds,
            "peak_bytes": result.peak_bytes, "ooms": len(result.ooms),
            "estimate_seconds": round(sum(x["estimate_seconds"] for x in lines), 1)}


SETTING = ("micro", "checkpointing", "bf16", "fused")  # what a hand-written loop of the grid chooses


def grid(batch: int, cuda: bool, smallest: int = 1) -> list[dict]:
    micros = [m for m in (1, 2, 4, 8, 16, 32, 64) if smallest <= m <= batch and batch % m == 0]
    return [dict(micro=m, checkpointing=c, bf16=b, fused=f)
            for m in micros for c in (False, True) for b in (False, True) for f in ((False, True) if cuda else (True,))]


def loops_on_cuda(run, batch: int, smallest: int = 1) -> list[dict]:
    """The grid a GPU can afford in minutes: bf16 autocast and fused AdamW (on a tensor-core GPU fp32 and foreach
    are slower at every micro-batch, so they cannot be the best loop), with and without checkpointing; micro-
    batches from the largest down, stopping one below the first that fits (a smaller one is slower still: it
    only lowers the GPU's occupancy). ``run(setting) -> result``."""
    micros = sorted({x["micro"] for x in grid(batch, True, smallest)}, reverse=True)
    loops = []
    for checkpointing in (False, True):
        fitted = 0
        for m in micros:
            setting = dict(micro=m, checkpointing=checkpointing, bf16=True, fused=True)
            got = run(setting)
            loops.append({**setting, **got})
            fitted += got["fits"]
            if fitted == 2:
                break
    return loops


def compare(config, device: str, budgets: list[int], *, batch: int, seq: int, steps: int = 3,
            gpu: str | None = None, log=print, smallest: int = 1, on_row=None, cache=None) -> list[dict]:
    """memfit against the loops, budget by budget; ``smallest``: the smallest micro-batch of the grid;
    ``on_row(rows)`` after each budget (a long GPU run keeps what it has); ``cache``: the planner's
    ``EngineCache`` (default a new one; ``retime`` plans again with the same)."""
    from memfit.planner.cache import EngineCache

    rows, cache = [], EngineCache() if cache is None else cache
    # On the CPU the cap is virtual and its check deterministic (an allocation past it raises; nothing else
    # changes): a loop that ran to the end under the largest budget with a peak of P bytes fits every budget >= P
    # and runs out of memory under a smaller one, as a run under that budget would. So the grid runs once and is
    # judged per budget (the same rows, a third of the loops).
    once = None
    if device == "cpu":
        top = max(budgets)
        once = [{**setting, **hand_loop(config, device, top, batch=batch, seq=seq, steps=steps, **setting)}
                for setting in grid(batch, False, smallest)]
    for cap in budgets:
        ours = memfit_run(config, device, cap, batch=batch, seq=seq, steps=steps, gpu=gpu, cache=cache)

        def run(setting):
            return hand_loop(config, device, cap, batch=batch, seq=seq, steps=steps, **setting)

        if once is not None:
            loops = [x if x["fits"] and x["peak_bytes"] <= cap else {k: x[k] for k in SETTING} | {"fits": False}
                     for x in once]
        else:
            loops = loops_on_cuda(run, batch, smallest)
        fitting = [x for x in loops if x["fits"]]
        best = max(fitting, key=lambda x: x["tokens_per_second"], default=None)
        row = {"budget": cap, "budget_text": format_size(cap), "memfit": ours, "best_loop": best,
               "loops_that_fit": len(fitting), "loops": loops,
               "ratio": None if best is None else round(ours["tokens_per_second"] / best["tokens_per_second"], 3),
               "memfit_within_budget": ours["peak_bytes"] <= cap and ours["ooms"] == 0}
        rows.append(row)
        log(f"{format_size(cap):>10}: memfit {ours['tokens_per_second']:,.0f} tok/s ({ours['recipe']}), best loop "
            f"{'-' if best is None else format(best['tokens_per_second'], ',.0f')} tok/s "
            f"({'' if best is None else {k: best[k] for k in SETTING}}), "
            f"ratio {row['ratio']}, {len(fitting)}/{len(loops)} loops fit")
        if on_row is not None:
            on_row(rows)
    return rows


def retime(config, device: str, row: dict, *, batch: int, seq: int, steps: int = 3, gpu: str | None = None,
           cache=None, top: int = 2, log=print) -> dict:
    """``row`` (one of ``compare``'s) measured again, without the whole grid: memfit plans (``cache``: the
    ``EngineCache`` ``compare`` used, so no trace is made again), calibrates and trains as ``memfit_run``, the
    ``top`` fastest loops that fit run again, and memfit's chosen plan trains once more after them, so that the
    machine's load of the moment falls on both sides. Both sides are judged on these runs alone: memfit's figure is
    the faster of its two runs, the bar the fastest of the loops run again (on a shared VM the cores' speed drifts
    over minutes: here the same loop ran at half its earlier tokens/s an hour later, and a bar kept from the grid's
    minutes judged memfit's runs by the speed of other minutes). ``loops`` keeps each loop's fastest timing of all
    its runs, for the record. The runs must again keep to the budget with no out-of-memory error
    (``memfit_within_budget``)."""
    cap = row["budget"]
    fitting = sorted((x for x in row["loops"] if x["fits"]), key=lambda x: -x["tokens_per_second"])
    again = [{k: x[k] for k in SETTING} for x in fitting[:top]]
    loops = [dict(x) for x in row["loops"]]
    chosen, now = [], []
    first = memfit_run(config, device, cap, batch=batch, seq=seq, steps=steps, gpu=gpu, cache=cache, keep=chosen.append)
    for setting in again:
        got = hand_loop(config, device, cap, batch=batch, seq=seq, steps=steps, **setting)
        x = next(x for x in loops if all(x[k] == setting[k] for k in SETTING))
        x["fits"] = x["fits"] and got["fits"]
        if got["fits"]:
            now.append({**setting, **got})
            x["tokens_per_second"] = max(x["tokens_per_second"], got["tokens_per_second"])
            x["peak_bytes"] = max(x["peak_bytes"], got["peak_bytes"])
    second = memfit_train(config, device, cap, chosen[0], batch=batch, seq=seq, steps=steps, gpu=gpu)
    fits = [x for x in loops if x["fits"]]
    best = max(now, key=lambda x: x["tokens_per_second"], default=None)
    fastest = max((first, second), key=lambda x: x["tokens_per_second"])
    memfit = {**first, "tokens_per_second": fastest["tokens_per_second"],
              "measured_step_seconds": fastest["measured_step_seconds"],
              "peak_bytes": max(first["peak_bytes"], second["peak_bytes"]), "ooms": first["ooms"] + second["ooms"]}
    out = {**row, "memfit": memfit, "earlier": row.get("earlier", []) + [row["memfit"]], "loops": loops,
           "best_loop": best, "loops_that_fit": len(fits),
           "ratio": None if best is None else round(memfit["tokens_per_second"] / best["tokens_per_second"], 3),
           "memfit_within_budget": memfit["peak_bytes"] <= cap and memfit["ooms"] == 0}
    log(f"{row['budget_text']:>10} again: memfit {round(first['tokens_per_second'])}, "
        f"{round(second['tokens_per_second'])} tok/s ({memfit['recipe']}), loops {again} -> ratio {out['ratio']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="tiny", help="tiny (a 4-layer Llama of width 128) or a catalog name")
    parser.add_argument("--budgets", default="40MiB,56MiB,96MiB")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpu", default=None, help="(cuda) the catalog card; default the one torch sees")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_speed: no CUDA GPU visible: skipped")
        return
    if args.device == "cuda":
        os.environ["MEMFIT_DEVICE"] = "cuda"
    budgets = [parse_size(b) for b in args.budgets.split(",")]
    start = time.perf_counter()
    rows = compare(_config(args.model), args.device, budgets, batch=args.batch, seq=args.seq_len, steps=args.steps,
                   gpu=args.gpu)
    out = _results.write(args.out or RESULTS[args.device == "cuda"], rows, model=args.model, batch=args.batch,
                         seq_len=args.seq_len, seconds=round(time.perf_counter() - start, 1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
