"""An offline vllm.LLM batch job with every KVLens feature on; exits with the job's status.

python offline_job.py MODEL DISK_DIR
"""

from __future__ import annotations

import random
import sys

if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, disk = sys.argv[1], sys.argv[2]
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=2048,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "lmcache.chunk_size": 256,
                "lmcache.max_local_cpu_size": 0.1,
                "lmcache.local_disk": disk,
                "lmcache.max_local_disk_size": 0.2,
                "lmcache.save_unfull_chunk": True,
            },
        ),
    )
    rng = random.Random(3)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 1000) for _ in range(700)]) for _ in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.reset_prefix_cache()
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    print("JOB DONE", flush=True)
