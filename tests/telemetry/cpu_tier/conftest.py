"""One ``vllm serve`` for the two modules of this package (tests/conftest.py runs the package as
one unit, in one worker): KVLens's CPU tier at 1 GB with 256-token chunks, spans to an OTLP
receiver, the request log, vLLM's KV event stream, and 512 tokens a step (a 1,100-token prompt
takes three steps, for test_serve_traces_metrics.py). test_serve_insight.py runs first: its
what-if curve counts every lookup since the server started."""

from __future__ import annotations

import pytest

from ..conftest import running_stack
from ..serve import kv_transfer_config


@pytest.fixture(scope="package")
def serve_stack(tiny_model, tmp_path_factory):
    with running_stack(
        tiny_model,
        tmp_path_factory.mktemp("serve-cpu-tier"),
        kv_transfer_config(chunk_size=256, max_local_cpu_size=1),
        {"KVLENS_REQUEST_LOG": "{tmp}/requests.jsonl"},
        ("--max-num-batched-tokens", "512"),
        event_stream=True,
    ) as stack:
        yield stack
