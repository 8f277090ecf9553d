"""What the benchmark commands in ``bench/`` share. A new benchmark starts at ``runner.py``.

``runner``: the one runner (shared options, modes measured in turns, repetitions, ratios to the
baselines) and the ``Benchmark`` base every script subclasses; ``served``: modes that are vLLM
servers; ``results`` and ``report``: the one report format (summaries, targets, Markdown tables,
the JSON file, the PNG); ``modes``: what each server mode configures (no connector, KVLens per
tier, vLLM's ExampleConnector, LMCache in its multiprocess mode); ``servers``: vLLM, LMCache and
Redis servers in their own process groups; ``client``: HTTP requests and their timings;
``models``: the benchmark models, built once, and the real model (``--real``); ``ttft``,
``workload``, ``offline`` and ``fake_requests``: what several scripts measure alike; ``rag_set``:
the RAG set answer quality is judged by (standard library only: the demo imports it too).
"""
