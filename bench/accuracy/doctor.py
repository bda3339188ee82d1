"""Does ``memfit doctor`` name the cause of an out-of-memory error, and does its first fix make the run fit?

    python -m bench doctor               # every scenario; writes bench/results/doctor-cpu.json
    python -m bench doctor --no-plan     # without memfit plan's fix (the searches take most of the time)
    python -m bench doctor --only c1,v2  # some scenarios (the JSON is written only for a full run)

Three kinds of constructed scenario, each with the cause it was built to have:

* ``c*``: a CUDA out-of-memory message written in torch's own format (>= 2.1, and one < 2.1) whose figures
  come from memfit's estimate of a catalog model on a catalog GPU (the allocator replayed under the card:
  what the process held when it ran out, what it missed); diagnosed from the message and, where the
  scenario says so, the model and its flags. The first fix is applied by a fresh full estimate of the
  fixed step under the same budget (a recipe fix; the whole card for freeing other processes; the
  verdict with expandable segments for fragmentation), or from the message's own figures when no model
  is given.
* ``v*``: real CPU training steps of a small Llama under a virtual budget below their peak
  (``accounting/budget.py``): the out-of-memory error is real, its message is what is diagnosed, and the
  first fix is run for real under the same budget.
* ``p*``: a script run under ``memfit.profile()`` with a virtual budget (``memfit doctor --budget B --
  python script.py``): a leak, an evaluation without ``torch.no_grad()``, one long batch. The first fix
  is the script changed as it says, run again under the same budget.

Pass: the cause is the one built in, and the first fix applied fits. Threads are pinned to one (two
cores are shared; CPU step times are not what is measured here).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # this tree's memfit; bench/ a package when run as a file
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

import memfit  # noqa: E402
from memfit import Recipe  # noqa: E402
from memfit.hardware.gpus import gpu  # noqa: E402
from memfit.profiling.doctor import diagnose, run_step  # noqa: E402
from memfit.profiling.oom_text import c10_size  # noqa: E402
from memfit.report.report import OOM  # noqa: E402
from bench import _results  # noqa: E402

RESULTS = "doctor-cpu.json"
TINY = os.path.join(ROOT, "examples", "tiny-llama", "config.json")
MiB, GiB = 2**20, 2**30
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 4,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-5}
# a 2-block Llama of width 64 (activations dominate) and one of width 256 with an 8192 vocabulary at
# 16 tokens (the optimizer step, over the large embedding and head, is the highest phase)
MINI = dict(LLAMA, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_key_value_heads=2,
            vocab_size=128, tie_word_embeddings=True)
WIDE = dict(LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_key_value_heads=4,
            vocab_size=8192, tie_word_embeddings=False)


@dataclass
class Scenario:
    id: str
    expected: str
    what: str
    kind: str  # "cuda", "virtual" or "profile"
    model: str | None = None
    card: str | None = None
    kw: dict = field(default_factory=dict)  # batch_size, seq_len, recipe
    allow: str = ""
    budget: int | None = None
    message: str | None = None
    script: str | None = None
    fixed_script: str | None = None
    with_model: bool = True


# -- torch's messages ----------------------------------------------------------------------------------

def cuda_message(card, *, requested: int, this_process: int, fragmented: int, others=(), allowed=None) -> str:
    """torch >= 2.1's CUDA out-of-memory message (c10/cuda/CUDACachingAllocator.cpp) for these figures."""
    free = card.memory_bytes - this_process - sum(b for _, b in others)
    reserved = this_process - card.cuda_context_bytes
    procs = "".join(f"Process {pid} has {c10_size(b)} memory in use. " for pid, b in others)
    cap = "" if allowed is None else f"{c10_size(allowed)} allowed; "
    return ("Traceback (most recent call last):\n  File \"train.py\", line 88, in <module>\n    loss.backward()\n"
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {c10_size(requested)}. GPU 0 has a total "
            f"capacity of {c10_size(card.memory_bytes)} of which {c10_size(free)} is free. {procs}Including "
            f"non-PyTorch memory, this process has {c10_size(this_process)} memory in use. {cap}Of the allocated "
            f"memory {c10_size(reserved - fragmented)} is allocated by PyTorch, and {c10_size(fragmented)} is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n")


def legacy_message(card, *, requested: int, allocated: int, reserved: int) -> str:
    """torch < 2.1's wording of the same error."""
    free = card.memory_bytes - reserved - card.cuda_context_bytes
    return (f"RuntimeError: CUDA out of memory. Tried to allocate {c10_size(requested)} (GPU 0; "
            f"{c10_size(card.memory_bytes)} total capacity; {c10_size(allocated)} already allocated; {c10_size(free)} "
            f"free; {c10_size(reserved)} reserved in total by PyTorch) If reserved memory is >> allocated memory try "
            "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and "
            "PYTORCH_CUDA_ALLOC_CONF")


def _up(nbytes: int, to: int = 2 * MiB) -> int:
    return -(-int(nbytes) // to) * to


def ran_out(s: Scenario, room: int, *, fragmented: int = 64 * MiB, others=(), allowed=None) -> str:
    """The message of ``s``'s step running out under ``room`` bytes (context included) of its card: what the
    allocator held when it failed and the request that failed, from memfit's estimate under that budget."""
    card = gpu(s.card)
    report = memfit.estimate(s.model, gpu=card, budget=room, **s.kw)
    assert report.verdict == OOM, (s.id, report.verdict)
    held = report.reserved_bytes + card.cuda_context_bytes
    free = room - held
    requested = _up(report.missing_bytes + free + fragmented)
    return cuda_message(card, requested=requested, this_process=held, fragmented=fragmented, others=others,
                        allowed=allowed)


# -- the scenarios -------------------------------------------------------------------------------------

def scenarios(folder: str) -> list[Scenario]:
    mini, wide = _config(folder, "mini", MINI), _config(folder, "wide", WIDE)
    bf16 = Recipe(precision="bf16-mixed")
    out = [
        Scenario("c1", "model_states", "llama-3.2-1b full fine-tune, fp32 AdamW, on a T4 (8-bit states and LoRA "
                 "allowed)", "cuda", "llama-3.2-1b", "t4", dict(batch_size=1, seq_len=512), allow="adamw8bit,lora"),
        Scenario("c2", "activations", "llama-3.2-1b bf16-mixed, 8 x 4096 tokens, on an H100", "cuda", "llama-3.2-1b",
                 "h100-sxm", dict(batch_size=8, seq_len=4096, recipe=bf16)),
        Scenario("c3", "optimizer_temporaries", "qwen2.5-0.5b fp32 AdamW (foreach), 1 x 128 tokens, RTX 4090 capped "
                 "by set_per_process_memory_fraction", "cuda", "qwen2.5-0.5b", "rtx-4090",
                 dict(batch_size=1, seq_len=128)),
        Scenario("c4", "fragmentation", "llama-3.2-1b bf16-mixed, 2 x 1024 tokens, on an RTX 4090: fits only with "
                 "expandable segments", "cuda", "llama-3.2-1b", "rtx-4090", dict(batch_size=2, seq_len=1024,
                                                                                  recipe=bf16)),
        Scenario("c5", "fragmentation", "the message alone: 6.90 GiB reserved but unallocated on an H100",
                 "cuda", with_model=False),
        Scenario("c6", "other_process", "llama-3.2-1b bf16-mixed, 1 x 512 tokens, RTX 4090 shared with a 6 GiB "
                 "process", "cuda", "llama-3.2-1b", "rtx-4090", dict(batch_size=1, seq_len=512, recipe=bf16)),
        Scenario("c7", "other_process", "the message alone: two other processes hold 60 GiB of an H100", "cuda",
                 with_model=False),
        Scenario("c8", "activations", "gpt2, 16 x 1024 tokens, on a T4; torch < 2.1's message", "cuda", "gpt2", "t4",
                 dict(batch_size=16, seq_len=1024)),
        Scenario("v1", "activations", "a 2-block Llama (width 64), 8 x 128 tokens, budget 60 % of its peak",
                 "virtual", mini, kw=dict(batch_size=8, seq_len=128)),
        Scenario("v2", "activations", "examples/tiny-llama, 16 x 128 tokens, budget 70 % of its peak", "virtual",
                 TINY, kw=dict(batch_size=16, seq_len=128)),
        Scenario("v3", "optimizer_temporaries", "a 2-block Llama (width 256, vocabulary 8192), 1 x 16 tokens, budget "
                 "between the backward and the optimizer peak", "virtual", wide, kw=dict(batch_size=1, seq_len=16)),
        Scenario("v4", "model_states", "the same model under a budget below its model states (LoRA allowed)",
                 "virtual", wide, kw=dict(batch_size=1, seq_len=16), allow="lora"),
        Scenario("v5", "activations", "a 2-block Llama (width 64), 8 x 128 tokens: the CPU allocator's own message "
                 "(DefaultCPUAllocator), the budget given", "virtual", mini, kw=dict(batch_size=8, seq_len=128)),
        Scenario("p1", "leak", "a loop keeping each step's output", "profile", budget=24 * MiB,
                 script=SCRIPTS["leak"], fixed_script=SCRIPTS["leak"].replace("kept.append(out.detach() * 1)", "pass")),
        Scenario("p2", "eval_without_no_grad", "evaluation keeping its outputs, grad enabled", "profile",
                 budget=24 * MiB, script=SCRIPTS["eval"],
                 fixed_script=SCRIPTS["eval"].replace("preds = [", "with torch.no_grad():\n    preds = [")),
        Scenario("p3", "long_batch", "one batch 16x longer than the rest", "profile", budget=48 * MiB,
                 script=SCRIPTS["long"],
                 fixed_script=SCRIPTS["long"].replace("randn(8, length, 128)", "randn(8, min(length, 96), 128)")),
        Scenario("u1", "unknown", "control: a message with nothing but the request (no fragmentation, no other "
                 "process) and no model", "cuda", with_model=False),
    ]
    return out


SCRIPTS = {
    "leak": """import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
opt = torch.optim.AdamW(model.parameters())
kept = []
for step in range(60):
    x = torch.randn(256, 256)
    out = model(x)
    out.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    kept.append(out.detach() * 1)
""",
    "eval": """import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
opt = torch.optim.AdamW(model.parameters())
for step in range(4):
    model(torch.randn(64, 256)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
preds = [model(torch.randn(64, 256)) for _ in range(40)]
""",
    "long": """import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
opt = torch.optim.AdamW(model.parameters())
for length in [64, 80, 48, 72, 64, 56, 1024, 64, 70]:
    x = torch.randn(8, length, 128)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
""",
}


def _config(folder: str, name: str, config: dict) -> str:
    path = os.path.join(folder, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


# -- running one ---------------------------------------------------------------------------------------

def prepare(s: Scenario) -> dict:
    """The message (and the budget) of ``s``: what ``diagnose`` is given besides the model."""
    if s.id == "c1":
        return {"error": ran_out(s, gpu("t4").memory_bytes)}
    if s.id == "c2":
        return {"error": ran_out(s, gpu("h100-sxm").memory_bytes)}
    if s.id == "c3":  # a cap between the forward/backward peak and the optimizer step's
        card = gpu(s.card)
        free = memfit.estimate(s.model, gpu=card, **s.kw)
        graph = max(free.phase_peaks["forward"], free.phase_peaks["backward"])
        allowed = _up((graph + free.phase_peaks["optimizer"]) // 2 + 256 * MiB)
        return {"error": ran_out(s, allowed + card.cuda_context_bytes, allowed=allowed)}
    if s.id == "c4":  # fits only with expandable segments: without, the allocator is left fragmented
        card = gpu(s.card)
        held = card.memory_bytes - 180 * MiB
        return {"error": cuda_message(card, requested=1200 * MiB, this_process=held, fragmented=2600 * MiB)}
    if s.id == "c5":
        card = gpu("h100-sxm")
        return {"error": cuda_message(card, requested=2 * GiB, this_process=card.memory_bytes - 1086 * MiB,
                                      fragmented=int(6.9 * GiB))}
    if s.id == "c6":
        card = gpu(s.card)
        others = ((48213, 6 * GiB),)
        return {"error": ran_out(s, card.memory_bytes - 6 * GiB, others=others)}
    if s.id == "c7":
        card = gpu("h100-sxm")
        others = ((1187, 40 * GiB), (2290, 20 * GiB))
        return {"error": cuda_message(card, requested=4 * GiB, this_process=18 * GiB, fragmented=300 * MiB,
                                      others=others)}
    if s.id == "c8":
        card = gpu(s.card)
        report = memfit.estimate(s.model, gpu=card, **s.kw)
        reserved = card.memory_bytes - card.cuda_context_bytes - 20 * MiB
        return {"error": legacy_message(card, requested=_up(report.missing_bytes), allocated=reserved - 40 * MiB,
                                        reserved=reserved)}
    if s.id == "u1":
        card = gpu("a100-80gb")
        return {"error": cuda_message(card, requested=512 * MiB, this_process=card.memory_bytes - 200 * MiB,
                                      fragmented=100 * MiB)}
    if s.kind == "virtual":
        peak = memfit.estimate(s.model, **s.kw).peak_bytes
        budget = {"v1": int(peak * 0.6), "v2": int(peak * 0.7), "v3": 110 * MiB, "v4": 90 * MiB,
                  "v5": int(peak * 0.6)}[s.id]
        message = run_step(s.model, batch_size=s.kw["batch_size"], seq_len=s.kw["seq_len"], budget=budget)
        assert message is not None, f"{s.id}: the run fits {budget} bytes: no scenario"
        if s.id == "v5":  # what the CPU allocator says when the machine runs out: no capacity in it
            requested = 704 * 1024
            message = f"RuntimeError: DefaultCPUAllocator: not enough memory: you tried to allocate {requested} bytes."
        s.budget = budget
        return {"error": message, "budget": budget}
    raise AssertionError(s.id)


def profiled(script: str, budget: int, folder: str) -> tuple[dict, str | None]:
    """Run ``script`` inside ``memfit.profile()`` under a virtual budget, as ``memfit doctor -- python`` does."""
    from memfit.profiling.profile import profile

    path = os.path.join(folder, "script.py")
    with open(path, "w") as f:
        f.write(script)
    prof = profile(device="cpu", budget=budget)
    with contextlib.suppress(torch.OutOfMemoryError), prof:
        exec(compile(script, path, "exec"), {"__name__": "__main__"})
    return prof.to_dict(), None if prof.oom is None else prof.oom["message"]


def applied(s: Scenario, fix, given: dict, folder: str) -> bool | None:
    """Whether the first fix, applied, fits: checked afresh (not read off the diagnosis)."""
    if fix is None:
        return None
    if s.kind == "profile":
        _, message = profiled(s.fixed_script, s.budget, folder)
        return message is None
    if s.kind == "virtual":
        return run_step(s.model, Recipe.from_dict(fix.recipe), budget=s.budget, **_shape(s)) is None
    if not s.with_model:  # the message's own figures: what freeing / defragmenting gives the request
        from memfit.profiling.oom_text import parse_oom

        m = parse_oom(given["error"])
        gained = m.other_bytes if fix.name == "free_other_processes" else m.reserved_unallocated or 0
        return gained + m.free >= m.requested
    card = gpu(s.card)
    room = given.get("room", card.memory_bytes)
    if fix.name == "free_other_processes":
        room = card.memory_bytes
    recipe = Recipe.from_dict(fix.recipe) if fix.recipe is not None else s.kw.get("recipe")
    report = memfit.estimate(s.model, gpu=card, budget=room, **{**s.kw, "recipe": recipe})
    return report.verdict != OOM  # "fits_with_expandable_segments": the fix's command sets it


def _shape(s: Scenario) -> dict:
    return {"batch_size": s.kw["batch_size"], "seq_len": s.kw["seq_len"]}


def one(s: Scenario, folder: str, plan: bool) -> dict:
    start = time.perf_counter()
    if s.kind == "profile":
        data, message = profiled(s.script, s.budget, folder)
        found = diagnose(message, profile=data, budget=s.budget, plan=plan)
        given = {}
    else:
        given = prepare(s)
        kw = dict(s.kw)
        if s.with_model and s.model is not None:
            kw.update(model=s.model)
        else:
            kw = {}
        label = os.path.relpath(s.model, ROOT) if s.model == TINY else None  # the fixes' commands name it so
        found = diagnose(given["error"], budget=given.get("budget"), allow=s.allow, plan=plan, label=label, **kw)
        if s.card is not None and s.id in ("c3", "c6"):
            from memfit.profiling.oom_text import parse_oom

            m = parse_oom(given["error"])
            given["room"] = min(m.capacity - m.other_bytes,
                                (m.allowed + gpu(s.card).cuda_context_bytes) if m.allowed else m.capacity)
    first = found.fixes[0] if found.fixes else None
    fits = applied(s, first, given, folder)
    return {"id": s.id, "what": s.what, "kind": s.kind, "expected": s.expected, "cause": found.cause,
            "right": found.cause == s.expected, "summary": found.summary,
            "first_fix": None if first is None else first.to_dict(), "first_fix_fits": fits,
            "fixes": [{"name": f.name, "saves_bytes": f.saves_bytes, "fits": f.fits,
                       "speed_cost": None if f.speed_cost is None else round(f.speed_cost, 3), "why": f.why}
                      for f in found.fixes], "exit_code": found.exit_code, "notes": list(found.notes),
            "message": given.get("error", "")[-900:] if s.kind != "profile" else None,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-plan", dest="plan", action="store_false")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        chosen = [s for s in scenarios(folder) if not args.only or s.id in args.only.split(",")]
        for s in chosen:
            with contextlib.redirect_stderr(io.StringIO()):
                row = one(s, folder, args.plan)
            rows.append(row)
            fix = row["first_fix"]["name"] if row["first_fix"] else "-"
            print(f"{row['id']:<3} {row['expected']:<22} {row['cause']:<22} {'ok ' if row['right'] else 'BAD'} "
                  f"{fix:<22} fits={row['first_fix_fits']!s:<5} {row['seconds']:>6.1f}s", flush=True)
    counted = [r for r in rows if r["expected"] != "unknown"]
    right = sum(r["right"] for r in counted)
    fixed = sum(bool(r["first_fix_fits"]) for r in counted)
    print(f"cause right {right}/{len(counted)}; first fix fits {fixed}/{len(counted)} (control u1 not counted)")
    if args.only:
        return
    out = _results.write(RESULTS, rows, {"right": right, "first_fix_fits": fixed, "counted": len(counted)},
                         threads=1, plan=args.plan)
    print(f"wrote {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
