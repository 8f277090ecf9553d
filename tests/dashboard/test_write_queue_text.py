"""Both dashboards describe the background write queue by its real limit: bytes, per
background tier (disk and remote), set by extra_config.max_pending_write_bytes."""

from __future__ import annotations

from connector.config.loading import ExtraConfig

from .promql import dashboard_panels

DEFAULT_MIB = ExtraConfig.model_fields["max_pending_write_bytes"].default / 2**20


def assert_names_the_real_limit(text: str) -> None:
    assert "extra_config.max_pending_write_bytes" in text, text
    assert f"default {DEFAULT_MIB:g} MiB" in text, text
    assert "disk" in text and "remote" in text, text
    assert "at most 64" not in text, text


def test_the_grafana_panel_names_the_setting_that_bounds_the_queue():
    (panel,) = [p for p in dashboard_panels() if p["title"] == "Background write queue"]
    assert_names_the_real_limit(panel["description"])


def test_the_app_names_the_setting_that_bounds_the_queue(app, monkeypatch, text_server, metrics_text):
    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    app.session_state["section"] = "Latency and throughput"  # the tab that shows the queue
    app.run()
    assert not app.exception
    (caption,) = [c.value for c in app.caption if "queued" in c.value]
    assert_names_the_real_limit(caption)
