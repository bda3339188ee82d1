"""``memfit ui`` in a real browser: headless Chromium loads the page, a click on "estimate" shows the
verdict (the one ``memfit.estimate`` gives), the categories and the timeline drawn by plotly in its frame,
the console logs no error, and the screenshot is not blank (with MEMFIT_SCREENSHOT=1 it is written to docs/ui.png,
the README's picture).

Skipped where Chromium, its driver, selenium or Gradio is missing (as tests/test_pictures_browser.py)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import memfit
from memfit.report.pictures import COLOURS
from memfit.report.report import target_line

# found without importing them (Gradio costs ~4 s, and each pytest worker collects every module): memfit.ui.app
# is imported where the page starts
for _name in ("gradio", "plotly"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"no {_name}: pip install 'memfit[ui]'", allow_module_level=True)

from _browser import chromium  # skips without selenium or a headless Chromium  # noqa: E402
from PIL import Image  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from memfit.ui.answers import Answers  # noqa: E402
from test_ui import _free_port  # noqa: E402

SHOT = Path(__file__).resolve().parent.parent / "docs" / "ui.png"


@pytest.fixture(scope="module")
def page():
    from memfit.ui.app import launch

    answers, port = Answers(), _free_port()
    demo = launch("127.0.0.1", port, block=False, answers=answers)
    try:
        yield f"http://127.0.0.1:{port}/", answers
    finally:
        demo.close()
        answers.close()


@pytest.fixture(scope="module")
def browser():
    yield from chromium(1500, 1700)


def _text(driver, css: str) -> str:
    return driver.execute_script(f"const e = document.querySelector({css!r}); return e ? e.innerText : ''")


def test_the_page_answers_in_chromium(browser, page, tmp_path):
    from memfit.ui.app import DEFAULTS

    url, answers = page
    with answers.lock:  # not beside the page's own traces (its warm-up): one trace at a time in a process
        # the defaults of the form: Llama-3.1-8B, batch 8 of 2048 tokens, a plain fp32 step on an RTX 4090
        direct = memfit.estimate(DEFAULTS["model"], recipe=memfit.Recipe(), batch_size=DEFAULTS["batch_size"],
                                 seq_len=DEFAULTS["seq_len"], gpu=DEFAULTS["gpu"])
    browser.get(url)
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#memfit-estimate"))
    browser.find_element(By.CSS_SELECTOR, "#memfit-estimate").click()
    first = lambda d: (_text(d, "#memfit-verdict").strip().splitlines() or [""])[0]  # noqa: E731
    WebDriverWait(browser, 60).until(lambda d: first(d) == target_line(direct),  # not the progress bar's text
                                     message=f"the verdict is not memfit.estimate's: {first(browser)!r}")
    assert _text(browser, "#memfit-error").strip() == ""
    sizes = _text(browser, "#memfit-sizes")
    assert all(name in sizes for name, n in direct.by_category.items() if n)

    frame = WebDriverWait(browser, 30).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#memfit-timeline-frame iframe"))
    browser.execute_script("window.scrollTo(0, 0)")
    outer = browser.execute_script("return arguments[0].getBoundingClientRect().toJSON()", frame[0])
    browser.switch_to.frame(frame[0])
    WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#memfit-timeline .scatterlayer .js-fill').length >= 3"))
    inner = browser.execute_script("return document.querySelector('#memfit-timeline').getBoundingClientRect().toJSON()")
    browser.switch_to.default_content()
    assert inner["height"] > 300 and 0 <= inner["top"] < 100  # the frame opens at the timeline (its #fragment)

    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
    # the README's picture is rewritten only when asked (MEMFIT_SCREENSHOT=1): a test run leaves the tree as it was
    path = SHOT if os.environ.get("MEMFIT_SCREENSHOT") == "1" else tmp_path / "ui.png"
    assert browser.save_screenshot(str(path))
    with Image.open(path) as image:
        shot = image.convert("RGB")
    colours = {colour for _, colour in shot.getcolors(maxcolors=1 << 22)}
    assert len(colours) > 50  # not blank
    # the chart is in the picture, drawn: the largest category's area in its colour, where the frame shows it
    box = (outer["left"] + inner["left"], outer["top"] + inner["top"], outer["left"] + inner["right"],
           min(outer["top"] + inner["bottom"], shot.height))
    largest = max(direct.by_category, key=direct.by_category.get)
    colour = tuple(int(COLOURS[largest][i:i + 2], 16) for i in (1, 3, 5))
    area = dict((c, n) for n, c in shot.crop(tuple(map(int, box))).getcolors(maxcolors=1 << 22)).get(colour, 0)
    assert area > 5000, f"{largest} ({COLOURS[largest]}) covers {area} pixels of the chart's {box}"
