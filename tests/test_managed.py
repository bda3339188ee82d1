"""Managed memory: bitsandbytes' paged optimizer state (``cudaMallocManaged``) as its own figure.

Evidence: which buffers bnb pages is read from bnb's own ``init_state`` / ``get_state_buffer`` run on
meta parameters with ``F.get_paged`` recorded (its GPU branch, taken for any non-CPU device); on CPU
semantics the paged optimizer is bnb's CPU fallback and the estimate is graded by the CPU allocator;
the verdict's rule (module docstring of ``estimator/verdict.py``) on hand-made event streams.
"""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import transformers as tf

import memfit
from memfit import Recipe
from memfit.accounting.ledger import ALLOC, FREE
from memfit.estimator.truth import true_peak
from memfit.estimator.verdict import FITS, OOM, cuda_fit
from memfit.hardware.gpus import gpu
from memfit.models.zoo import CASES
from memfit.planner.cost import EFFICIENCY, Speed

MiB = 1 << 20


def _bnb_paged(shapes):
    """(bytes of each buffer bnb's PagedAdamW8bit makes with ``F.get_paged``, by parameter), from
    bnb's own state initialisation on meta parameters (a non-CPU device takes its GPU branch)."""
    import bitsandbytes.functional as F
    from bitsandbytes.optim import PagedAdamW8bit

    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    opt = PagedAdamW8bit(params, lr=1e-4)
    paged = {}

    def get_paged(*shape, dtype=torch.float32, device=None):
        paged.setdefault(current, []).append(dtype.itemsize * torch.Size(shape).numel())
        out = torch.empty(shape, dtype=dtype, device="meta")
        out.is_paged = True
        return out

    saved = F.get_paged, F.fill
    F.get_paged, F.fill = get_paged, lambda *a, **k: None
    try:
        for i, p in enumerate(params):
            current = i
            opt.init_state(opt.param_groups[0], p, 0, i)
    finally:
        F.get_paged, F.fill = saved
    return paged


class _Mixed(torch.nn.Module):
    """Parameters on both sides of bnb's paging threshold and of its 8-bit threshold."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(512, 512)  # 262,144 weights: paged; bias 512: fp32, not paged
        self.mid = torch.nn.Linear(512, 128)  # 65,536: 8-bit state on the device
        self.out = torch.nn.Linear(128, 1000)  # 128,000: paged

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.big(x)))))


def _batch():
    return {"x": torch.randn(8, 512)}


def _loss(model, batch):
    return model(batch["x"]).float().pow(2).mean()


def test_managed_bytes_are_what_bnb_pages():
    shapes = [tuple(p.shape) for p in _Mixed().parameters()]
    paged = _bnb_paged(shapes)
    assert sorted(paged) == [0, 4]  # big.weight and out.weight only
    report = memfit.estimate(_Mixed, _batch(), loss_fn=_loss, optimizer="paged_adamw8bit", gpu="rtx-4090")
    assert report.managed_bytes == sum(sum(v) for v in paged.values()) == 2 * (262_144 + 128_000)
    assert report.managed_resident_bytes == max(sum(v) for v in paged.values())  # state1 + state2 of big
    # the device figures lose exactly the managed state: same step, same stream otherwise
    plain = memfit.estimate(_Mixed, _batch(), loss_fn=_loss, optimizer="adamw8bit", gpu="rtx-4090")
    assert plain.managed_bytes is None
    assert (plain.by_category["optimizer_state"] - report.by_category["optimizer_state"]) == report.managed_bytes
    assert report.peak_bytes < plain.peak_bytes and report.reserved_bytes <= plain.reserved_bytes
    assert report.verdict == FITS and report.paged_bytes == 0  # a 24 GB card has room for all of it


def test_cpu_semantics_have_no_managed_memory_and_match_the_allocator():
    factory, make_batch, loss_fn = CASES["mlp"]  # two weights above bnb's paging threshold
    recipe = Recipe(optimizer="paged_adamw8bit")
    report = memfit.estimate(factory, make_batch(), loss_fn=loss_fn, recipe=recipe)
    assert report.managed_bytes is None and report.paged_bytes is None  # bnb does not page on the CPU
    measured = true_peak(factory, make_batch(), loss_fn=loss_fn, recipe=recipe)
    assert abs(report.peak_bytes - measured) <= 16, (report.peak_bytes, measured)
    same = memfit.estimate(factory, make_batch(), loss_fn=loss_fn, recipe=Recipe(optimizer="adamw8bit"))
    assert report.peak_bytes == same.peak_bytes


def _ledger(events):
    """A ledger-like object from ("alloc", key, bytes[, managed]) / ("free", key)."""
    records, out, index = [], [], {}
    for e in events:
        if e[0] == "alloc":
            index[e[1]] = len(records)
            records.append(SimpleNamespace(nbytes=e[2], donor=None, donated=False,
                                           managed=e[3] if len(e) > 3 else 0))
            out.append((ALLOC, index[e[1]]))
        else:
            out.append((FREE, index[e[1]]))
    return SimpleNamespace(records=records, events=out)


def _card(capacity):
    card = gpu("rtx-4090")
    return dataclasses.replace(card, memory_bytes=capacity + card.outside_bytes)


# 30 MiB of device memory (one 30 MiB segment), and two parameters' paged state: 2 x 8 MiB and 2 x 4 MiB
STEP = [("alloc", "w", 30 * MiB), ("alloc", "s1", 8 * MiB, 16 * MiB), ("alloc", "s2", 8 * MiB, 16 * MiB),
        ("alloc", "t1", 4 * MiB, 8 * MiB), ("alloc", "t2", 4 * MiB, 8 * MiB)]


def test_managed_memory_is_outside_reserved_and_fits_beside_it():
    f = cuda_fit(_ledger(STEP), _card(64 * MiB))
    assert (f.verdict, f.allocated, f.reserved) == (FITS, 30 * MiB, 30 * MiB)  # torch's counters
    assert (f.managed_bytes, f.managed_resident_bytes, f.paged_bytes) == (24 * MiB, 16 * MiB, 0)


def test_what_does_not_fit_beside_reserved_pages():
    # 40 MiB card: 10 MiB beside the 30 MiB segment; the 16 MiB being updated does not fit -> OOM
    f = cuda_fit(_ledger(STEP), _card(40 * MiB))
    assert (f.verdict, f.missing_bytes, f.paged_bytes) == (OOM, 6 * MiB, None)
    # 46 MiB: the 16 MiB working set fits, 24 - 16 = 8 MiB pages each step
    f = cuda_fit(_ledger(STEP), _card(46 * MiB))
    assert (f.verdict, f.paged_bytes, f.reserved) == (FITS, 8 * MiB, 30 * MiB)
    assert f.tight  # no room left beside the working set


def test_freed_managed_memory_leaves_the_peak():
    events = STEP + [("free", "t1"), ("free", "t2"), ("alloc", "u", 2 * MiB, 2 * MiB)]
    f = cuda_fit(_ledger(events), _card(64 * MiB))
    assert (f.managed_bytes, f.managed_resident_bytes) == (24 * MiB, 16 * MiB)


def test_paging_is_charged_both_ways_over_the_host_link():
    card = gpu("rtx-4090")
    speed = Speed.from_gpu(card)
    assert speed.paging_seconds(1e9) == pytest.approx(2e9 / (card.host_link_bandwidth * EFFICIENCY["host_link"]))
    assert speed.paging_seconds(-5.0) == 0.0


def _llama(layers=10):
    # hidden 256: MLP weights (131,072) and the embeddings are paged, attention weights (65,536) are not
    return tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256,
                          architectures=["LlamaForCausalLM"])


def test_fast_path_equals_full_trace():
    recipe = Recipe(optimizer="paged_adamw8bit", precision="bf16-mixed")
    cfg = dict(recipe=recipe, batch_size=2, seq_len=64, gpu="rtx-4090")
    fast, full = memfit.estimate(_llama(), fast=True, **cfg), memfit.estimate(_llama(), fast=False, **cfg)
    assert fast.method == "depth"
    # 3 paged MLP weights per block, untied embeddings and head
    assert full.managed_bytes == 2 * (10 * 3 * 131_072 + 2 * 262_144)
    for key in ("managed_bytes", "managed_resident_bytes", "paged_bytes", "peak_bytes", "reserved_bytes"):
        assert getattr(fast, key) == getattr(full, key), key


def test_cli_shows_managed_memory(capsys, tmp_path):
    from memfit.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama(2).to_dict()))
    args = [str(path), "--seq-len", "64", "--gpu", "rtx-4090", "--optimizer", "paged_adamw8bit", "--full"]
    assert main(["estimate", *args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    report = data.get("report", data)
    assert report["managed_bytes"] > 0 and report["paged_bytes"] == 0
    assert main(["estimate", *args]) == 0
    text = capsys.readouterr().out
    assert "managed, paged" in text and "paged optimizer state" in text


def test_the_planner_charges_what_pages_past_the_budget():
    from memfit.models.source import resolve
    from memfit.planner.compose import Engine

    card = gpu("rtx-4090")
    engine = Engine(resolve(_llama(2)), None, card, 32, None, "adamw", 2, None)  # 2 blocks: traced whole
    recipe = Recipe(optimizer="paged_adamw8bit", micro_batch_size=2)
    engine.prepare([recipe])
    roomy = engine.predict(recipe, card.memory_bytes)
    assert engine.predict(recipe).step_seconds == roomy.step_seconds  # all of it stays on the card
    full = memfit.estimate(_llama(2), recipe=recipe, seq_len=32, gpu="rtx-4090", fast=False)
    short = 1 << 20  # 1 MiB of room beside the prediction: everything but that pages, both ways
    tight = engine.predict(recipe, roomy.device_bytes + short)
    paged = full.managed_bytes - short
    assert tight.step_seconds - roomy.step_seconds == pytest.approx(Speed.from_gpu(card).paging_seconds(paged),
                                                                     rel=1e-3)
