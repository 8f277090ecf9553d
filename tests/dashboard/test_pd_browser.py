"""The PD tab as a person sees it, in headless Chromium: the app served by ``streamlit run``
against a prefiller, a decoder and a PD proxy serving the canned PD series and request records
(no vLLM needed). Each phase is drawn in its palette colour in every chart that shows it, and
the tab draws without an error (a screenshot is kept under .run/artifacts/)."""

from __future__ import annotations

import shutil

import pytest

from dashboard import palette, pd_records
from tests.telemetry.serve import REPO, free_port, wait_until

from .browser import (
    assert_no_exception,
    charts_drawn,
    chromium,
    healthy,
    legend_colours,
    open_tab,
    streamlit_server,
    tab_names,
)
from .conftest import DATA, TextServer

pytestmark = pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")), reason="needs chromium and chromedriver"
)
ARTIFACTS = REPO / ".run" / "artifacts"


def test_the_pd_tab_in_headless_chromium(tmp_path):
    prefiller = TextServer((DATA / "metrics-pd-prefiller.txt").read_text())
    decoder = TextServer((DATA / "metrics-pd-decoder.txt").read_text())
    proxy = TextServer()
    proxy.paths["/metrics"] = (DATA / "metrics-pd-proxy.txt").read_text()
    proxy.paths[pd_records.PATH] = (DATA / "pd-requests.json").read_text()
    port = free_port()
    args = ("--metrics", prefiller.endpoint, "--metrics", decoder.endpoint, "--pd-proxy", proxy.endpoint)
    proc = streamlit_server(port, tmp_path / "streamlit.log", *args, "--refresh", "2")
    driver = None
    try:
        wait_until(lambda: healthy(port), 60, what="streamlit health")
        driver = chromium()
        driver.get(f"http://127.0.0.1:{port}")
        wait_until(lambda: "PD" in tab_names(driver), 60, 0.5, "the tabs")
        open_tab(driver, tab_names(driver).index("PD"))
        # the pairs' split, the request's split, bytes, buffer, in flight, timeouts, refusals
        wait_until(lambda: charts_drawn(driver) >= 6, 60, 0.5, "the PD tab's charts")
        wait_until(lambda: "pd-3: time to first token" in driver.page_source, 30, 0.5, "a request's split")
        colours = wait_until(
            lambda: [c for c in legend_colours(driver, "PD") if c[1] in palette.PHASES], 30, 0.5, "legends"
        )
        assert_no_exception(driver)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard-pd.png"))
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(timeout=30)
        for s in (prefiller, decoder, proxy):
            s.close()
    assert {name for _, name, _ in colours} == set(palette.PHASES)
    assert all(drawn == palette.PHASES[name] for _, name, drawn in colours), colours
    assert len({chart for chart, _, _ in colours}) >= 2  # the pairs' bars and the request's bar
