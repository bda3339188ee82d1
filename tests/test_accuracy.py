"""Estimates against the CPU allocator's own events, on every model family of the zoo."""

import pytest

import memfit
from memfit.models.zoo import CASES
from memfit.estimator.truth import true_peak

TOLERANCE = 0.005  # the bar; observed error is under 0.003%


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("name", list(CASES))
def test_estimate_matches_allocator(name, precision, optimizer):
    factory, make_batch, loss_fn = CASES[name]
    batch = make_batch()
    report = memfit.estimate(factory, batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision)
    truth = true_peak(factory, batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision)
    assert report.method == "fake" and report.device == "cpu"
    assert abs(report.peak_bytes - truth) / truth < TOLERANCE, (report.peak_bytes, truth)
    assert report.unprobed_ops == 0
    assert sum(report.by_category.values()) == report.peak_bytes


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16"])
def test_other_precisions_match_allocator(precision):
    factory, make_batch, loss_fn = CASES["gpt"]
    batch = make_batch()
    report = memfit.estimate(factory, batch, loss_fn=loss_fn, precision=precision)
    truth = true_peak(factory, batch, loss_fn=loss_fn, precision=precision)
    assert abs(report.peak_bytes - truth) / truth < TOLERANCE, (report.peak_bytes, truth)


def test_adafactor_matches_allocator_and_notes_scalar_reads():
    factory, make_batch, loss_fn = CASES["hf-llama"]
    batch = make_batch()
    report = memfit.estimate(factory, batch, loss_fn=loss_fn, optimizer="adafactor")
    truth = true_peak(factory, batch, loss_fn=loss_fn, optimizer="adafactor")
    assert abs(report.peak_bytes - truth) / truth < TOLERANCE
    assert any("scalar read" in note for note in report.notes)


def test_measure_agrees_with_estimate_category_by_category():
    factory, make_batch, loss_fn = CASES["cnn"]
    batch = make_batch()
    fake = memfit.estimate(factory, batch, loss_fn=loss_fn)
    real = memfit.measure(factory, batch, loss_fn=loss_fn)
    assert real.method == "measured"
    assert real.peak_bytes == fake.peak_bytes
    assert real.by_category == fake.by_category
    assert real.phase_peaks == fake.phase_peaks
