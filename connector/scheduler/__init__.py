"""The scheduler half: in vLLM's scheduler process it answers lookups (what is stored for a
request), plans each step's loads and stores, and turns the workers' reports into responses,
telemetry and the admin endpoint's answers.

It imports the pure engine, the configuration, the tiers and, at the top of connector/, the model
checkpoint's identity and vllm_compat; never the worker half (connector/worker/).
"""
