"""Tools for operators: the ``kvlens`` command (inspect, clear, doctor) and the pure analyses
behind it, importable by the dashboard."""
