"""Runs an offline ``vllm.LLM`` with KVLens and KVLENS_METRICS_PORT, and prints the exporter's
/metrics text after a cold request and a KVLens hit. Used by test_offline_exporter.py as a
subprocess (vLLM engines are best kept out of the test process).

    KVLENS_METRICS_PORT=9464 python offline_metrics.py MODEL
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=sys.argv[1],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 1},
        ),
    )
    prompt = [TokensPrompt(prompt_token_ids=[100 + (i * 37) % 1000 for i in range(600)])]
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    llm.generate(prompt, params, use_tqdm=False)
    llm.reset_prefix_cache()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    port = os.environ["KVLENS_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    print(json.dumps({"kv_transfer_params": out.kv_transfer_params, "metrics": text}))
    sys.stdout.flush()
    os._exit(0)  # the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)


if __name__ == "__main__":
    main()
