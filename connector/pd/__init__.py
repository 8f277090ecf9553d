"""Prefill/decode disaggregation's data plane: pure Python and sockets (no vLLM, no torch).

- ``identity.py``: ``PeerIdentity``, what both ends must share to pair, and what differs.
- ``wire.py``: the frames (handshake, allocation, chunks, acknowledgement) and bounded reads
  and writes, over plain or TLS sockets.
- ``auth.py``: the PD key's mutual handshake proofs and the keyed chunk tags.
- ``tls.py``: TLS contexts from the operator's certificate files.
- ``slot_allocator.py``: the buffer's slots, best fit in logarithmic searches, all or nothing.
- ``receive_buffer.py``: the decoder's shared-memory receive buffer per rank, its owner's lock
  (what clean-up of stale buffers goes by), ``attach`` for the worker ranks (read-only views).
- ``receive_index.py``: received records by key and rank, claims, release, expiry.
- ``receiver.py``: ``PDReceiver``, the server in the decoder's scheduler process.
- ``receiver_conns.py``: its connection slots (who gets one, who gives one up).
- ``transfers.py``: a transfer as the receiver sees it (allocation checked, trailers, outcome).
- ``sender.py``: ``PDSender``, one per prefiller worker rank, its transfers on a few lanes.
- ``probe.py``: the handshake, and ``probe_receiver`` (pairing check, allocates nothing).
- ``proxy_notice.py``: ``ProxyNotifier``, the ZMQ notice LMCache's proxy reads.

docs/disaggregation.md (section "Wire") describes the protocol.
"""
