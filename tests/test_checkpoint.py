"""Checkpoints: a round trip restores weights, optimizer and RNG exactly; a process killed with
SIGKILL while saving leaves only complete checkpoints, the newest of which loads."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from memfit import MemfitError
from memfit.training.checkpoint import (checkpoints, latest_checkpoint, load_checkpoint, rng_state,
                                        save_checkpoint, set_rng_state)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))


def _train(model, opt, steps):
    for _ in range(steps):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_round_trip_continues_bit_for_bit(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    save_checkpoint(tmp_path, 3, model, {"optimizer": opt.state_dict(), "rng": rng_state(), "position": 12})
    random.random()
    _train(model, opt, 2)
    expected = [p.detach().clone() for p in model.parameters()]

    again = _model()
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    state = load_checkpoint(latest_checkpoint(tmp_path), again)
    opt2.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    random.random()
    _train(again, opt2, 2)
    assert state["position"] == 12
    for a, b in zip(expected, again.parameters()):
        assert torch.equal(a, b)


def test_keeps_the_newest_and_refuses_a_foreign_directory(tmp_path):
    model = _model()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, {"step": step}, keep=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [4, 5]
    with pytest.raises(MemfitError, match="not a memfit checkpoint"):
        load_checkpoint(tmp_path, model)
    with pytest.raises(MemfitError, match="does not match the model"):
        load_checkpoint(latest_checkpoint(tmp_path), torch.nn.Linear(3, 3))


WRITER = textwrap.dedent("""
    import sys, torch
    from memfit.training.checkpoint import save_checkpoint
    model = torch.nn.Linear(512, 512)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        save_checkpoint(sys.argv[1], step, model, {"step": step, "blob": torch.full((4096,), step)}, keep=2)
""")


def test_sigkill_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for trial in range(5):
        out = tmp_path / f"run{trial}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], env=env)
        deadline = time.time() + 60
        while latest_checkpoint(out) is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        newest = latest_checkpoint(out)
        model = torch.nn.Linear(512, 512)
        state = load_checkpoint(newest, model)
        assert int(newest.name.split("-")[1]) == state["step"]
        assert torch.equal(model.weight, torch.full_like(model.weight, state["step"]))
        assert torch.equal(state["blob"], torch.full((4096,), state["step"]))
        save_checkpoint(out, state["step"] + 1, model, {"step": state["step"] + 1})  # resuming cleans up
        assert not list(out.glob(".partial-*"))
