"""The configuration: loading (loading.py), the validated model (model.py), the rules between
settings (rules.py), LMCache's key tables (keys.py) and the sentences that explain them
(sentences.py).

Pure: it imports the pure engine and tiers' URL parsing only, never either half, vLLM or torch.
"""
