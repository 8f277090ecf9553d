"""The only URLs the dashboard reads: http and https, checked before anything is fetched.

``urllib`` would also open ``file://``, ``ftp://`` and ``data:`` URLs, so a source typed in
the page could read files on the server; every URL the app fetches passes ``http_url`` first,
and ``OPENER`` has no handler for any other scheme, redirects included.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import SplitResult, urlsplit

SCHEMES = ("http", "https")


class NotHttpURL(ValueError):
    """A source that is not an http(s) URL: refused before anything is read."""


def http_url(raw: str) -> str:
    """``host:port`` or an http(s) URL -> the URL; anything else raises ``NotHttpURL``."""
    url = raw.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme.lower() not in SCHEMES or not parts.hostname or not _numeric_port(parts):
        raise NotHttpURL(f"{raw.strip()}: only http:// and https:// URLs are read")
    return url


def _numeric_port(parts: SplitResult) -> bool:
    """False for "data:text/plain,x", which gains "http://" above and reads as port "text"."""
    try:
        parts.port  # noqa: B018 - the property raises on a port that is not a number
    except ValueError:
        return False
    return True


def metrics_url(endpoint: str) -> str:
    """``host:port``, ``http://host:port`` or a full URL -> the URL of its ``/metrics``."""
    url = http_url(endpoint)
    if urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/metrics"
    return url


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows redirects to ftp:// too; here only to http(s)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        if urlsplit(newurl).scheme.lower() not in SCHEMES:
            raise urllib.error.HTTPError(req.full_url, code, "redirect to a non-http URL", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _http_opener() -> urllib.request.OpenerDirector:
    """urllib's default opener without its file, ftp and data handlers."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        _HttpOnlyRedirects(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


OPENER = _http_opener()
