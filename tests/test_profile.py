"""memfit.profile() around users' own loops, graded by the CPU allocator's own events (estimator/truth.py).

The loops (tests/_loops.py) are written as users write them, with no memfit inside; the truth runs the
same loop with nobody watching, one profiler session per step.
"""

from __future__ import annotations

import functools
import json
import statistics
import textwrap
from types import SimpleNamespace

import pytest
import torch

import _loops
from memfit.cli import main
from memfit.estimator.truth import allocator_steps
from memfit.profiling.cuda_snapshot import allocated_peak, reserved_series
from memfit.profiling.profile import profile


def _profiled(loop, **kwargs):
    with profile(device="cpu", **kwargs) as prof:
        for _ in loop():
            pass
    return prof


@functools.cache
def _profiled_once(loop):
    """What the tests read of ``_profiled(loop)``, once for the file: a loop two tests read (llama-adamw,
    eval-with-grad) runs once. Not the profile itself: it would keep the loop's model alive, and a later
    profile counts every live parameter (test_a_model_built_before_the_profile)."""
    prof = _profiled(loop)
    return SimpleNamespace(report=prof.report, entry_bytes=prof.entry_bytes, steps=prof.steps,
                           forwards_without_backward=prof.forwards_without_backward)


@pytest.mark.parametrize("name", ["llama-adamw", "convnet-adam", "lstm-rmsprop", "gpt2-accumulate-clip"])
def test_peak_matches_the_allocator(name):
    loop = _loops.MODELS[name]
    prof = _profiled_once(loop)
    truth, _ = allocator_steps(loop())
    mine = prof.report.peak_bytes - prof.entry_bytes
    assert abs(mine - truth) <= 0.005 * truth, (mine, truth)
    assert len(prof.report.step_peaks) == prof.steps == 4
    assert all(prof.report.phase_peaks[p] > 0 for p in ("forward", "backward", "optimizer"))


def test_categories_of_a_users_loop():
    prof = _profiled_once(_loops.llama_adamw)
    report = prof.report
    model = _loops._llama()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.by_category["parameters"] == weights
    assert report.settings["inputs"][0]["shapes"] == [[4, 64], [4, 64]]
    # AdamW's two moments of every weight (and its step counters) are optimizer state from step 2 on
    assert 2 * weights <= report.by_category["optimizer_state"] < 2 * weights + 4096
    assert report.by_category["activations"] > 0
    assert report.parameters == sum(p.numel() for p in model.parameters())
    assert report.top_allocations[0]["bytes"] == max(a["bytes"] for a in report.top_allocations)
    assert report.stacked is not None and len(report.stacked["event"]) == len(report.timeline)


@pytest.mark.parametrize("name", sorted(_loops.LEAKY))
def test_leaks_are_found_by_line_with_their_bytes(name):
    loop = _loops.LEAKY[name]
    prof = _profiled_once(loop)
    _, nets = allocator_steps(loop())
    per_step = statistics.median(nets[1:])
    leaks = prof.report.leaks
    assert leaks, "no leak found"
    assert leaks[0]["site"].endswith(f"_loops.py:{_loops.leak_line(loop)}"), leaks
    found = sum(leak["bytes_per_step"] for leak in leaks)
    assert abs(found - per_step) <= 0.01 * per_step, (found, per_step)
    assert leaks[0]["stack"][0].startswith(leaks[0]["site"])


@pytest.mark.parametrize("name", sorted(_loops.CLEAN))
def test_clean_loops_have_no_leak(name):
    loop = _loops.CLEAN[name]
    prof = _profiled(loop)
    _, nets = allocator_steps(loop())
    assert all(net == 0 for net in nets[1:])  # the loop really is clean
    assert prof.report.leaks == []
    assert prof.forwards_without_backward == []


def test_evaluation_without_no_grad_is_seen():
    prof = _profiled_once(_loops.leak_eval_with_grad)
    seen = prof.forwards_without_backward
    assert len(seen) == prof.steps == 6
    line = _loops.leak_line(_loops.leak_eval_with_grad)
    assert all(entry["site"].endswith(f"_loops.py:{line}") and entry["bytes"] > 0 for entry in seen)


def test_a_model_built_before_the_profile():
    model = _loops._llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _loops._tokens(2, 32)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # optimizer state exists before the profile
    with profile(device="cpu") as prof:
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert prof.report.by_category["parameters"] == weights
    assert prof.report.by_category["optimizer_state"] >= 2 * weights
    assert prof.entry_bytes >= 4 * weights  # weights, gradients and two moments were there already
    assert prof.steps == 3


def test_a_budget_ends_the_loop_with_what_was_live():
    with pytest.raises(torch.OutOfMemoryError):
        _profiled(_loops.llama_adamw, budget="6MiB")
    with pytest.raises(torch.OutOfMemoryError):
        with profile(device="cpu", budget="6MiB") as prof:
            for _ in _loops.llama_adamw():
                pass
    assert prof.oom is not None and prof.oom["live_bytes"] <= 6 * 2**20
    assert prof.oom["phase"] in ("forward", "backward", "optimizer")
    assert prof.report is not None


def test_max_steps_stops_the_loop_quietly():
    with profile(device="cpu", max_steps=2) as prof:
        for _ in _loops.clean_plain():
            pass
    assert prof.steps == 2 and len(prof.report.step_peaks) == 2


_SCRIPT = '''
import sys, torch
sys.path.insert(0, {tests!r})
import _loops
steps = int(sys.argv[1])
model = _loops._llama()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
kept = []
for step in range(steps):
    ids = _loops._tokens(2, 32)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    kept.append(out.logits.detach().clone())
print("trained", steps, "steps", file=sys.stderr)
'''


def test_cli_profiles_a_script_unchanged(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(tests=str(__import__("pathlib").Path(_loops.__file__).parent))))
    assert main(["profile", "--json", "--steps", "0", str(script), "6"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["steps"]) == 6 and data["peak_bytes"] == max(s["peak_bytes"] for s in data["steps"])
    assert data["leaks"][0]["site"].endswith("train.py:15")
    assert data["leaks"][0]["bytes_per_step"] == 2 * 32 * 512 * 4  # the logits kept each step
    assert data["script"]["argv"][1:] == ["6"]
    assert main(["profile", "--steps", "3", str(script), "6"]) == 0  # stopped after 3 steps
    out = capsys.readouterr().out
    assert "steps: 1:" in out and "3:" in out and "4:" not in out.split("steps:")[1].split("\n")[0]


def test_cli_bad_input_is_one_line(capsys):
    for argv in (["profile"], ["profile", "no-such-script.py"], ["profile", "-m", "no_such_module_here"],
                 ["profile", "--steps", "-1", __file__]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("memfit: error:"), err


def test_cuda_snapshot_series():
    """The allocator's trace as torch.cuda.memory._snapshot() writes it (made by hand: no GPU here)."""
    mib = 2**20
    trace = [{"action": "segment_alloc", "addr": 0, "size": 20 * mib, "stream": 0, "frames": []},
             {"action": "alloc", "addr": 0, "size": 8 * mib, "stream": 0, "frames": []},
             {"action": "alloc", "addr": 8 * mib, "size": 8 * mib, "stream": 0, "frames": []},
             {"action": "free_requested", "addr": 0, "size": 8 * mib, "stream": 0, "frames": []},
             {"action": "free_completed", "addr": 0, "size": 8 * mib, "stream": 0, "frames": []},
             {"action": "segment_alloc", "addr": 64 * mib, "size": 2 * mib, "stream": 0, "frames": []},
             {"action": "alloc", "addr": 64 * mib, "size": 512, "stream": 0, "frames": []},
             {"action": "segment_free", "addr": 0, "size": 20 * mib, "stream": 0, "frames": []}]
    snapshot = {"segments": [], "device_traces": [trace]}
    assert allocated_peak(snapshot) == 16 * mib
    series = reserved_series(snapshot)
    assert series["bytes"] == [20 * mib, 22 * mib, 2 * mib] and series["event"] == [0, 5, 7]


def test_a_dead_weak_proxy_anywhere_in_the_process_does_not_stop_a_profile():
    """A profile scans every live object for the tensors that exist before it; ``isinstance`` on a weak proxy whose
    object is gone raises ReferenceError: such a proxy (any library's) is skipped, not read."""
    import weakref

    class Gone:
        pass

    thing = Gone()
    proxy = weakref.proxy(thing)
    del thing
    model = torch.nn.Linear(4, 4)
    with profile(device="cpu", model=model) as prof:
        model(torch.randn(2, 4)).sum().backward()
    assert prof.report is not None and prof.report.peak_bytes > 0
    assert proxy is not None  # kept alive through the profile


def test_an_optimizer_without_state_anywhere_in_the_process_does_not_stop_a_profile():
    """torchao's CPUOffloadOptimizer is a torch Optimizer that never runs ``Optimizer.__init__``: it has no ``state``.
    One alive anywhere in the process (the suite's offload estimate left one) stopped every later profile with an
    AttributeError; it is read as holding no state of its own."""

    class NoInit(torch.optim.Optimizer):  # as torchao's CPUOffloadOptimizer
        def __init__(self):
            pass

    kept = NoInit()
    model = torch.nn.Linear(4, 4)
    with profile(device="cpu", model=model) as prof:
        model(torch.randn(2, 4)).sum().backward()
    assert prof.report is not None and prof.report.peak_bytes > 0 and not hasattr(kept, "state")
