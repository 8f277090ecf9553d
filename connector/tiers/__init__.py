"""Storage tiers behind one small protocol (see base.py), the background threads that run the
slow ones, and the records kept on them (store_records.py, for ``kvlens`` and the admin endpoint).

Used by both halves; imports the pure engine and cpu_affinity, never either half."""
