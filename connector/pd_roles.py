"""PD (prefill/decode disaggregation) beside the two halves: what the facade calls when
``enable_pd`` is on. It builds the data plane's objects (connector/pd/) for the role and the
half, with identities from the engine's facts, and keeps the facade's hooks one line each.

- ``SchedulerPD``: the prefiller's send planning (``PDPrefiller``), the decoder's receiver and
  lookup-first claims (``PDDecoder``), the response fields and the counters for /metrics.
- ``WorkerPD``: the rank's sender and proxy notifier (``PDSends``) or buffer loads (``PDLoads``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .config.model import ConfigError, KVLensConfig
from .config.pd import PDConfig
from .engine.facts import EngineFacts
from .engine.keys import key_fingerprint
from .engine.outcomes import RequestSummary
from .engine.pd_jobs import PDLoadResult, PDSendReport
from .engine.policy import trace_headers
from .pd.identity import PeerIdentity
from .scheduler.exit_cleanup import remove_at_exit
from .scheduler.pd_decoder import PDDecoder
from .scheduler.pd_prefiller import PDPrefiller
from .scheduler.pd_usage import received_tokens, summary_with_received, with_received
from .worker.pd_worker import PDLoads, PDSends

logger = logging.getLogger("vllm.kvlens")


def identity(key_space: str, facts: EngineFacts, chunk_size: int, rank: int) -> PeerIdentity:
    layout = facts.record_layout()
    return PeerIdentity(key_space, facts.world_size, rank, facts.block_size, chunk_size, layout)


def key_space(facts: EngineFacts) -> str:
    """The digest of what every chunk key depends on besides tokens (the scheduler's facts)."""
    return key_fingerprint(facts.namespace())


def auth_of(pd: PDConfig) -> Any:
    """The PD key's handshake and tags (None: no key)."""
    from .pd.auth import PDAuth

    return PDAuth(pd.auth_key) if pd.auth_key is not None else None


def _tls_files(pd: PDConfig) -> Any:
    from .pd.tls import TLSFiles

    return TLSFiles(pd.tls_cert_file, pd.tls_key_file, pd.tls_ca_file)


def server_tls(pd: PDConfig) -> Any:
    """The receiver's TLS (None: off); ``ConfigError`` naming the files it cannot use."""
    from .pd.tls import ServerTLS

    return _tls(pd, ServerTLS) if pd.tls else None


def client_tls(pd: PDConfig) -> Any:
    from .pd.tls import ClientTLS

    return _tls(pd, ClientTLS) if pd.tls else None


def _tls(pd: PDConfig, kind: Any) -> Any:
    try:
        return kind(_tls_files(pd))
    except (OSError, ValueError) as e:
        names = "pd_tls_cert_file, pd_tls_key_file, pd_tls_ca_file"
        raise ConfigError(f"KVLens cannot start with this configuration: pd_tls ({names}): {e}") from None


def trust_said(pd: PDConfig) -> str:
    """How the PD port is protected, for logs: the key's source, TLS, or its absence."""
    if pd.auth_key is not None:
        said = f"authenticated ({pd.auth_source})"
    elif pd.allow_unauthenticated:
        said = "UNAUTHENTICATED (pd_allow_unauthenticated: true)"
    else:
        said = "unauthenticated, loopback only"
    return said + (", TLS" if pd.tls else "")


IDLE_STEP_S = 0.005  # an engine stepping only for PD (sends ending, records to expire) paces itself
STALE_SEND_S = 120.0  # a send whose end never came back (a worker gone) stops keeping the engine busy


@dataclass(slots=True)
class _Sending:
    trace_context: dict[str, str] | None
    tokens: int
    ranks_left: int
    planned_at: float


class SchedulerPD:
    def __init__(
        self, config: KVLensConfig, facts: EngineFacts, hashers: dict[str, Any], recorder: Any
    ) -> None:
        pd: PDConfig = config.pd
        self.pd, self._hashers, self.recorder = pd, hashers, recorder
        self._world = facts.world_size
        space = key_space(facts)
        self.prefiller = PDPrefiller(pd, facts, space) if pd.sender else None
        if pd.sender:
            logger.info(
                "KVLens PD prefiller: %s, up to %d bytes per rank held for sends, sends to loopback%s, %s",
                f"notifies the proxy at {pd.proxy_host}:{pd.proxy_port}"
                if pd.notifies_proxy
                else "notifies no proxy",
                pd.buffer_size,
                "".join(f", {r}" for r in pd.allowed_receivers),
                trust_said(pd),
            )
        self.decoder: PDDecoder | None = None
        self._sending: dict[str, _Sending] = {}  # prefiller: requests whose transfers have not all ended
        self._traces: dict[str, dict[str, str] | None] = {}  # decoder: claimed requests' trace headers
        self._seen_outcomes: dict[str, int] = {}  # the receiver's totals already counted
        self._seen_failures: dict[str, int] = {}
        self._seen_expired = 0
        if pd.receiver:
            from .pd.receiver import PDReceiver

            receiver = PDReceiver(
                [identity(space, facts, config.chunk_size, r) for r in range(facts.world_size)],
                pd.peer_host or "127.0.0.1",
                pd.peer_init_ports,
                pd.peer_alloc_ports,
                pd.buffer_size,
                pd.transfer_timeout_s,
                pd.unclaimed_timeout_s,
                auth=auth_of(pd),
                tls=server_tls(pd),
            )
            receiver.start()
            for path in receiver.buffer_paths:  # vLLM SIGKILLs the engine core: no shutdown runs
                remove_at_exit(path)
            self.decoder = PDDecoder(receiver, facts.block_size, time.monotonic)
            logger.info(
                "KVLens PD receiver listening on %s ports %s (alloc %s), %d bytes per rank, %s",
                pd.peer_host,
                list(pd.peer_init_ports),
                list(pd.peer_alloc_ports),
                pd.buffer_size,
                trust_said(pd),
            )

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, request: Any, num_computed: int, tier_need: int) -> tuple[int, bool] | None:
        """vLLM's answer when the request's PD tokens beat the tiers' (None: the tiers' lookup
        stands). Always an asynchronous load (``pd_decoder.py``)."""
        if self.prefiller is not None:
            self.prefiller.note(request)
        if self.decoder is None:
            return None
        hasher = self._hashers.get(request.request_id)
        need = self.decoder.lookup(request, num_computed, hasher)
        return (need, True) if need > tier_need else None

    def after_alloc(self, request: Any, num_external: int, block_ids: list[int] | None) -> bool:
        """True when the request's external tokens are PD's (the tiers' lookup gets 0)."""
        if self.decoder is None or not self.decoder.holds(request.request_id):
            return False
        claimed = self.decoder.after_alloc(request, num_external, block_ids)
        if claimed:
            self._traces[request.request_id] = trace_headers(request)
        return claimed

    def readmitted(self, request_id: str) -> bool:
        """vLLM schedules the request again after its PD load was reported: that allocation is
        not a new lookup (the first one was final and counted)."""
        return self.decoder is not None and self.decoder.readmitted(request_id)

    def hit_tokens(self, request_id: str) -> int:
        return self.decoder.tokens(request_id) if self.decoder is not None else 0

    # ---- plan and reports -------------------------------------------------------------------
    def plan(self, scheduler_output: Any, trackers: dict[str, Any], unfinished: dict[str, Any]) -> tuple:
        """(send jobs, load jobs) of this step."""
        sends = self.prefiller.plan(trackers, unfinished) if self.prefiller is not None else []
        for job in sends:
            tokens = sum(c.num_tokens for c in job.chunks)
            self._sending[job.request_id] = _Sending(job.trace_context, tokens, self._world, time.monotonic())
        if not getattr(scheduler_output, "total_num_scheduled_tokens", 1) and self.pending():
            time.sleep(IDLE_STEP_S)  # nothing computes: a step only to hear of PD's ends
        if self.decoder is None:
            return sends, []
        self.decoder.step()
        return sends, self.decoder.take_jobs()

    def on_worker_meta(self, loads: dict[str, PDLoadResult], sends: list[PDSendReport]) -> None:
        if self.decoder is not None and loads:
            self.decoder.on_results(loads)
            self._loads_reported()
        for report in sends:
            sending = self._sending.get(report.request_id)
            trace, tokens = (sending.trace_context, sending.tokens) if sending is not None else (None, 0)
            self.recorder.send_ended(
                trace,
                report.req_id,
                report.ok,
                report.reason,
                report.bytes,
                tokens,
                report.seconds,
                report.peer,
                report.rank,
            )
            if sending is not None:
                sending.ranks_left -= 1
                if sending.ranks_left <= 0:
                    del self._sending[report.request_id]

    def _loads_reported(self) -> None:
        assert self.decoder is not None
        for rid, out in self.decoder.take_reported():
            self.recorder.load_reported(self._traces.pop(rid, None), out.as_params())

    @property
    def sends_in_flight(self) -> int:
        """Transfers handed to the workers' senders whose end is not reported yet (every rank)."""
        now = time.monotonic()
        for rid in [r for r, s in self._sending.items() if now - s.planned_at > STALE_SEND_S]:
            logger.warning("KVLens PD: the end of %s's transfer was never reported", rid[:64])
            del self._sending[rid]
        return sum(s.ranks_left for s in self._sending.values())

    def pending(self) -> bool:
        """PD needs more engine steps: sends whose end (and notice) is not reported yet."""
        return self.sends_in_flight > 0

    def stats(self) -> dict[str, Any] | None:
        """This step's PD payload for /metrics (gauges sampled each call)."""
        if self.prefiller is not None:
            for reason, n in self.prefiller.take_refusals().items():
                self.recorder.spec_refused(reason, n)
        receiver_stats = None
        if self.decoder is not None:
            receiver_stats = self.decoder.receiver.stats()
            outcomes = _grown(receiver_stats.transfers, self._seen_outcomes)
            failures = _grown(receiver_stats.failed, self._seen_failures)
            self.recorder.received(self.decoder.receiver.take_finished(), outcomes, failures)
            expired = receiver_stats.expired - self._seen_expired  # the receiver expires on its own
            self._seen_expired = receiver_stats.expired
            if expired > 0:
                self.recorder.expired(expired)
        self.recorder.sample(receiver_stats, self.sends_in_flight if self.prefiller is not None else None)
        return self.recorder.take()

    def finish(
        self, request: Any, params: dict[str, Any] | None, done: list[RequestSummary]
    ) -> tuple[dict[str, Any] | None, list[RequestSummary]]:
        """The response's kv_transfer_params with PD's fields added, and the request log's lines
        with the tokens the decoder loaded from a prefiller counted (``pd_usage``)."""
        extra: dict[str, Any] = {}
        pd: dict[str, Any] | None = None
        if self.prefiller is not None:
            sent = self.prefiller.finish(request)
            if "first_tok" in sent:
                extra["first_tok"] = sent["first_tok"]
            pd = sent.get("pd")
        if self.decoder is not None:
            pd = self.decoder.finish(request.request_id)
        if not extra and pd is None:
            return params, done
        received = received_tokens(pd)
        rid = request.request_id
        done = [summary_with_received(d, received) if d.request_id == rid else d for d in done]
        out = with_received(dict(params), received) if params is not None else {}
        out.update(extra)
        if pd is not None:
            out["kvlens"] = {**out.get("kvlens", {}), "pd": pd}
        return out, done

    def shutdown(self) -> None:
        if self.decoder is not None:
            self.decoder.receiver.close(self.pd.shutdown_timeout_s)


def _grown(totals: dict[str, int], seen: dict[str, int]) -> dict[str, int]:
    """What each total grew by since ``seen`` (updated)."""
    out = {k: v - seen.get(k, 0) for k, v in totals.items() if v > seen.get(k, 0)}
    seen.update(totals)
    return out


class WorkerPD:
    def __init__(self, config: KVLensConfig, facts: EngineFacts, rank: int) -> None:
        pd = config.pd
        self.pd = pd
        self.sends: PDSends | None = None
        self.loads: PDLoads | None = None
        local = rank % max(facts.world_size, 1)
        if pd.sender:
            from .pd.proxy_notice import ProxyNotifier
            from .pd.sender import PDSender, Transfer

            notifier = None
            if pd.notifies_proxy:
                assert pd.proxy_host is not None and pd.proxy_port is not None
                notifier = ProxyNotifier(pd.proxy_host, pd.proxy_port)
            timeout = pd.transfer_timeout_s

            auth, tls = auth_of(pd), client_tls(pd)

            def make_sender(space: str) -> PDSender:
                mine = identity(space, facts, config.chunk_size, local)
                return PDSender(mine, min(timeout, 5.0), timeout, auth=auth, tls=tls)

            self.sends = PDSends(local, make_sender, Transfer, notifier, pd.buffer_size)
        if pd.receiver:
            from .pd.receive_buffer import attach

            self.loads = PDLoads(local, attach)

    def load(self, jobs: list, copier: Any, failed_blocks: set[int]) -> None:
        """The step's PD loads, done when this returns; their failed blocks join the step's."""
        if self.loads is not None and jobs:
            failed_blocks |= self.loads.run(jobs, copier)

    def take_received(self) -> set[str]:
        """Requests whose PD load ended since the last call (vLLM's ``finished_recving``)."""
        return self.loads.take_finished() if self.loads is not None else set()

    def send(self, jobs: list, copier: Any, failed_blocks: set[int]) -> None:
        if self.sends is not None and jobs and copier is not None:
            self.sends.run(jobs, copier.gather, failed_blocks)

    def take(self) -> tuple[dict[str, PDLoadResult], list[PDSendReport]]:
        loads = self.loads.take_results() if self.loads is not None else {}
        sends = self.sends.take_reports() if self.sends is not None else []
        return loads, sends

    def shutdown(self) -> None:
        if self.sends is not None:
            self.sends.close(self.pd.shutdown_timeout_s)
        if self.loads is not None:
            self.loads.close()
