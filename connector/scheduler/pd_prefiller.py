"""The prefiller's scheduler side (``pd_role: sender``): which requests send their prompt's KV,
and when.

A request whose kv_transfer_params carry a valid ``disagg_spec`` gets one ``PDSendJob`` in the
metadata of the step that computes its prompt's last token: every chunk of the prompt, the
unfull last chunk included (its exact-length key, as the decoder looks it up), with the blocks
that hold it. The workers gather after that step's forward pass and hand the bytes to their
sender; vLLM frees the blocks only after ``request_finished``, which comes after the gather.
A bad spec is refused (counted by reason, logged once per request, the request served as if it
had none) and a proxy waiting on it is still notified, so nobody hangs on a lie.

Pure: neither vLLM nor torch; vLLM's objects are used duck-typed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config.pd import PDConfig
from ..config.pd_trust import parse_list
from ..engine.facts import EngineFacts
from ..engine.keys import ChunkKey
from ..engine.pd_jobs import PDSendChunk, PDSendJob
from ..engine.policy import trace_headers
from .pd_spec import PDParams, SpecRefused, read_pd_params, usable_req_id

logger = logging.getLogger("vllm.kvlens")

MAX_TRACKED = 65536  # requests with PD parameters held at once (a client cannot grow this forever)


@dataclass(slots=True)
class _Sending:
    params: PDParams
    refused: str | None = None  # the spec's refusal reason: only the proxy's notice goes out
    notice_req_id: str | None = None  # the proxy's id of a refused spec, when it had a usable one
    planned: bool = False
    tokens: int = 0
    bytes: int = 0


class PDPrefiller:
    def __init__(self, pd: PDConfig, facts: EngineFacts, key_space: str) -> None:
        self._pd, self._facts, self.key_space = pd, facts, key_space
        self._allowed = parse_list(pd.allowed_receivers)
        self._requests: dict[str, _Sending] = {}
        self.refusals: Counter[str] = Counter()  # reason -> requests whose spec was refused
        self._refused_notices: list[str] = []  # req_ids of refused specs: the proxy still hears

    def note(self, request: Any) -> None:
        """Read the request's PD parameters once (its first lookup)."""
        rid = request.request_id
        if rid in self._requests:
            return
        try:
            params = read_pd_params(
                getattr(request, "kv_transfer_params", None), self._facts.world_size, self._allowed
            )
        except SpecRefused as e:
            self.refusals[e.reason] += 1
            logger.warning("KVLens PD: request %s: disagg_spec refused (%s): %s", rid[:64], e.reason, e)
            req_id = usable_req_id(getattr(request, "kv_transfer_params", None))
            if req_id is not None and len(self._requests) < MAX_TRACKED:  # its proxy still hears
                self._requests[rid] = _Sending(PDParams(None, False), e.reason, req_id)
            return
        if params is None or len(self._requests) >= MAX_TRACKED:
            if params is not None:
                self.refusals["too_many"] += 1
            return
        self._requests[rid] = _Sending(params)

    def plan(self, trackers: dict[str, Any], unfinished: dict[str, Any]) -> list[PDSendJob]:
        """Send jobs of requests whose prompt is complete after this step (each once)."""
        jobs = []
        for rid, sending in self._requests.items():
            if sending.planned or (sending.params.spec is None and sending.notice_req_id is None):
                continue
            tracker, request = trackers.get(rid), unfinished.get(rid)
            if tracker is None or request is None or not tracker.prefill_done:
                continue
            sending.planned = True
            if sending.refused is not None:
                job = self._notice_only(rid, sending.notice_req_id or "", sending.refused)
            else:
                job = self._job(rid, sending, tracker, request)
            if job is not None:
                jobs.append(job)
        return jobs

    def _job(self, rid: str, sending: _Sending, tracker: Any, request: Any) -> PDSendJob | None:
        spec = sending.params.spec
        assert spec is not None
        keys: Sequence[ChunkKey] = tracker.hasher.keys(request.all_token_ids, True, tracker.prompt_len)
        chunks = []
        for key in keys:
            blocks = tracker.blocks_of(key, self._facts.block_size)
            if blocks is None:  # vLLM has not given the blocks: never send what is not there
                self.refusals["no_blocks"] += 1
                return self._notice_only(rid, spec.req_id, "no_blocks")
            chunks.append(PDSendChunk(key.hex, blocks, key.num_tokens))
        sending.tokens = sum(c.num_tokens for c in chunks)
        sending.bytes = sum(self._facts.chunk_nbytes(c.num_tokens) for c in chunks) * self._facts.world_size
        return PDSendJob(
            request_id=rid,
            req_id=spec.req_id,
            host=spec.host,
            init_ports=spec.init_ports,
            alloc_ports=spec.alloc_ports,
            chunks=tuple(chunks),
            key_space=self.key_space,
            notify=self._pd.notifies_proxy,
            trace_context=trace_headers(request),
        )

    def _notice_only(self, rid: str, req_id: str, reason: str) -> PDSendJob:
        notify = self._pd.notifies_proxy and bool(req_id)
        return PDSendJob(rid, req_id, "", (), (), (), self.key_space, notify, None, refused=reason)

    def finish(self, request: Any) -> dict[str, Any]:
        """What the response carries: ``first_tok`` (with ``ret_first_tok``) and ``kvlens.pd``."""
        sending = self._requests.pop(request.request_id, None)
        out: dict[str, Any] = {}
        params = getattr(request, "kv_transfer_params", None) or {}
        wants_first = (sending is not None and sending.params.ret_first_tok) or params.get(
            "ret_first_tok"
        ) is True
        outputs = getattr(request, "output_token_ids", None) or ()
        if wants_first and len(outputs) > 0:
            out["first_tok"] = int(outputs[0])
        if sending is not None and (sending.params.spec is not None or sending.refused is not None):
            out["pd"] = {
                "role": "sender",
                "tokens": sending.tokens,
                "bytes": sending.bytes,
                "destinations": self._facts.world_size if sending.tokens else 0,
            }
        return out

    def take_refusals(self) -> Counter[str]:
        """Specs refused since the last call, by reason."""
        out, self.refusals = self.refusals, Counter()
        return out

    def __len__(self) -> int:
        return len(self._requests)
