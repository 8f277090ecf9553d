"""The blender's compute core (CacheBlend), worker side: stored K moved to new positions with the
model's own rotary embedding (``rope_shift``), the tokens to recompute chosen by their K deviation
at the check layers (``selection``), and the layer loop that recomputes only those tokens over the
mixed KV (``blender``), written against a small per-layer interface (``model_api``) that
transformers' Llama backs today (``hf_llama``) and vLLM's model modules will back later."""
