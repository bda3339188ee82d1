"""Pictures of a Report: the HTML page (plotly) and the PNG (matplotlib), from an estimate of the tiny
Llama and from hand-made profiles; the step-and-phase alignment of two runs; ``memfit estimate --html --png``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("plotly", reason="pip install 'memfit[pictures]'")
pytest.importorskip("matplotlib", reason="pip install 'memfit[pictures]'")

from PIL import Image  # noqa: E402  (after the skips)

from memfit.categories import Category  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.report import _timeline, pictures  # noqa: E402
from memfit.report.pictures import COLOURS, write_html, write_png  # noqa: E402
from memfit.report.report import Report  # noqa: E402

TINY = str(Path(__file__).resolve().parent.parent / "examples" / "tiny-llama" / "config.json")
MiB = 2**20


def profile(points_per_phase: int = 6, *, stacked: bool = True) -> Report:
    """A hand-made measured report of 2 steps: stacked categories, reserved bytes, allocations, a leak."""
    events, phases, steps, cats = [], [], [], {"parameters": [], "gradients": [], "activations": []}
    event = 0
    for step in (0, 1):
        for phase, acts, grads in (("forward", 1, 0), ("backward", 2, 1), ("optimizer", 0, 1)):
            for i in range(points_per_phase):
                events.append(event)
                phases.append(phase)
                steps.append(step)
                cats["parameters"].append(100 * MiB)
                cats["gradients"].append(grads * 100 * MiB)
                cats["activations"].append(acts * (i + 1) * 10 * MiB)
                event += 7
    totals = [sum(col) for col in zip(*cats.values())]
    at = max(range(len(totals)), key=totals.__getitem__)
    frames = ["train.py:41 in step", "torch/nn/modules/module.py:1773 in _call_impl", "train.py:12 in <module>"]
    return Report(
        peak_bytes=totals[at], by_category={c: v[at] for c, v in cats.items()},
        phase_peaks={"forward": 160 * MiB, "backward": totals[at], "optimizer": 200 * MiB},
        step_peaks=[totals[at], totals[at]],
        modules=[(f"model.layers.{i}.self_attn.q_proj", (30 - i) * MiB) for i in range(20)],
        timeline=list(zip(events, totals, phases, steps)), device="cuda", method="measured",
        modelled_bytes=0, unprobed_ops=0, parameters=25_000_000, trainable=25_000_000,
        notes=["a hand-made profile"], stacked={"event": events, "phase": phases, "step": steps,
                                                "by_category": cats} if stacked else None,
        top_allocations=[{"bytes": 64 * MiB, "category": "activations", "module": "model.layers.3.mlp",
                          "site": "train.py:41", "stack": frames},
                         {"bytes": 32 * MiB, "category": "gradients", "module": "model.lm_head",
                          "site": "model.py:88", "stack": ["model.py:88 in forward"]}],
        leaks=[{"site": "train.py:57", "bytes_per_step": 4 * MiB, "steps": 1, "category": "temporaries",
                "stack": ["train.py:57 in log", "train.py:12 in <module>"]}],
        reserved={"event": events, "bytes": [t + 40 * MiB for t in totals]},
    )


@pytest.fixture(scope="module")
def tiny():
    import memfit

    return memfit.estimate(TINY, batch_size=1, seq_len=32)


def _traces(html: str) -> list[str]:
    return re.findall(r'"name":"([^"]*)"', html)


def test_every_category_has_its_own_colour():
    assert set(COLOURS) == {c.value for c in Category}
    assert len(set(COLOURS.values())) == len(COLOURS)


def test_html_of_an_estimate(tiny, tmp_path):
    path = write_html(tiny, tmp_path / "tiny.html")
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>") and 'class="plotly-graph-div"' in html
    assert 'id="memfit-timeline"' in html and 'id="memfit-modules"' in html
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js inlined: opens with no network
    names = _traces(html)
    for name, nbytes in tiny.by_category.items():
        if nbytes:
            assert name in names and f"</span>{name}</td>" in html  # a trace and a row of the table
    assert tiny._headline()[0] in html
    assert "estimate total" not in html  # no estimate given


def test_html_of_a_profile_has_its_tables_and_reserved(tmp_path):
    report = profile()
    html = write_html(report, tmp_path / "p.html", title="my profile").read_text()
    for allocation in report.top_allocations:
        assert allocation["site"] in html
    assert "<details><summary>train.py:41 in step</summary>" in html  # the stack, innermost first
    assert "train.py:57" in html and "4.00 MiB" in html  # the leak
    assert "reserved (allocator)" in _traces(html)
    assert "<title>my profile</title>" in html and "a hand-made profile" in html
    assert html.count("model.layers.") >= pictures.TOP_MODULES  # the bars: top 15 of 20
    assert "model.layers.19." not in html


def test_estimate_over_the_measurement(tiny, tmp_path):
    html = write_html(profile(), tmp_path / "both.html", estimate=tiny).read_text()
    assert "estimate total (fake)" in _traces(html)
    assert "align by step and phase" in html


def test_alignment_puts_each_phase_of_both_runs_in_the_same_stretch():
    """Two runs with different event counts: every point lands in [step, step+1), inside its phase's band."""
    short, long = profile(3), profile(11)
    plot = _timeline.timeline(short, long)
    bands = {(round(x0, 9), phase) for x0, _, phase in plot.bands}
    assert len(bands) == 6  # 2 steps x 3 phases, shared by both runs
    for xs, report in ((plot.x, short), (plot.estimate[0], long)):
        for x, (_, _, phase, step) in zip(xs, report.timeline):
            band = [b for b in plot.bands if b[0] <= x < b[1] + 1e-9 and b[2] == phase]
            assert band and step <= x <= step + 1
    assert plot.estimate[0][0] == plot.x[0] == 0.0


def test_a_phase_run_twice_in_a_step_is_two_segments():
    """Accumulation: forward, backward, forward, backward, optimizer in one step; x keeps the order of time."""
    phases = ["forward"] * 3 + ["backward"] * 3 + ["forward"] * 3 + ["backward"] * 3 + ["optimizer"] * 3
    rows = [(i, 1000 + i, phase, 0) for i, phase in enumerate(phases)]
    report = replace(profile(), stacked=None, timeline=rows, reserved=None)
    plot = _timeline.timeline(report)
    assert plot.x == sorted(plot.x) and len(plot.bands) == 5 and 0 <= plot.x[0] < plot.x[-1] < 1


def test_an_empty_report_still_draws(tmp_path):
    report = replace(profile(), stacked=None, timeline=[], reserved=None, modules=[], top_allocations=None,
                     leaks=None)
    assert "plotly-graph-div" in write_html(report, tmp_path / "e.html").read_text()
    assert Image.open(write_png(report, tmp_path / "e.png")).size == (1600, 900)


def test_a_report_without_stacked_draws_its_timeline(tmp_path):
    report = profile(stacked=False)
    html = write_html(report, tmp_path / "t.html").read_text()
    assert "live (total)" in _traces(html) and "activations" not in _traces(html)
    png = write_png(report, tmp_path / "t.png")
    assert Image.open(png).size == (1600, 900)


def _colours(path) -> int:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return len(image.convert("RGB").getcolors(maxcolors=1 << 20) or ())


def test_png_is_1600x900_and_drawn(tiny, tmp_path):
    path = write_png(profile(), tmp_path / "p.png", estimate=tiny, title="a profile")
    with Image.open(path) as image:
        assert image.size == (1600, 900)
        rgb = image.convert("RGB")
        wanted = {tuple(int(COLOURS[c][i:i + 2], 16) for i in (1, 3, 5)) for c in ("parameters", "activations")}
        seen = {colour for _, colour in rgb.getcolors(maxcolors=1 << 20)}
        assert wanted <= seen  # the categories' own colours, filled
    assert _colours(path) > 50


def test_cli_writes_both(tmp_path, capsys):
    html, png = tmp_path / "e.html", tmp_path / "e.png"
    assert main(["estimate", TINY, "--seq-len", "32", "--json", "--html", str(html), "--png", str(png)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["peak_bytes"] > 0  # stdout stays pure JSON
    assert f"wrote {html}" in out.err and f"wrote {png}" in out.err
    assert html.stat().st_size > 1_000_000 and Image.open(png).size == (1600, 900)


def test_cli_refuses_a_folder_that_does_not_exist_before_estimating(tmp_path, capsys, monkeypatch):
    import memfit.estimator.estimate as estimator

    monkeypatch.setattr(estimator, "estimate", lambda *a, **k: pytest.fail("estimated before checking --html"))
    assert main(["estimate", TINY, "--html", str(tmp_path / "no" / "e.html")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err


def test_missing_libraries_name_the_install(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def without_plotly(name, *args, **kwargs):
        if name.startswith("plotly"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_plotly)
    from memfit.errors import MemfitError

    with pytest.raises(MemfitError, match=r"pip install 'memfit\[pictures\]'"):
        write_html(replace(profile(), stacked=None), tmp_path / "x.html")


def test_the_cli_asks_for_the_libraries_before_estimating(monkeypatch, tmp_path, capsys):
    import importlib.util

    import memfit.estimator.estimate as estimator

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(estimator, "estimate", lambda *a, **k: pytest.fail("estimated without the libraries"))
    assert main(["estimate", TINY, "--png", str(tmp_path / "e.png")]) == 2
    assert "pip install 'memfit[pictures]'" in capsys.readouterr().err
