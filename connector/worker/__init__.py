"""The worker half: in each vLLM worker process it carries out the step's plan, copying KV blocks
between the GPU (or CPU) cache and the tiers, and reports back what happened.

It imports the pure engine, the tiers and the configuration, never the scheduler half
(connector/scheduler/).
"""
