"""TLS for the PD data plane: the standard library's ``ssl`` with the operator's certificate files.

KV reveals the prompt it was computed from, so on a network that must not see prompts the PD
connections can run inside TLS (``pd_tls: true``). The receiver presents its certificate
(``pd_tls_cert_file``, ``pd_tls_key_file``) and, given ``pd_tls_ca_file``, also requires one from
the sender (mutual TLS); the sender checks the receiver's certificate against ``pd_tls_ca_file``
(else the system's trust store) and its name against the host it connects to. The handshake and
the chunk tags of ``auth.py`` run unchanged inside: TLS hides the bytes, the PD key still says who
may hand a decoder KV. TLS 1.2 at least.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert_file: str | None = None  # PEM certificate (chain) this side presents
    key_file: str | None = None  # its private key (None: in cert_file)
    ca_file: str | None = None  # PEM CA bundle the peer's certificate must chain to


class ClientTLS:
    """The sender's side: verifies the receiver; presents a certificate when one is given."""

    def __init__(self, files: TLSFiles) -> None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if files.cert_file:
            context.load_cert_chain(files.cert_file, files.key_file)
        self._context = context

    def wrap(self, conn: socket.socket, host: str, timeout_s: float) -> ssl.SSLSocket:
        """``conn`` after a TLS handshake bounded by ``timeout_s`` (``ssl.SSLError`` or
        ``OSError`` when it fails: a receiver that is not the one named)."""
        conn.settimeout(timeout_s)
        return self._context.wrap_socket(conn, server_hostname=host.strip("[]"))


class ServerTLS:
    """The receiver's side: presents its certificate; with a CA file, requires the sender's."""

    def __init__(self, files: TLSFiles) -> None:
        if not files.cert_file:
            raise ValueError("a TLS receiver needs pd_tls_cert_file")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=files.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(files.cert_file, files.key_file)
        context.verify_mode = ssl.CERT_REQUIRED if files.ca_file else ssl.CERT_NONE
        self._context = context

    def wrap(self, conn: socket.socket, timeout_s: float) -> ssl.SSLSocket:
        conn.settimeout(timeout_s)
        return self._context.wrap_socket(conn, server_side=True)
