"""KVLens dashboards: the Streamlit app (``streamlit run dashboard/app.py``) and the metric
catalogue shared with the Grafana bundle in ``grafana/``.

``app.py`` only lays out; the modules here fetch, compute and draw, and are tested.
"""
