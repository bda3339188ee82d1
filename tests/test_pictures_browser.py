"""The HTML page in a real browser: headless Chromium opens it with no network, logs no error, and
plotly draws the timeline (its stacked areas, the estimate, reserved and the peak) and the module bars.

Skipped where Chromium, its driver or selenium is missing (``.ci/run`` installs Chromium when it can)."""

from __future__ import annotations

import pytest

from test_pictures import COLOURS, profile, write_html  # the hand-made profile; skips without plotly

from _browser import chromium  # skips without selenium or a headless Chromium  # noqa: E402
from PIL import Image  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    yield from chromium(1400, 1400)


def test_the_page_renders_in_chromium(browser, tmp_path):
    path = write_html(profile(), tmp_path / "profile.html", estimate=profile(3))
    browser.get(path.resolve().as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#memfit-modules .main-svg').length > 0"))
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
    traces = browser.execute_script(
        "return Array.from(document.querySelectorAll('.js-plotly-plot'), d => d._fullData.map(t => t.name))")
    # 3 categories stacked, the estimate, reserved and the peak; then the module bars
    assert traces[0][:3] == ["parameters", "gradients", "activations"]
    assert len(traces[0]) == 6 and "reserved (allocator)" in traces[0]
    assert any(name.startswith("estimate total") for name in traces[0]) and len(traces[1]) == 1
    fills = browser.execute_script("return document.querySelectorAll('#memfit-timeline .scatterlayer .js-fill')"
                                   ".length")
    assert fills >= 3  # one filled area per category
    shot = tmp_path / "shot.png"
    assert browser.save_screenshot(str(shot))
    with Image.open(shot) as image:
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 22)}
    assert len(colours) > 50  # not blank
    assert tuple(int(COLOURS["parameters"][i:i + 2], 16) for i in (1, 3, 5)) in colours
