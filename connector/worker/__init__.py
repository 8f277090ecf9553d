"""The worker half: in each vLLM worker process it carries out the step's plan, copying KV blocks
between vLLM's KV cache and the tiers, and reports back what happened. ``ConnectorWorker``
(connector_worker.py) coordinates its parts: chunk_reads, loads_outside_step, writes, reports.

It imports the pure engine, the configuration, the tiers and cpu_affinity; never the scheduler
half (connector/scheduler/).
"""
