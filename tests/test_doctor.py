"""memfit doctor: torch's out-of-memory messages read to the byte (torch >= 2.1, < 2.1, the CPU allocator, the
virtual budget; the last one in a log), each cause named on its scenario — real CPU steps run out under a
virtual budget, CUDA messages from memfit's own estimate, hand-made profiles, a script run under the
profiler — and the first fix, applied for real under the same budget, fits. The CLI's JSON and exit codes."""

import contextlib
import gc
import io
import json

import pytest
import torch

import memfit
from memfit import Recipe
from memfit.cli import main
from memfit.hardware.gpus import gpu
from memfit.planner.cost import Speed
from memfit.profiling import findings
from memfit.profiling.doctor import CAUSES, NoOomFound, diagnose, diagnose_profile, run_step
from memfit.profiling.oom_text import c10_size, parse_oom

MiB, GiB = 2**20, 2**30
NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "79.19 GiB of which 1.06 GiB is free. Process 12345 has 30.00 GiB memory in use. Process 777 has 512.00 MiB "
       "memory in use. Including non-PyTorch memory, this process has 47.62 GiB memory in use. Of the allocated "
       "memory 40.50 GiB is allocated by PyTorch, and 6.90 GiB is reserved by PyTorch but unallocated. If reserved "
       "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
       "fragmentation.  See documentation for Memory Management  "
       "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
       "already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> "
       "allocated memory try setting max_split_size_mb to avoid fragmentation.")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 4,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
MINI = dict(LLAMA, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_key_value_heads=2,
            vocab_size=128, tie_word_embeddings=True)
WIDE = dict(LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_key_value_heads=4,
            vocab_size=8192, tie_word_embeddings=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Two cores are shared: tiny kernels on several threads spend their time waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fixed_speed(monkeypatch):
    """The cost model's CPU rates, fixed: measuring this CPU takes seconds and is not what is tested."""
    monkeypatch.setattr(Speed, "host", classmethod(lambda cls: Speed("cpu", (1e11, 2e11, 1e9), 2e10, 2e-5, 0.0)))


def _config(tmp_path, name, config):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return str(tmp_path / name)


def _cli(*argv, stdin=None, monkeypatch=None):
    out = io.StringIO()
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with contextlib.redirect_stdout(out):
        code = main(["doctor", *argv])
    return code, out.getvalue()


# -- reading the messages ------------------------------------------------------------------------------

def test_torch_2_message_is_read_to_its_printed_precision():
    m = parse_oom(NEW)
    assert (m.kind, m.device) == ("cuda", "cuda:0")
    assert m.requested == 2 * GiB and m.capacity == round(79.19 * GiB) and m.free == round(1.06 * GiB)
    assert m.other_processes == ((12345, 30 * GiB), (777, 512 * MiB)) and m.other_bytes == 30 * GiB + 512 * MiB
    assert m.this_process == round(47.62 * GiB) and m.allocated == round(40.5 * GiB)
    assert m.reserved_unallocated == round(6.9 * GiB) and m.allowed is None
    assert m.message.startswith("CUDA out of memory.") and m.message.endswith("but unallocated.")
    # torch 2.1 spells "capacty"; a log wraps lines; a capped process says "allowed"; ROCm says HIP
    capped = NEW.replace("capacity", "capacty").replace(". Of the", ". 40.00 GiB allowed; Of the").replace(". ", ".\n")
    m = parse_oom(capped.replace("CUDA out", "HIP out"))
    assert m.capacity == round(79.19 * GiB) and m.allowed == 40 * GiB and m.reserved_unallocated == round(6.9 * GiB)


def test_older_torch_cpu_and_virtual_budget_messages():
    m = parse_oom(OLD)
    assert m.kind == "cuda-legacy" and m.requested == 36 * MiB and m.capacity == round(7.93 * GiB)
    assert m.allocated == round(130.35 * MiB) and m.free == round(47.06 * MiB)
    assert m.reserved_unallocated == round(188 * MiB) - round(130.35 * MiB)
    m = parse_oom("RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
                  "you tried to allocate 123456789 bytes.")
    assert (m.kind, m.requested, m.capacity) == ("cpu", 123456789, None)
    m = parse_oom("memfit virtual budget: tried to allocate 2.75 MiB with 57.68 MiB of 58.87 MiB in use")
    assert (m.kind, m.requested, m.this_process, m.capacity) == ("virtual", round(2.75 * MiB), round(57.68 * MiB),
                                                                 round(58.87 * MiB))
    assert parse_oom("memfit virtual budget: injected out-of-memory at step 1, micro-batch 0, forward "
                     "(allocation 1)").requested is None
    for n in (0, 1024, 1025, 5 * MiB + 3, 3 * GiB):  # c10's format_size, read back within its rounding
        assert abs(parse_oom(f"DefaultCPUAllocator: not enough memory: x. memfit virtual budget: tried to allocate "
                             f"{c10_size(n)} with 1 bytes of 2 bytes in use").requested - n) <= max(n, 1) * 0.005


def test_the_last_message_in_a_log_counts_and_none_is_no_oom():
    log = f"step 1\n{OLD}\nretrying with a smaller batch\n  File \"train.py\", line 3\n{NEW}\nexiting"
    assert parse_oom(log).kind == "cuda"
    assert parse_oom("Traceback: ValueError: shapes do not match") is None
    with pytest.raises(NoOomFound, match="no out-of-memory error"):
        diagnose("ValueError: shapes do not match")


# -- causes from the message alone ---------------------------------------------------------------------

def test_other_process_fragmentation_and_unknown_from_the_message():
    found = diagnose(NEW)  # others hold 30.5 GiB; 6.9 GiB fragmented: the larger names it
    assert found.cause == "other_process" and found.fixes[0].name == "free_other_processes"
    assert found.fixes[0].saves_bytes == 30 * GiB + 512 * MiB and found.fixes[0].fits and found.exit_code == 0
    assert "12345, 777" in found.fixes[0].command
    alone = NEW.replace("Process 12345 has 30.00 GiB memory in use. Process 777 has 512.00 MiB memory in use. ", "")
    found = diagnose(alone)
    assert found.cause == "fragmentation" and found.fixes[0].command.startswith(findings.ALLOC_CONF)
    assert found.fixes[0].saves_bytes == round(6.9 * GiB) and found.fixes[0].fits
    tidy = alone.replace("and 6.90 GiB is reserved", "and 20.00 MiB is reserved")
    found = diagnose(tidy)
    assert found.cause == "unknown" and not found.fixes and found.exit_code == 3
    assert "memfit doctor --budget SIZE -- python" in found.summary
    # a process at its cap (set_per_process_memory_fraction) with the card's memory free: not the other process
    capped = NEW.replace("of which 1.06 GiB is free", "of which 20.00 GiB is free").replace(
        ". Of the", ". 41.00 GiB allowed; Of the").replace("and 6.90 GiB is reserved", "and 20.00 MiB is reserved")
    assert diagnose(capped).cause == "unknown"


# -- causes from a profile (memfit.profile()'s to_dict, made by hand) ------------------------------------

def _profile(**extra):
    oom = {"message": "memfit virtual budget: tried to allocate 1.00 MiB with 99.00 MiB of 100.00 MiB in use",
           "phase": "forward", "step": 9, "requested_bytes": MiB, "live_bytes": 99 * MiB,
           "by_category": {"parameters": 10 * MiB, "gradients": 10 * MiB, "optimizer_state": 20 * MiB,
                           "activations": 50 * MiB, "temporaries": 9 * MiB}}
    data = {"peak_bytes": 99 * MiB, "oom": oom, "leaks": [], "forwards_without_backward": [],
            "inputs": [{"step": k, "shapes": [[8, 64]], "tokens": 512} for k in range(10)],
            "steps": [{"step": k + 1, "peak_bytes": 60 * MiB, "tokens": 512} for k in range(9)]}
    data.update(extra)
    return data


def test_profile_causes_by_their_rules():
    leaks = [{"site": "train.py:42", "bytes_per_step": 4 * MiB, "steps": 8, "category": "activations", "stack": []}]
    found = diagnose_profile(_profile(leaks=leaks), 100 * MiB)
    assert found.cause == "leak" and found.fixes[0].name == "fix_leak" and found.fixes[0].saves_bytes == 32 * MiB
    assert found.fixes[0].fits and "train.py:42" in found.fixes[0].command
    assert diagnose_profile(_profile(leaks=[dict(leaks[0], bytes_per_step=MiB)]), 100 * MiB).cause == "activations"
    # an evaluation loop: forwards that completed in the step that ran out, no backward took them
    loose = [{"step": 9, "bytes": 12 * MiB, "site": "eval.py:7"} for _ in range(3)]
    found = diagnose_profile(_profile(forwards_without_backward=loose), 100 * MiB)
    assert found.cause == "eval_without_no_grad" and "torch.no_grad()" in found.fixes[0].command
    assert found.fixes[0].saves_bytes == 36 * MiB
    # the forward the OOM cut short alone is any step's forward: not an evaluation
    assert diagnose_profile(_profile(forwards_without_backward=loose[:1]), 100 * MiB).cause == "activations"
    inputs = [{"step": k, "shapes": [[8, 64]], "tokens": 512 * (8 if k == 9 else 1)} for k in range(10)]
    found = diagnose_profile(_profile(inputs=inputs), 100 * MiB)
    assert found.cause == "long_batch" and found.fixes[0].fits and found.fixes[0].saves_bytes == 40 * MiB
    assert diagnose_profile(_profile(inputs=inputs[:9]), 100 * MiB).cause == "activations"  # the step has no entry


def test_profile_category_causes_and_no_oom():
    oom = _profile()["oom"]
    states = dict(oom, by_category={"parameters": 40 * MiB, "gradients": 40 * MiB, "optimizer_state": 80 * MiB})
    assert diagnose_profile(_profile(oom=states), 100 * MiB).cause == "model_states"
    assert diagnose_profile(_profile(oom=dict(oom, phase="optimizer")), 100 * MiB).cause == "optimizer_temporaries"
    assert diagnose_profile(_profile(), None).cause == "activations"  # capacity: the live bytes at the OOM
    assert diagnose_profile(_profile(oom=None), 90 * MiB).figures["live_bytes"] == 99 * MiB  # its peak, over
    with pytest.raises(NoOomFound):
        diagnose_profile(_profile(oom=None), 200 * MiB)
    assert set(CAUSES) >= {"leak", "eval_without_no_grad", "long_batch", "unknown"}


# -- causes from the model: real steps under a virtual budget, fixed and run again ------------------------

def _ran_out(model, budget, **shape):
    message = run_step(model, budget=budget, **shape)
    assert message is not None and "virtual budget" in message
    return message


def _fix_runs(model, found, budget, **shape):
    fix = found.fixes[0]
    assert fix.fits and fix.recipe is not None and fix.command.startswith("memfit estimate ")
    assert run_step(model, Recipe.from_dict(fix.recipe), budget=budget, **shape) is None  # applied: it fits
    return fix


def test_activations_on_a_virtual_budget_then_the_first_fix_runs(tmp_path, fixed_speed, monkeypatch):
    model, shape = _config(tmp_path, "mini", MINI), dict(batch_size=8, seq_len=128)
    chosen = Recipe(checkpointing="blocks", micro_batch_size=4, grad_accum_steps=2)

    class Plans:  # memfit.plan's answer, stubbed: the search itself takes tens of seconds (test_plan.py has it)
        best = type("Best", (), {"recipe": chosen})
        report = memfit.estimate(model, recipe=chosen, **shape)

    monkeypatch.setattr("memfit.planner.plan.plan", lambda *a, **k: Plans)
    budget = int(memfit.estimate(model, **shape).peak_bytes * 0.6)
    found = diagnose(_ran_out(model, budget, **shape), model=model, **shape)
    assert found.cause == "activations" and found.figures["kind"] == "virtual"
    assert found.evidence["needed_bytes"] > budget >= found.evidence["model_state_bytes"]
    fits = [f.fits for f in found.fixes]
    assert fits == sorted(fits, reverse=True)  # those that fit first ...
    timed = [f.speed_cost for f in found.fixes if f.fits]
    assert None not in timed and timed == sorted(timed)  # ... the faster first
    assert all(f.saves_bytes > 0 and not f.changes_math for f in found.fixes)
    plan = [f for f in found.fixes if f.name == "plan"][0]
    assert plan.fits and plan.recipe == chosen.to_dict() and "--checkpointing blocks" in plan.command
    assert plan.saves_bytes == found.evidence["needed_bytes"] - Plans.report.peak_bytes
    assert found.exit_code == 0
    _fix_runs(model, found, budget, **shape)


def test_optimizer_temporaries_and_model_states_on_a_virtual_budget(tmp_path, fixed_speed, monkeypatch):
    from memfit.planner import cache as engine_cache

    shared = engine_cache.EngineCache()  # the three diagnoses of one model and step time fixes on the same traces
    monkeypatch.setattr(engine_cache, "EngineCache", lambda: shared)
    model, shape = _config(tmp_path, "wide", WIDE), dict(batch_size=1, seq_len=16)
    report = memfit.estimate(model, **shape)
    graph = max(report.phase_peaks["forward"], report.phase_peaks["backward"])
    assert report.phase_peaks["optimizer"] > graph  # the scenario: the step's temporaries over the big head
    budget = (graph + report.phase_peaks["optimizer"]) // 2
    found = diagnose(_ran_out(model, budget, **shape), model=model, plan=False, **shape)
    assert found.cause == "optimizer_temporaries"
    assert _fix_runs(model, found, budget, **shape).name == "optimizer_in_backward"
    budget = report.model_state_bytes - 4 * MiB
    message = _ran_out(model, budget, **shape)
    found = diagnose(message, model=model, plan=False, **shape)  # exact only: nothing fits
    assert found.cause == "model_states" and found.exit_code == 3 and "--allow" in " ".join(found.notes)
    found = diagnose(message, model=model, plan=False, allow="lora", **shape)
    fix = _fix_runs(model, found, budget, **shape)
    assert fix.name == "lora" and fix.changes_math and "--lora lora" in fix.command


# -- CUDA: a message made from the estimate of a step on a catalog card --------------------------------------

def test_another_process_on_the_card(tmp_path):
    model, shape = _config(tmp_path, "mini", MINI), dict(batch_size=64, seq_len=256)
    card = gpu("rtx-4090")
    need = memfit.estimate(model, gpu=card, **shape).device_bytes
    other = card.memory_bytes - need + 64 * MiB  # leaves 64 MiB too little
    held = card.memory_bytes - other - 10 * MiB
    message = (f"CUDA out of memory. Tried to allocate 80.00 MiB. GPU 0 has a total capacity of "
               f"{c10_size(card.memory_bytes)} of which 10.00 MiB is free. Process 4242 has {c10_size(other)} memory "
               f"in use. Including non-PyTorch memory, this process has {c10_size(held)} memory in use. Of the "
               f"allocated memory {c10_size(held - card.outside_bytes - 30 * MiB)} is allocated by PyTorch, and "
               "30.00 MiB is reserved by PyTorch but unallocated.")
    found = diagnose(message, model=model, plan=False, **shape)
    assert found.cause == "other_process" and found.fixes[0].name == "free_other_processes"
    assert found.evidence["device"] == "rtx-4090" and "rtx-4090" in found.notes[0]  # the card from the capacity
    assert found.fixes[0].fits and abs(found.evidence["capacity_bytes"] - (card.memory_bytes - other)) < 0.01 * GiB


# -- the command line -------------------------------------------------------------------------------------

def test_cli_json_and_exit_codes(tmp_path, monkeypatch):
    code, out = _cli("--error", NEW, "--json")
    data = json.loads(out)
    assert code == 0 == data["exit_code"] and data["cause"] == "other_process"
    assert set(data["fixes"][0]) >= {"name", "saves_bytes", "fits", "speed_cost", "recipe", "command", "changes_math"}
    assert data["figures"]["requested"] == 2 * GiB
    log = tmp_path / "train.log"
    log.write_text(f"epoch 3\n{OLD.replace('188.00 MiB reserved', '130.35 MiB reserved')}\n")
    code, out = _cli("--error", str(log), "--json")
    assert (code, json.loads(out)["cause"]) == (3, "unknown")
    code, out = _cli("--error", "-", "--json", stdin="loss 2.31\nall good\n", monkeypatch=monkeypatch)
    assert code == 4 and json.loads(out)["cause"] is None
    code, out = _cli("--error", NEW)  # the human view: the cause, the table within 80 columns
    assert code == 0 and "cause: other_process" in out and max(map(len, out.splitlines())) <= 80
    assert main(["doctor"]) == 2  # no evidence: one line, exit 2
    assert main(["doctor", "--profile", str(log)]) == 2  # not JSON


def test_cli_runs_a_script_under_the_profiler(tmp_path):
    script = tmp_path / "evaluate.py"
    script.write_text(
        "import torch\ntorch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for step in range(4):\n"
        "    model(torch.randn(64, 256)).pow(2).mean().backward()\n    opt.step()\n    opt.zero_grad()\n"
        "preds = [model(torch.randn(64, 256)) for _ in range(40)]\n")
    code, out = _cli("--budget", "24MiB", "--json", "--", "python", str(script))
    data = json.loads(out)
    assert (code, data["cause"]) == (0, "eval_without_no_grad") and "evaluate.py:9" in data["fixes"][0]["command"]
    code, out = _cli("--budget", "1GiB", "--json", "--", "python", str(script))
    assert code == 4  # it fits: nothing to diagnose


def test_a_scripts_own_model_gets_recipe_fixes_and_the_first_one_fits(tmp_path, fixed_speed):
    """`memfit doctor --budget B -- python train.py`: the script's model estimated on a batch of its shapes;
    the first fix, applied in the script with memfit.apply, runs under the same budget."""
    tests = str(__import__("pathlib").Path(__file__).parent)
    body = ("import sys, torch, memfit\nsys.path.insert(0, {tests!r})\nimport _loops\nmodel = _loops._llama()\n{setup}\n"
            "for _ in range(3):\n    ids = _loops._tokens(4, 64)\n    {step}\n")
    plain = tmp_path / "train.py"
    plain.write_text(body.format(tests=tests, setup="opt = torch.optim.AdamW(model.parameters())",
                                 step="model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()"))
    from memfit.profiling.watch import Watch

    before = {id(o) for o in gc.get_objects() if type(o) is Watch}  # other tests' of this worker, if any
    code, out = _cli("--budget", "9MiB", "--no-plan", "--json", "--", "python", str(plain))
    data = json.loads(out)
    assert (code, data["cause"]) == (0, "activations")
    # the run's profile (and through it the script's model) is freed by its return, not left to the collector:
    # else the next run's profile counts the first script's tensors as resident
    assert not [o for o in gc.get_objects() if type(o) is Watch and id(o) not in before]
    first = data["fixes"][0]
    assert first["fits"] and first["saves_bytes"] > 0 and "memfit.apply(model, memfit.Recipe(" in first["command"]
    changed = {k: v for k, v in first["recipe"].items() if v != memfit.Recipe().to_dict()[k]}
    fixed = tmp_path / "train_fixed.py"
    fixed.write_text(body.format(tests=tests, setup=f"model, opt, step = memfit.apply(model, memfit.Recipe(**{changed!r}))",
                                 step="step({'input_ids': ids, 'labels': ids})"))
    code, out = _cli("--budget", "9MiB", "--no-plan", "--json", "--", "python", str(fixed))
    assert code == 4  # the fixed script runs to its end under the budget: no out-of-memory to diagnose


MPS = ("RuntimeError: MPS backend out of memory (MPS allocated: 5.50 GB, other allocations: 14.76 GB, max allowed: "
       "20.40 GB). Tried to allocate 147.24 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper "
       "limit for memory allocations (may cause system failure).")


def test_an_mps_message_is_read_and_past_its_high_watermark_is_the_cause():
    """MPS's message (MPSAllocator.mm, torch 2.11 lines 286-295; this one pytorch/pytorch#130112, an 18 GB Mac: 20.40 GB
    = 1.7 x its 12 GiB recommended working set): binary sizes whatever the label, the limit the capacity, heaps and
    Metal's other allocations apart; the cause is MPS's limit, its direct fix the ratio's most (2.0). Without a limit
    (ratio 0.0) Metal itself refused: the Mac's RAM, not a watermark."""
    m = parse_oom(MPS)
    assert (m.kind, m.device) == ("mps", "mps")
    assert m.requested == round(147.24 * 2**20) and m.allowed == m.capacity == round(20.40 * 2**30)
    assert m.mps_heaps == round(5.50 * 2**30) and m.mps_other == round(14.76 * 2**30)
    assert m.this_process == m.mps_heaps + m.mps_other and m.free == m.allowed - m.this_process
    found = diagnose(MPS)
    assert found.cause == "mps_limit" and "past MPS's limit of 20.40 GiB" in found.summary
    assert found.fixes[0].command.startswith("PYTORCH_MPS_HIGH_WATERMARK_RATIO=2.0")
    unlimited = parse_oom("MPS backend out of memory (MPS allocated: 30.00 GiB, other allocations: 2.00 GiB). Tried to "
                          "allocate 1.00 GiB on shared pool.")
    assert unlimited.allowed is None and unlimited.mps_other == 2 * 2**30
    assert diagnose(unlimited).cause == "unknown" and "the Mac's memory itself" in diagnose(unlimited).summary
