"""LMCache-style ``remote_url`` values, parsed once into a value that is safe to log.

The password is the one part of a URL that must never reach a log line, a span attribute or an
error message, so it lives in a field that ``repr`` leaves out, ``str`` is the redacted form,
and parse errors name the offending piece without echoing the URL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

PASSWORD_ENV = "KVLENS_REDIS_PASSWORD"

# scheme -> (tls, cluster). valkey* are aliases: Valkey speaks the Redis protocol.
SCHEMES: dict[str, tuple[bool, bool]] = {
    "redis": (False, False),
    "valkey": (False, False),
    "rediss": (True, False),
    "valkeys": (True, False),
    "redis-cluster": (False, True),
    "valkey-cluster": (False, True),
    "rediss-cluster": (True, True),
    "valkeys-cluster": (True, True),
}
_CERT_REQS = ("required", "optional", "none")
_SHAPE = "remote_url must look like redis://[[user]:password@]host:port[/db] or redis-cluster://host:port,..."


@dataclass(frozen=True, slots=True)
class RemoteURL:
    # The scheme as written (lower-cased); ``tls`` and ``cluster`` say what it means.
    scheme: str
    # (host, port) pairs: the server, or any reachable nodes of a cluster. Hosts are unbracketed.
    nodes: tuple[tuple[str, int], ...]
    # Logical database; always 0 for a cluster.
    db: int
    tls: bool
    cluster: bool
    # ACL user; None means Redis's "default" user.
    username: str | None = None
    # From the URL, else from $KVLENS_REDIS_PASSWORD. Left out of repr; never put it in a message.
    password: str | None = field(default=None, repr=False)
    # TLS only: CA bundle to trust (system CAs when None) and certificate checking.
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: str = "required"

    def redacted(self) -> str:
        """The URL with the password replaced by ``***``: what logs, spans and errors show."""
        if self.password is not None:
            userinfo = f"{self.username or ''}:***@"
        else:
            userinfo = f"{self.username}@" if self.username else ""
        hosts = ",".join(_join_host(h, p) for h, p in self.nodes)
        return f"{self.scheme}://{userinfo}{hosts}" + ("" if self.cluster else f"/{self.db}")

    def __str__(self) -> str:
        return self.redacted()


def parse_remote_url(url: str, environ: Mapping[str, str] | None = None) -> RemoteURL:
    """Parse ``url``; the password comes from it or else from ``environ[PASSWORD_ENV]``.

    Raises ValueError with a message that never contains the password.
    """
    env = os.environ if environ is None else environ
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(_SHAPE)
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise ValueError(f"remote_url scheme {scheme[:32]!r} is not supported (use one of {known})")
    tls, cluster = SCHEMES[scheme]
    # The last '@' ends the credentials, so a password may hold '@', '/', '?' or '#' unencoded.
    userinfo, at, rest = rest.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    if "#" in rest:
        raise ValueError("remote_url must not have a '#fragment'")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if any(c.isspace() for c in netloc + path):
        raise ValueError("remote_url must not contain whitespace")
    nodes = tuple(_node(item, scheme) for item in netloc.split(","))
    if len(nodes) > 1 and not cluster:
        raise ValueError(
            f"{scheme}:// takes one host:port; for several nodes of a cluster use {_cluster_of(scheme)}://"
        )
    db = _db(path) if slash else 0
    if cluster and db != 0:
        raise ValueError(f"a Redis Cluster has only database 0; remove '/{path}' from the {scheme}:// URL")
    ca_certs, cert_reqs = _tls_options(query, tls, scheme)
    if password is None:
        password = env.get(PASSWORD_ENV) or None
    return RemoteURL(scheme, nodes, db, tls, cluster, username, password, ca_certs, cert_reqs)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    return unquote(user) or None, (unquote(password) or None) if colon else None


def _node(item: str, scheme: str) -> tuple[str, int]:
    if not item:
        raise ValueError(f"remote_url is missing a host ({scheme}://host:port)")
    if item.startswith("["):  # IPv6: [::1]:6379
        host, close, tail = item[1:].partition("]")
        if not close or not host:
            raise ValueError(f"remote_url host {item!r} has an unclosed '[' (write [ipv6]:port)")
        colon, port = tail[:1] == ":", tail[1:]
    else:
        host, sep, port = item.rpartition(":")
        colon = bool(sep)
        if not colon:
            host = item
    if not colon or not port:
        raise ValueError(f"remote_url host {item!r} is missing a port (write host:port)")
    if not host:
        raise ValueError(f"remote_url {item!r} is missing a host (write host:port)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"remote_url port {port[:16]!r} of {host!r} is not a number from 1 to 65535")
    return host, int(port)


def _db(path: str) -> int:
    if path == "":
        return 0
    if not path.isdigit():
        raise ValueError(f"remote_url database {path[:32]!r} is not a number (write host:port/0)")
    return int(path)


def _tls_options(query: str, tls: bool, scheme: str) -> tuple[str | None, str]:
    ca_certs, cert_reqs = None, "required"
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key not in ("ssl_ca_certs", "ssl_cert_reqs"):
            raise ValueError(f"remote_url option {key[:32]!r} is not supported (ssl_ca_certs, ssl_cert_reqs)")
        if not tls:
            raise ValueError(f"remote_url option {key!r} needs a TLS scheme (rediss://), not {scheme}://")
        if key == "ssl_ca_certs":
            ca_certs = value or None
        elif value not in _CERT_REQS:
            raise ValueError(f"remote_url ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
        else:
            cert_reqs = value
    return ca_certs, cert_reqs


def _cluster_of(scheme: str) -> str:
    return {"redis": "redis-cluster", "valkey": "valkey-cluster"}.get(scheme, scheme + "-cluster")


def _join_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
