"""The scheduler half: vLLM's scheduler process asks it what is stored (lookup), it plans each
step's loads and stores, and it turns the workers' reports into responses and telemetry.

It imports the pure engine, the tiers and the configuration, never the worker half (connector/worker/).
"""
