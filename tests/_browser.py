"""Headless Chromium for the browser tests (test_pictures_browser.py, test_ui_browser.py): found or skipped with
the reason, and one driver a module with its console log kept."""

from __future__ import annotations

import shutil

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="no selenium: pip install selenium (or 'memfit[dev]')")
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("no headless Chromium: apt-get install chromium chromium-driver (and pip install selenium)",
                allow_module_level=True)


def chromium(width: int, height: int):
    """A generator fixture's body: a headless Chromium of ``width`` x ``height``, quit afterwards."""
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
