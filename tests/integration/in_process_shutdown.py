"""An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, as in notebooks and tests) fills
KVLens's CPU tier, is shut down and dropped; prints what KVLens still holds, as JSON.

python in_process_shutdown.py MODEL
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import weakref


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    import connector.kv_connector as facade

    llm = LLM(
        model=sys.argv[1],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=4096,
        dtype="float32",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 0.5},
        ),
    )
    rng = random.Random(5)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(10, 1000) for _ in range(3000)]) for _ in range(16)
    ]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    worker = get_kv_transfer_group()
    cpu = worker._worker.tiers["cpu"]
    stored_mb = cpu.used_bytes / 1024**2
    worker_ref = weakref.ref(worker)
    del worker
    before = rss_mb()
    llm.llm_engine.engine_core.shutdown()  # what vLLM runs when the LLM goes away
    del llm
    gc.collect()
    print(
        json.dumps(
            {
                "stored_mb": stored_mb,
                "cpu_tier_mb_after": cpu.used_bytes / 1024**2,
                "rss_drop_mb": before - rss_mb(),
                "registered_connectors": len(facade._OPEN) if hasattr(facade, "_OPEN") else None,
                "worker_connector_alive": worker_ref() is not None,
            }
        ),
        flush=True,
    )
    os._exit(0)
