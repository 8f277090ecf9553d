"""``--metrics`` takes what its help says, and only that: host[:port][/path] read over http://,
or an http(s) URL; /metrics when no path is given."""

from __future__ import annotations

import pytest

from dashboard import settings, sources


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("10.0.0.1", "http://10.0.0.1/metrics"),
        ("10.0.0.1:8000", "http://10.0.0.1:8000/metrics"),
        ("[::1]:8000", "http://[::1]:8000/metrics"),
        ("h:8000/vllm/metrics", "http://h:8000/vllm/metrics"),
        ("http://h:8000/", "http://h:8000/metrics"),
        ("https://h/vllm/metrics", "https://h/vllm/metrics"),
    ],
)
def test_each_form_the_help_names_is_read_where_it_says(given, read):
    (endpoint,) = settings.parse(["--metrics", given], {}).endpoints
    assert sources.metrics_url(endpoint) == read


def test_the_help_says_host_port_and_http_urls_are_taken_and_no_other_scheme():
    text = " ".join(settings.parser().format_help().split())
    assert "host, host:port or host:port/path (read over http://), or an http:// or https:// URL" in text
    assert "without a path its /metrics is read" in text and "comma-separated" in text
    for other in ("ftp://h/metrics", "file:///etc/passwd"):
        with pytest.raises(ValueError, match="--metrics"):
            settings.parse(["--metrics", other], {})
