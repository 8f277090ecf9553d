"""The Streamlit app as a person sees it, in headless Chromium (Selenium and chromium-driver):
the server, the browser, and what the tests read off the page: tabs, the refresh stamp,
each chart's legend colours, and how much of the page is greyed out as stale over time.

The app reruns every few seconds and Streamlit replaces elements as it does, so an element
found by one WebDriver call can be gone by the next: the page is read, and tabs are clicked,
inside the page, in one script each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.telemetry.serve import REPO


def streamlit_server(port: int, log: Path, *app_args: str, root: Path = REPO) -> subprocess.Popen:
    """``streamlit run dashboard/app.py -- APP_ARGS`` from ``root`` (the repository: its config
    binds 127.0.0.1)."""
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        "dashboard/app.py",
        "--server.headless=true",
        f"--server.port={port}",  # no --server.address: the repository's config binds 127.0.0.1
        "--browser.gatherUsageStats=false",
        "--",
        *app_args,
    ]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


def chromium(width: int = 1500, height: int = 1250):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    service = Service(shutil.which("chromedriver") or "/usr/bin/chromedriver")
    return webdriver.Chrome(service=service, options=options)


def charts_drawn(driver) -> int:
    """Charts drawn in the open tab (only its panel is in the page)."""
    from selenium.webdriver.common.by import By

    drawn = '[data-testid="stTabPanel"] [data-testid="stVegaLiteChart"] :is(svg, canvas)'
    return len(driver.find_elements(By.CSS_SELECTOR, drawn))


_TABS = '[data-testid="stTabs"] [role="tab"]'


def updated_stamp(driver) -> str:
    return driver.execute_script(
        "const it = document.evaluate(\"//*[starts-with(normalize-space(text()), 'Updated ')]\","
        " document, null, XPathResult.FIRST_ORDERED_NODE_TYPE, null).singleNodeValue;"
        " return it ? it.innerText : '';"
    )


def tab_names(driver) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('{_TABS}')].map(t => t.innerText.trim());"
    )


def open_tab(driver, index: int) -> None:
    driver.execute_script(f"document.querySelectorAll('{_TABS}')[{index}].click();")


def assert_no_exception(driver) -> None:
    from selenium.webdriver.common.by import By

    text = driver.execute_script("return document.body.innerText;")
    assert "Traceback" not in text and "could not be shown" not in text, text[:2000]
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stAlertContentError"]'), text[:2000]


# ---- colours ---------------------------------------------------------------------------------
# Each drawn chart's legend, as Vega renders it in SVG: per entry, the label's text and the
# symbol's fill (areas, points) or stroke (lines). Labels Vega shortened ("…") are left out.
_LEGENDS = """
const out = [];
const shown = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')]
  .filter(c => c.getClientRects().length);
shown.forEach((chart, index) => {
  chart.querySelectorAll('.role-legend').forEach(legend => {
    const labels = [...legend.querySelectorAll('.role-legend-label text')];
    const symbols = [...legend.querySelectorAll('.role-legend-symbol path')];
    labels.forEach((label, i) => {
      const symbol = symbols[i];
      if (!symbol || labels.length !== symbols.length) return;
      const paint = a => {
        const v = symbol.getAttribute(a);
        return v && v !== 'none' && v !== 'transparent' ? v : '';
      };
      out.push([index, label.textContent, paint('fill') || paint('stroke')]);
    });
  });
});
return out;
"""


def normal_colour(css: str) -> str:
    """'#4c78a8', '#4C78A8' or 'rgb(76, 120, 168)' -> '#4C78A8'."""
    css = css.strip()
    rgb = re.fullmatch(r"rgba?\((\d+),\s*(\d+),\s*(\d+).*\)", css)
    if rgb:
        return "#" + "".join(f"{int(c):02X}" for c in rgb.groups())
    return css.upper()


def legend_colours(driver, where: str) -> list[tuple[str, str, str]]:
    """(chart, series name, colour) for every legend entry drawn now; ``chart`` names the tab
    and the chart's position in it."""
    return [
        (f"{where} #{index}", name, normal_colour(paint))
        for index, name, paint in driver.execute_script(_LEGENDS)
        if paint and not name.endswith("…")
    ]


# ---- stale -----------------------------------------------------------------------------------
# The main area's elements, and those Streamlit marks stale (data-stale, from the moment a rerun
# starts until it sends the element again) and those a person sees greyed out (Streamlit fades a
# stale element after 0.5 s: its opacity, or an enclosing block's, drops below 1).
_STALE = """
const all = [...document.querySelectorAll('[data-testid="stMain"] [data-testid="stElementContainer"]')];
const shown = all.filter(e => e.offsetParent !== null);
const stale = shown.filter(e => e.getAttribute('data-stale') === 'true').length;
const opacity = e => {
  let o = 1;
  for (let n = e; n && n !== document.body; n = n.parentElement) o *= parseFloat(getComputedStyle(n).opacity);
  return o;
};
const faded = shown.filter(e => opacity(e) < 0.9).length;
return [shown.length, stale, faded];
"""


@dataclass(frozen=True, slots=True)
class Staleness:
    samples: int
    stale_share: float  # mean share of the main area's elements marked stale
    faded_share: float  # mean share greyed out (faded), as a person sees it
    mostly_faded_share: float  # share of the time at least half of the main area is greyed out

    def __str__(self) -> str:
        return (
            f"{self.samples} samples: {self.stale_share:.1%} of elements marked stale, "
            f"{self.faded_share:.1%} greyed out, half the page or more greyed out "
            f"{self.mostly_faded_share:.1%} of the time"
        )


def staleness(driver, seconds: float = 30.0, every_s: float = 0.2) -> Staleness:
    """Samples the page every ``every_s`` for ``seconds``: how much of it is stale, on average."""
    stale, faded, mostly, n = 0.0, 0.0, 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        shown, s, f = driver.execute_script(_STALE)
        if shown:
            n += 1
            stale += s / shown
            faded += f / shown
            mostly += f / shown >= 0.5
        time.sleep(every_s)
    assert n, "no element in the page's main area"
    return Staleness(n, stale / n, faded / n, mostly / n)
