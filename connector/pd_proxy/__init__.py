"""``kvlens pd-proxy``: a prefill/decode proxy with LMCache's example proxy's protocol and flags,
a bounded wait for the prefillers' notices, trace propagation and its own metrics.

A program of its own (an HTTP server in front of the engines), not part of the connector: it
imports nothing of the connector and the connector nothing of it.

- ``server.py``: the app (``build_app``, ``PDProxy``, ``run``).
- ``backends.py``: the engines, how requests pair them, the flags (``settings_from_args``).
- ``requests.py``: what the prefiller and the decoder are sent for a client request.
- ``answers.py``: the client's answer put together from both.
- ``flow.py``: one request's path through the phases.
- ``notices.py``: the ZMQ ``ProxyNotif`` listener and who waits for which notice.
- ``observe.py``: metrics, request records, spans.

docs/disaggregation.md ("The proxy") describes it.
"""
