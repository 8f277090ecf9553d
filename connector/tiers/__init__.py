"""Storage tiers behind one small protocol (see base.py)."""
