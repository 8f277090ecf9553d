"""Where the dashboard's numbers come from: vLLM ``/metrics`` endpoints read directly (with a
bounded in-memory history, so rates work without Prometheus) or a Prometheus HTTP API.

Both give the same long frame, one row per sample: ``time`` (epoch seconds), ``instance``,
``name`` (the sample name, ``..._total`` for counters), the label columns of
``catalog.LABELS`` ("" when absent) and ``value``. ``views`` computes everything from it.
"""

from __future__ import annotations

import datetime as dt
import http
import re
import threading
import time
import urllib.error
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from .catalog import APP_SAMPLE_NAMES, LABELS
from .urls import OPENER, NotHttpURL, http_url
from .urls import metrics_url as metrics_url  # re-exported: callers build endpoint URLs here

COLUMNS = ("time", "instance", "name", *LABELS, "value")

OK = "ok"
UNREACHABLE = "unreachable"
NO_KVLENS = "no_kvlens"
BAD_RESPONSE = "bad_response"
QUERY_FAILED = "query_failed"
NO_DATA = "no_data"
SLOW = "slow"  # it did not answer in time (a loaded vLLM may miss one scrape's deadline)

Sample = tuple[str, tuple[str, ...], float]  # name, label values in LABELS order, value


@dataclass(frozen=True, slots=True)
class Status:
    source: str  # the endpoint URL or the Prometheus URL
    state: str  # OK, UNREACHABLE, SLOW, NO_KVLENS, BAD_RESPONSE, QUERY_FAILED or NO_DATA
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.state == OK


def instance_of(url: str) -> str:
    """The ``instance`` label Prometheus would give this target: ``host:port``."""
    return urlsplit(url).netloc


def fetch_text(url: str, timeout: float = 5.0) -> str:
    """The body at an http(s) URL; any other scheme raises ``NotHttpURL`` unread."""
    with OPENER.open(http_url(url), timeout=timeout) as response:
        return response.read().decode("utf-8", errors="replace")


def http_status(code: int) -> str:
    """``HTTP 404 Not Found``: the standard phrase, not the one the server sent."""
    try:
        return f"HTTP {code} {http.HTTPStatus(code).phrase}"
    except ValueError:
        return f"HTTP {code}"


def failure(e: BaseException) -> str:
    """Why a read failed, in words that never quote what the other end sent: an HTTP status,
    the operating system's reason, or the exception's class."""
    if isinstance(e, urllib.error.HTTPError):
        return http_status(e.code)
    if isinstance(e, NotHttpURL):
        return str(e)
    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException):
        e = e.reason
    if isinstance(e, OSError) and isinstance(e.strerror, str) and not isinstance(e, urllib.error.URLError):
        return f"{type(e).__name__}: {e.strerror}"
    return type(e).__name__


def timed_out(e: BaseException) -> bool:
    """The read failed on its deadline (the endpoint is there, slow), not on a refusal."""
    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException):
        e = e.reason
    return isinstance(e, TimeoutError)


def parse_samples(text: str, keep: frozenset[str] = APP_SAMPLE_NAMES) -> list[Sample]:
    """The samples named in ``keep`` from Prometheus text exposition (``_created`` dropped)."""
    out: list[Sample] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in keep:
                out.append((s.name, tuple(s.labels.get(k, "") for k in LABELS), float(s.value)))
    return out


KVLENS_PREFIX = "vllm:kvlens_"


def has_kvlens(samples: Iterable[Sample], prefix: str = KVLENS_PREFIX) -> bool:
    return any(name.startswith(prefix) for name, _, _ in samples)


def scrape(
    url: str,
    fetch: Callable[[str], str] = fetch_text,
    keep: frozenset[str] = APP_SAMPLE_NAMES,
    expect: str = KVLENS_PREFIX,
) -> tuple[list[Sample], Status]:
    """One read of an endpoint, never raising: the samples named in ``keep`` and what went wrong,
    if anything (never a quote of what the endpoint sent). No series named ``expect...``: NO_KVLENS."""
    try:
        text = fetch(url)
    except Exception as e:  # noqa: BLE001 - any failure to read is "unreachable", or "slow"
        return [], Status(url, SLOW if timed_out(e) else UNREACHABLE, failure(e))
    try:
        samples = parse_samples(text, keep)
    except Exception as e:  # noqa: BLE001 - the parser's messages quote the offending line
        return [], Status(url, BAD_RESPONSE, f"not Prometheus text exposition ({type(e).__name__})")
    if not has_kvlens(samples, expect):
        return samples, Status(url, NO_KVLENS, f"no {expect}* series")
    return samples, Status(url, OK)


class MetricsHistory:
    """The last ``max_points`` scrapes of one endpoint, in memory; thread-safe.

    A scrape within ``min_interval_s`` of the previous one is skipped, so several browser
    sessions refreshing at once share one history instead of multiplying scrapes.
    """

    def __init__(
        self,
        url: str,
        max_points: int = 720,
        min_interval_s: float = 1.0,
        fetch: Callable[[str], str] = fetch_text,
        clock: Callable[[], float] = time.time,
        keep: frozenset[str] = APP_SAMPLE_NAMES,
        expect: str = KVLENS_PREFIX,
    ) -> None:
        self.url = http_url(url)
        self._keep, self._expect = keep, expect
        self.instance = instance_of(self.url)
        # The rows of each scrape kept (a count per scrape) and their frame, extended by each
        # scrape: a refresh re-reads the history, it does not rebuild it.
        self._points: deque[int] = deque()
        self._max_points = max_points
        self._frame = empty_frame()
        self._min_interval_s = min_interval_s
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._last_try = float("-inf")
        self.status = Status(url, NO_DATA, "not read yet")

    def scrape(self, now: float | None = None) -> Status:
        now = self._clock() if now is None else now
        with self._lock:
            if now - self._last_try < self._min_interval_s:
                return self.status
            self._last_try = now
            samples, self.status = scrape(self.url, self._fetch, self._keep, self._expect)
            if samples:
                self._append(self._point(now, samples))
            return self.status

    def _append(self, point: pd.DataFrame) -> None:
        dropped = 0
        while len(self._points) >= self._max_points:
            dropped += self._points.popleft()
        self._points.append(len(point))
        kept = self._frame.iloc[dropped:]
        self._frame = pd.concat([kept, point], ignore_index=True) if not kept.empty else point

    def __len__(self) -> int:
        return len(self._points)

    def _point(self, t: float, samples: list[Sample]) -> pd.DataFrame:
        rows = [(t, self.instance, name, *labels, value) for name, labels, value in samples]
        return pd.DataFrame(rows, columns=list(COLUMNS))

    def frame(self) -> pd.DataFrame:
        """Every scrape kept, oldest first (shared until the next scrape: do not modify it)."""
        with self._lock:
            return self._frame


def empty_frame() -> pd.DataFrame:
    return pd.DataFrame([], columns=list(COLUMNS))


def combine(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else empty_frame()


def names_selector(names: Iterable[str]) -> str:
    """A PromQL selector for exactly these metric names."""
    return '{__name__=~"' + "|".join(re.escape(n) for n in sorted(names)) + '"}'


def range_step(minutes: float, points: int = 240, min_step_s: float = 1.0) -> float:
    return max(minutes * 60 / points, min_step_s)


class PrometheusSource:
    """Raw KVLens and vLLM series over a time range from Prometheus's HTTP API, through
    ``prometheus_api_client`` (the same computations as for direct scrapes then apply)."""

    def __init__(self, url: str, timeout: float = 10.0, connect: Callable[..., object] | None = None) -> None:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = http_url(url).rstrip("/")
        factory = connect or PrometheusConnect
        self._client = factory(
            url=self.url, disable_ssl=True, retry=Retry(total=0), timeout=timeout, method="POST"
        )
        self.status = Status(self.url, NO_DATA, "not queried yet")

    def frame(
        self,
        minutes: float = 30.0,
        now: float | None = None,
        names: frozenset[str] = APP_SAMPLE_NAMES,
        expect: str = KVLENS_PREFIX,
    ) -> pd.DataFrame:
        """Never raises: a failed query gives an empty frame and ``status`` says why."""
        end = dt.datetime.fromtimestamp(now if now is not None else time.time(), dt.timezone.utc)
        start = end - dt.timedelta(minutes=minutes)
        query = names_selector(names)
        try:
            # A number of seconds: Prometheus parses "7.5" but not "7.5s" as a step.
            result = self._client.custom_query_range(query, start, end, f"{range_step(minutes):g}")
        except Exception as e:  # noqa: BLE001 - requests, HTTP and JSON errors all mean "query failed"
            self.status = Status(self.url, QUERY_FAILED, query_failure(e))
            return empty_frame()
        frame = frame_from_matrix(result)
        if frame.empty:
            what = "KVLens or vLLM" if expect == KVLENS_PREFIX else expect + "*"
            self.status = Status(self.url, NO_DATA, f"no {what} series in the time range")
        elif not frame["name"].str.startswith(expect).any():
            self.status = Status(self.url, NO_KVLENS, f"other series but no {expect}* series")
        else:
            self.status = Status(self.url, OK)
        return frame


_API_STATUS = re.compile(r"^HTTP Status Code (\d{3}) ")


def query_failure(e: BaseException) -> str:
    """prometheus_api_client puts the response body in its exceptions: keep only the status."""
    status = _API_STATUS.match(str(e))
    return http_status(int(status.group(1))) if status else failure(e)


def frame_from_matrix(result: list[dict]) -> pd.DataFrame:
    """A Prometheus range-query result (``resultType: matrix``) as the long frame."""
    rows = []
    for series in result:
        metric = series.get("metric", {})
        name = metric.get("__name__", "")
        labels = tuple(metric.get(k, "") for k in LABELS)
        instance = metric.get("instance", "")
        for t, v in series.get("values", []):
            rows.append((float(t), instance, name, *labels, float(v)))
    return pd.DataFrame(rows, columns=list(COLUMNS)) if rows else empty_frame()
