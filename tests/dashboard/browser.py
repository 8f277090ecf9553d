"""The Streamlit app as a person sees it, in headless Chromium (Selenium and chromium-driver):
the server, the browser, and what the tests read off the page: tabs, the refresh stamp,
each chart's legend colours, and how much of the page is greyed out as stale over time.

The app reruns every few seconds and Streamlit replaces elements as it does, so an element
found by one WebDriver call can be gone by the next: the page is read, and tabs are clicked,
inside the page, in one script each. Waits for what the app shows are bounded by its refreshes
(``wait_for``), not by seconds: on a loaded machine a refresh takes longer, and so may a wait."""

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


# The open tab's panel: Streamlit keeps every panel in the page and hides the closed ones, which
# hold what they showed until the next run clears them.
_PANEL = "[...document.querySelectorAll('[data-testid=\"stTabPanel\"]')].find(p => p.getClientRects().length)"
_TABS = '[data-testid="stTabs"] [role="tab"]'


def charts_drawn(driver) -> int:
    """Charts drawn in the open tab's panel."""
    return driver.execute_script(
        f"const p = {_PANEL}; return p ? p.querySelectorAll("
        "'[data-testid=\"stVegaLiteChart\"] :is(svg, canvas)').length : 0;"
    )


def panel_text(driver) -> str:
    """What the open tab's panel says."""
    return driver.execute_script(f"const p = {_PANEL}; return p ? p.innerText : '';")


def panel_html(driver) -> str:
    """The open tab's panel as HTML: what its tables hold too (a table draws its cells on a
    canvas, not as text)."""
    return driver.execute_script(f"const p = {_PANEL}; return p ? p.innerHTML : '';")


def updated_stamp(driver) -> str:
    """The "Updated HH:MM:SS" line (the open tab's, where it has one): it changes each time a
    refresh ends."""
    return driver.execute_script(
        f"const stamp = root => root && [...root.querySelectorAll('p, span, div')].find("
        "e => e.children.length === 0 && e.innerText.trim().startsWith('Updated '));"
        f" const it = stamp({_PANEL}) || stamp(document.querySelector('[data-testid=\"stMain\"]'));"
        " return it ? it.innerText.trim() : '';"
    )


def tab_names(driver) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('{_TABS}')].map(t => t.innerText.trim());"
    )


def selected_tab(driver) -> str:
    return driver.execute_script(
        f"const t = [...document.querySelectorAll('{_TABS}')].find("
        "t => t.getAttribute('aria-selected') === 'true'); return t ? t.innerText.trim() : '';"
    )


def open_tab(driver, index: int) -> None:
    driver.execute_script(f"document.querySelectorAll('{_TABS}')[{index}].click();")


def wait_for(driver, predicate, what: str, refreshes: int = 3, ceiling_s: float = 300.0):
    """Waits until ``predicate()`` is true, bounded by the app's progress, not by a fixed time:
    it fails once the open tab has refreshed ``refreshes`` times without it (on a loaded machine
    refreshes take longer, and so may this). ``ceiling_s`` only ends a wait on an app that has
    stopped refreshing."""
    seen = {updated_stamp(driver)}
    deadline = time.monotonic() + ceiling_s
    while True:
        got = predicate()
        if got:
            return got
        seen.add(updated_stamp(driver))
        if len(seen - {""}) > refreshes:
            raise AssertionError(f"{what}: not shown after {refreshes} refreshes of the tab")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: the app did not refresh for {ceiling_s:.0f} s")
        time.sleep(0.2)


def wait_for_refreshes(driver, times: int = 1) -> None:
    """Waits until the open tab has refreshed ``times`` more times."""
    stamps = {updated_stamp(driver)}
    wait_for(driver, lambda: stamps.add(updated_stamp(driver)) or len(stamps) > times, "refreshes", times + 3)


def show_tab(driver, name: str, shows: str, refreshes: int = 3) -> None:
    """A person's click on the tab ``name``: the tab is selected at once (a click on a disabled
    tab is dropped: a defect, not a reason to click again), and its panel shows ``shows`` within
    ``refreshes`` refreshes."""
    open_tab(driver, tab_names(driver).index(name))
    assert selected_tab(driver) == name, f"the click on {name!r} was dropped (tabs: {tabs_state(driver)})"
    wait_for(driver, lambda: shows in panel_text(driver), f"{name}: {shows!r}", refreshes)


def tabs_state(driver) -> str:
    """One letter per tab: S selected, D disabled, . clickable."""
    return driver.execute_script(
        f"return [...document.querySelectorAll('{_TABS}')].map(t => t.getAttribute('aria-selected') "
        "=== 'true' ? 'S' : (t.getAttribute('aria-disabled') === 'true' || t.hasAttribute('data-disabled'))"
        " ? 'D' : '.').join('');"
    )


# Counts every moment a tab turns disabled (Streamlit disables a tab while it is stale), however
# brief: a MutationObserver sees each change, where sampling would miss most.
_WATCH_TABS = """
window.__kvlensTabsDisabled = 0;
new MutationObserver(changes => changes.forEach(c => {
  const t = c.target;
  if (t.getAttribute('role') === 'tab'
      && (t.getAttribute('aria-disabled') === 'true' || t.hasAttribute('data-disabled'))) {
    window.__kvlensTabsDisabled++;
  }
})).observe(document.body,
  {attributes: true, subtree: true, attributeFilter: ['aria-disabled', 'data-disabled']});
"""


def watch_tabs(driver) -> None:
    driver.execute_script(_WATCH_TABS)


def times_tabs_disabled(driver, reset: bool = False) -> int:
    """How many times a tab turned disabled since ``watch_tabs`` (or the last ``reset``).

    A click on a tab reruns the whole page, and Streamlit disables the stale tabs until that
    rerun has sent them again: that is the click landing, and on a loaded machine it shows. What
    must never happen is a tab disabled by a refresh alone (a click then would be dropped), so the
    count is taken over spans without a click: reset once a tab's content shows (the rerun has
    sent the tabs again by then: they come first), read after refreshes."""
    return driver.execute_script(
        "const n = window.__kvlensTabsDisabled; if (arguments[0]) window.__kvlensTabsDisabled = 0; return n;",
        reset,
    )


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
