"""The categories at the peak hold what the arithmetic of the model says they must."""

import torch

import memfit
from memfit.categories import Category
from memfit.models.zoo import CASES, MLP, classify


def _mlp(optimizer, batch_rows=8):
    batch = (torch.randn(batch_rows, 256), torch.randint(0, 10, (batch_rows,)))
    return memfit.estimate(MLP, batch, loss_fn=classify, optimizer=optimizer), MLP()


def test_adamw_state_is_two_moments_plus_step_counters():
    report, model = _mlp("adamw")
    params = list(model.parameters())
    weights = sum(p.numel() * 4 for p in params)
    cats = report.by_category
    assert cats["parameters"] == weights
    assert cats["optimizer_state"] == 2 * weights + 4 * len(params)  # exp_avg, exp_avg_sq, step


def test_sgd_momentum_state_equals_weights():
    report, model = _mlp("sgd")
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert report.by_category["optimizer_state"] == weights


def test_batch_and_gradients_are_counted():
    report, model = _mlp("sgd")
    assert report.by_category["batch"] == 8 * 256 * 4 + 8 * 8
    # with a small batch the peak is in the optimizer step, where every gradient is live
    assert report.by_category["gradients"] == sum(p.numel() * 4 for p in model.parameters())


def test_activations_peak_in_backward_for_large_batches():
    factory, make_batch, loss_fn = CASES["gpt"]
    report = memfit.estimate(factory, torch.randint(0, 512, (32, 64)), loss_fn=loss_fn, optimizer="sgd")
    assert report.by_category["activations"] > report.by_category["parameters"]
    assert report.phase_peaks["forward"] <= report.peak_bytes
    assert max(report.step_peaks) == report.peak_bytes
    names = [name for name, _ in report.modules]
    assert "GPT.blocks.0.mlp.0" in names and "GPT.head" in names
    assert all(b > 0 for _, b in report.modules)


def test_every_category_is_one_of_the_vocabulary():
    report, _ = _mlp("adamw")
    assert set(report.by_category) == {c.value for c in Category}


def test_timeline_reaches_the_peak_and_stays_small():
    report, _ = _mlp("adamw", batch_rows=64)
    assert max(b for _, b, _, _ in report.timeline) == report.peak_bytes
    assert len(report.timeline) <= 600
    assert {p for _, _, p, _ in report.timeline} >= {"forward", "backward", "optimizer"}


def test_report_to_dict_is_json_safe():
    import json

    report, _ = _mlp("adamw")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["peak_bytes"] == report.peak_bytes
    assert "peak" in str(report)
