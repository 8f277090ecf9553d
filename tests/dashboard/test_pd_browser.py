"""The app as a person sees it, in headless Chromium: the app served by ``streamlit run`` against a
prefiller, a decoder and a PD proxy serving the canned PD series and request records (no vLLM
needed). The tabs stay clickable while the page refreshes (a click is never dropped); the
Overview draws what the decoder received as a source in its own colour; the PD tab draws each
phase in its palette colour in every chart that shows it, names each engine by its role, and
draws without an error (a screenshot is kept under .run/artifacts/). Waits are bounded by the
app's refreshes, not by seconds: a loaded machine makes them longer, never failing."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from dashboard import palette, pd_records
from tests.telemetry.serve import REPO, free_port, wait_until

from .browser import (
    assert_no_exception,
    charts_drawn,
    chromium,
    healthy,
    legend_colours,
    panel_text,
    show_tab,
    streamlit_server,
    tab_names,
    times_tabs_disabled,
    updated_stamp,
    wait_for,
    wait_for_refreshes,
    watch_tabs,
)
from .conftest import DATA, TextServer

pytestmark = pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")), reason="needs chromium and chromedriver"
)
ARTIFACTS = REPO / ".run" / "artifacts"
REFRESH_S = 1


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The app on the canned PD pair and proxy, open in Chromium on its first tab."""
    prefiller = TextServer((DATA / "metrics-pd-prefiller.txt").read_text())
    decoder = TextServer((DATA / "metrics-pd-decoder.txt").read_text())
    proxy = TextServer()
    proxy.paths["/metrics"] = (DATA / "metrics-pd-proxy.txt").read_text()
    proxy.paths[pd_records.PATH] = (DATA / "pd-requests.json").read_text()
    port = free_port()
    args = ("--metrics", prefiller.endpoint, "--metrics", decoder.endpoint, "--pd-proxy", proxy.endpoint)
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    proc = streamlit_server(port, log, *args, "--refresh", str(REFRESH_S))
    driver = None
    try:
        wait_until(lambda: healthy(port), 60, what="streamlit health")  # start-up, before any refresh
        driver = chromium()
        driver.get(f"http://127.0.0.1:{port}")
        wait_until(lambda: "PD" in tab_names(driver) and updated_stamp(driver), 120, 0.5, "the first tab")
        yield SimpleNamespace(driver=driver, prefiller=prefiller, decoder=decoder, proxy=proxy)
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(timeout=30)
        for s in (prefiller, decoder, proxy):
            s.close()


def test_a_refresh_never_disables_the_tabs_so_every_click_lands(page):
    """Streamlit disables a stale tab until the browser has drawn it again. When the refresh sent
    the tabs again, each refresh disabled them for a moment, long on a loaded machine, and a
    click then was dropped (the PD tab's note never came). Counted with a MutationObserver, so
    the briefest moment counts: none, over several refreshes and tab changes."""
    driver = page.driver
    watch_tabs(driver)
    wait_for_refreshes(driver, 3)
    disabled_by_refreshes = times_tabs_disabled(driver, reset=True)
    for name, shows in (
        ("Hits and misses", "Misses by reason"),
        ("Requests", "Request log not enabled"),
        ("PD", "Time to first token, split"),
        ("Overview", "Where prompt tokens came from"),
    ):
        show_tab(driver, name, shows)
        times_tabs_disabled(driver, reset=True)  # the click's own rerun (see times_tabs_disabled)
        wait_for_refreshes(driver, 2)
        disabled_by_refreshes += times_tabs_disabled(driver)
    assert disabled_by_refreshes == 0
    assert_no_exception(driver)


def test_the_overview_draws_what_the_decoder_received_as_a_source_in_its_colour(page):
    driver = page.driver
    show_tab(driver, "Overview", "Where prompt tokens came from")
    received = wait_for(
        driver,
        lambda: [c for c in legend_colours(driver, "Overview") if c[1] == palette.PD_RECEIVED],
        "the PD source in a legend",
    )
    assert {drawn for _, _, drawn in received} == {palette.SOURCES[palette.PD_RECEIVED]}
    assert palette.PD_RECEIVED in panel_text(driver)  # the caption says what it is
    assert_no_exception(driver)


def test_the_pd_tab_in_headless_chromium(page):
    driver = page.driver
    show_tab(driver, "PD", "Time to first token, split")
    # the pairs' split, the request's split, bytes, buffer, in flight, timeouts, refusals
    wait_for(driver, lambda: charts_drawn(driver) >= 6, "the PD tab's charts")
    wait_for(driver, lambda: "pd-3: time to first token" in panel_text(driver), "a request's split")
    colours = wait_for(
        driver, lambda: [c for c in legend_colours(driver, "PD") if c[1] in palette.PHASES], "the legends"
    )
    assert_no_exception(driver)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard-pd.png"))
    assert {name for _, name, _ in colours} == set(palette.PHASES)
    assert all(drawn == palette.PHASES[name] for _, name, drawn in colours), colours
    assert len({chart for chart, _, _ in colours}) >= 2  # the pairs' bars and the request's bar
    named = {name for _, name, _ in legend_colours(driver, "PD")}
    sides = {f"prefiller {page.prefiller.endpoint} sent", f"decoder {page.decoder.endpoint} received"}
    assert sides <= named, named  # each engine named by its role, on its side only
    assert not any(
        n.endswith((f"{page.decoder.endpoint} sent", f"{page.prefiller.endpoint} received")) for n in named
    )
