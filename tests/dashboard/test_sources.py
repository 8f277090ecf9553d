"""Reading /metrics directly (with a bounded history) and Prometheus's HTTP API, and the
states the app shows when a source does not answer as it should."""

from __future__ import annotations

import urllib.error

import pytest

from dashboard import sources, text
from dashboard.catalog import APP_SAMPLE_NAMES


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
        ("http://h:8000/", "http://h:8000/metrics"),
        ("https://h/vllm/metrics", "https://h/vllm/metrics"),
    ],
)
def test_metrics_url(given, url):
    assert sources.metrics_url(given) == url
    assert sources.instance_of(url) == url.split("/")[2]


def test_parse_keeps_dashboard_samples_with_their_labels(metrics_text):
    samples = sources.parse_samples(metrics_text)
    names = {name for name, _, _ in samples}
    assert names <= APP_SAMPLE_NAMES
    assert "vllm:kvlens_lookup_tokens_total" in names and "vllm:kvlens_operation_seconds_bucket" in names
    assert not any(n.endswith("_created") for n in names)
    by_key = {(n, labels): v for n, labels, v in samples}
    tier_labels = next(ls for n, ls, _ in samples if n == "vllm:kvlens_tier_used_bytes")
    labels = dict(zip(sources.LABELS, tier_labels, strict=True))
    assert labels["model_name"] == "tiny" and labels["tier"] in ("cpu", "disk")
    assert all(isinstance(v, float) for v in by_key.values())


def test_scrape_states(text_server, metrics_text, closed_port):
    text_server.text = metrics_text
    samples, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.ok and samples

    text_server.text = metrics_text.replace("vllm:kvlens_", "vllm:other_")
    _, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.state == sources.NO_KVLENS

    text_server.text = "this is { not metrics"
    _, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.state == sources.BAD_RESPONSE

    text_server.status = 404
    _, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.state == sources.UNREACHABLE and "404" in status.detail

    _, status = sources.scrape(f"http://127.0.0.1:{closed_port}/metrics")
    assert status.state == sources.UNREACHABLE and "refused" in status.detail.lower()


def test_history_is_bounded_and_shares_scrapes_within_min_interval(metrics_text):
    calls = []

    def fetch(url):
        calls.append(url)
        return metrics_text

    h = sources.MetricsHistory("http://a:1/metrics", max_points=3, min_interval_s=1.0, fetch=fetch)
    for t in (0.0, 0.5, 1.0, 2.0, 3.0, 4.0):
        assert h.scrape(now=t).ok
    assert len(calls) == 5 and len(h) == 3
    f = h.frame()
    assert sorted(f["time"].unique()) == [2.0, 3.0, 4.0]
    assert set(f["instance"]) == {"a:1"} and list(f.columns) == list(sources.COLUMNS)


def scripted(*answers):
    """A fetch that answers each call with the next of ``answers`` (an exception is raised)."""
    left = list(answers)

    def fetch(url):
        a = left.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    return fetch


def test_an_unreachable_endpoint_keeps_its_history(metrics_text):
    h = sources.MetricsHistory(
        "http://a:1/metrics", fetch=scripted(metrics_text, OSError("connection refused"))
    )
    assert h.scrape(now=0).ok
    assert h.scrape(now=5).state == sources.UNREACHABLE
    assert len(h) == 1


def test_matrix_result_becomes_the_long_frame():
    result = [
        {
            "metric": {
                "__name__": "vllm:kvlens_hit_tokens_total",
                "instance": "a:1",
                "tier": "cpu",
                "job": "vllm",
            },
            "values": [[100, "1"], [110, "5"]],
        }
    ]
    f = sources.frame_from_matrix(result)
    assert list(f["value"]) == [1.0, 5.0] and set(f["tier"]) == {"cpu"} and set(f["instance"]) == {"a:1"}
    assert sources.frame_from_matrix([]).empty


def test_names_selector_matches_exact_names():
    assert sources.names_selector(["vllm:b_total", "vllm:a"]) == '{__name__=~"vllm:a|vllm:b_total"}'


def test_prometheus_that_does_not_answer_is_a_failed_query(closed_port, text_server):
    src = sources.PrometheusSource(f"http://127.0.0.1:{closed_port}", timeout=2)
    assert src.frame(5).empty and src.status.state == sources.QUERY_FAILED
    text_server.status = 404  # a server, but no Prometheus API
    src = sources.PrometheusSource(f"http://{text_server.endpoint}", timeout=2)
    assert src.frame(5).empty and src.status.state == sources.QUERY_FAILED


SECRET = "kvlens-canary root:x:0:0:root:/root:/bin/bash"


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "FILE:///etc/passwd", "ftp://h/x", "data:text/plain,hi", "gopher://h:70/"]
)
def test_only_http_and_https_urls_are_accepted(url):
    with pytest.raises(ValueError, match="http"):
        sources.metrics_url(url)
    with pytest.raises(ValueError, match="http"):
        sources.fetch_text(url)
    with pytest.raises(ValueError, match="http"):
        sources.PrometheusSource(url)
    with pytest.raises(ValueError, match="http"):
        sources.MetricsHistory(url)


def test_a_file_url_is_never_read_and_its_content_never_shown(tmp_path, monkeypatch):
    import urllib.request

    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    opened = []
    monkeypatch.setattr(urllib.request.FileHandler, "file_open", lambda self, req: opened.append(req))
    samples, status = sources.scrape(f"file://{secret}")
    assert not samples and not status.ok and not opened
    assert "root:" not in status.detail and "canary" not in status.detail


def test_a_failed_scrape_names_the_status_not_the_body(text_server):
    text_server.status, text_server.reason, text_server.text = 500, SECRET, SECRET
    _, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.state == sources.UNREACHABLE and status.detail == "HTTP 500 Internal Server Error"


def test_a_page_that_is_not_metrics_is_not_quoted(text_server):
    text_server.text = SECRET + "\n"
    _, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.state == sources.BAD_RESPONSE
    assert "root:" not in status.detail and "canary" not in status.detail


def test_a_server_that_does_not_speak_http_is_named_by_the_error_class_only(raw_server):
    raw_server.reply = (SECRET + "\r\n").encode()
    _, status = sources.scrape(f"http://127.0.0.1:{raw_server.port}/metrics")
    assert status.state == sources.UNREACHABLE and status.detail == "BadStatusLine"


def test_a_redirect_to_another_scheme_is_not_followed(text_server, raw_server):
    text_server.status = 302
    text_server.headers = {"Location": f"ftp://127.0.0.1:{raw_server.port}/metrics"}
    _, status = sources.scrape(sources.metrics_url(text_server.endpoint))
    assert status.state == sources.UNREACHABLE and raw_server.accepted == 0


def test_a_failed_prometheus_query_names_the_status_not_the_body(text_server):
    text_server.status, text_server.text = 500, SECRET
    src = sources.PrometheusSource(f"http://{text_server.endpoint}", timeout=2)
    assert src.frame(5).empty and src.status.state == sources.QUERY_FAILED
    assert "root:" not in src.status.detail and "canary" not in src.status.detail
    assert "500" in src.status.detail


@pytest.mark.parametrize(
    "error", [TimeoutError("timed out"), urllib.error.URLError(TimeoutError("timed out"))]
)
def test_an_endpoint_that_answers_slowly_is_a_warning_not_unreachable_and_keeps_its_history(
    metrics_text, error
):
    """A loaded vLLM may miss one scrape's deadline: that is not 'Is vLLM running there?'."""
    h = sources.MetricsHistory("http://a:1/metrics", fetch=scripted(metrics_text, error, metrics_text))
    assert h.scrape(now=0).ok
    slow = h.scrape(now=5)
    assert slow.state == sources.SLOW and len(h) == 1
    level, message = text.status_message(slow)
    assert level == text.WARNING and "did not answer in time" in message and "running" not in message
    assert h.scrape(now=10).ok and len(h) == 2
