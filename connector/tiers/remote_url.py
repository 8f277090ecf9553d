"""LMCache-style ``remote_url`` values, parsed once into a value that is safe to log.

Every form redis-py's ``from_url`` takes is accepted (``redis://``, ``rediss://``, ``unix://``,
a default port of 6379, ``/db`` or ``?db=``, and redis-py's query options, parsed by redis-py's
own parsers), plus the multi-host forms LMCache adds: ``redis-cluster://h:p,h:p`` and
``redis-sentinel://h:p,h:p[/service]`` (sentinels at port 26379 unless given; the master's
name from the path, else ``$REDIS_SERVICE_NAME``, else LMCache's ``redismaster``).
``valkey*`` schemes are aliases (Valkey speaks the Redis protocol), as is LMCache's ``resp://``.

The password is the one part of a URL that must never reach a log line, a span attribute or an
error message, so it lives in a field that ``repr`` leaves out, ``str`` is the redacted form,
and parse errors name the offending piece without echoing the URL.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from redis.connection import URL_QUERY_ARGUMENT_PARSERS

PASSWORD_ENV = "KVLENS_REDIS_PASSWORD"
SERVICE_NAME_ENV = "REDIS_SERVICE_NAME"  # LMCache's RedisSentinelConnector reads the same variable
DEFAULT_SERVICE_NAME = "redismaster"  # LMCache's default when REDIS_SERVICE_NAME is unset
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True, slots=True)
class Scheme:
    tls: bool = False
    cluster: bool = False
    sentinel: bool = False
    unix: bool = False


SCHEMES: dict[str, Scheme] = {
    "redis": Scheme(),
    "valkey": Scheme(),
    "resp": Scheme(),  # LMCache's native RESP connector: the same protocol
    "rediss": Scheme(tls=True),
    "valkeys": Scheme(tls=True),
    "unix": Scheme(unix=True),
    "redis-cluster": Scheme(cluster=True),
    "valkey-cluster": Scheme(cluster=True),
    "rediss-cluster": Scheme(tls=True, cluster=True),
    "valkeys-cluster": Scheme(tls=True, cluster=True),
    "redis-sentinel": Scheme(sentinel=True),
}
# redis-py connection options a URL may carry and KVLens hands to redis-py unchanged.
PASSED_OPTIONS = frozenset(
    {
        "socket_keepalive",
        "socket_read_size",
        "health_check_interval",
        "max_connections",
        "client_name",
        "protocol",
    }
)
TLS_OPTIONS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_ca_path",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)
# Time bounds are KVLens's: these become its data-call timeout (remote_timeout_s).
TIMEOUT_OPTIONS = frozenset({"socket_timeout", "socket_connect_timeout", "timeout"})
# redis-py retries a failed call; KVLens counts the failure and skips the tier instead.
RETRY_OPTIONS = frozenset({"retry_on_timeout", "retry_on_error"})
_CERT_REQS = ("required", "optional", "none")
_SHAPE = (
    "remote_url must look like redis://[[user]:password@]host[:port][/db][?option=value], "
    "unix:///path/to/redis.sock, redis-cluster://host:port,... or redis-sentinel://host:port,...[/service]"
)


@dataclass(frozen=True, slots=True)
class RemoteURL:
    # The scheme as written (lower-cased); the flags below say what it means.
    scheme: str
    # (host, port) pairs: the server, any reachable nodes of a cluster, or the sentinels.
    # Hosts are unbracketed. Empty for a Unix socket.
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
    # unix://: the socket's path.
    socket_path: str | None = None
    # redis-sentinel://: the name of the master the sentinels watch (``nodes`` are sentinels).
    service_name: str | None = None
    # Other redis-py connection options from the query, by name (typed by redis-py's parsers).
    options: tuple[tuple[str, Any], ...] = field(default=(), repr=False)
    # socket_timeout / socket_connect_timeout / timeout from the query (seconds), if given.
    timeout_s: float | None = None
    # Query options KVLens accepts and does not apply (redis-py's retries).
    ignored_options: tuple[str, ...] = ()

    @property
    def sentinel(self) -> bool:
        return self.service_name is not None

    def redacted(self) -> str:
        """The URL with the password replaced by ``***``: what logs, spans and errors show."""
        if self.password is not None:
            userinfo = f"{self.username or ''}:***@"
        else:
            userinfo = f"{self.username}@" if self.username else ""
        if self.socket_path is not None:
            return f"{self.scheme}://{userinfo}{self.socket_path}" + (f"?db={self.db}" if self.db else "")
        hosts = ",".join(_join_host(h, p) for h, p in self.nodes)
        if self.sentinel:
            tail = f"/{self.service_name}" + (f"?db={self.db}" if self.db else "")
        else:
            tail = "" if self.cluster else f"/{self.db}"
        return f"{self.scheme}://{userinfo}{hosts}{tail}"

    def __str__(self) -> str:
        return self.redacted()


def parse_remote_url(
    url: str, environ: Mapping[str, str] | None = None, *, cluster: bool = False
) -> RemoteURL:
    """Parse ``url``; the password comes from it or else from ``environ[PASSWORD_ENV]``.

    ``cluster``: reach the servers as a Redis Cluster whatever the scheme says (LMCache's
    ``valkey_mode: cluster`` with a ``valkey://`` URL). Raises ValueError with a message that
    never contains the password.
    """
    env = os.environ if environ is None else environ
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(_SHAPE)
    scheme_text, rest = url.split("://", 1)
    scheme_name = scheme_text.lower()
    scheme = SCHEMES.get(scheme_name)
    if scheme is None:
        raise ValueError(f"remote_url scheme {scheme_name[:32]!r} is not a Redis scheme ({_known()})")
    if cluster and not scheme.cluster:
        if scheme.unix or scheme.sentinel:
            raise ValueError(f"{scheme_name}:// cannot be reached as a cluster")
        scheme = dataclasses.replace(scheme, cluster=True)
    # The last '@' ends the credentials, so a password may hold '@', '/', '?' or '#' unencoded.
    userinfo, at, rest = rest.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    if "#" in rest:
        raise ValueError("remote_url must not have a '#fragment'")
    rest, _, query = rest.partition("?")
    if scheme.unix:
        netloc, path = "", rest
    else:
        netloc, slash, path = rest.partition("/")
        path = path if slash else ""
    if any(c.isspace() for c in path):
        raise ValueError("remote_url must not contain whitespace")
    query_db, options, timeout_s, ignored, tls_values = _query(query, scheme, scheme_name)
    if password is None:
        password = env.get(PASSWORD_ENV) or None
    common: dict[str, Any] = {
        "username": username,
        "password": password,
        "ssl_ca_certs": tls_values.get("ssl_ca_certs"),
        "ssl_cert_reqs": tls_values.get("ssl_cert_reqs", "required"),
        "options": options,
        "timeout_s": timeout_s,
        "ignored_options": ignored,
    }
    if scheme.unix:
        if not path.startswith("/") or len(path) < 2:
            raise ValueError("unix:// remote_url needs the socket's absolute path (unix:///run/redis.sock)")
        db = query_db if query_db is not None else 0
        return RemoteURL(scheme_name, (), db, False, False, socket_path=unquote(path), **common)
    default_port = DEFAULT_SENTINEL_PORT if scheme.sentinel else DEFAULT_PORT
    nodes = tuple(_node(item.strip(), scheme_name, default_port) for item in netloc.split(","))
    if len(nodes) > 1 and not (scheme.cluster or scheme.sentinel):
        raise ValueError(
            f"{scheme_name}:// takes one host:port; for several nodes of a cluster use "
            f"{_cluster_of(scheme_name)}:// (or valkey_mode: cluster for valkey://)"
        )
    if scheme.sentinel:
        service = unquote(path.strip("/")) or env.get(SERVICE_NAME_ENV) or DEFAULT_SERVICE_NAME
        if "/" in service:
            raise ValueError("redis-sentinel:// takes one path part: the master's service name")
        db = query_db if query_db is not None else 0
        return RemoteURL(scheme_name, nodes, db, False, False, service_name=service, **common)
    db = _db(path) if query_db is None else query_db
    if scheme.cluster and db != 0:
        raise ValueError(f"a Redis Cluster has only database 0; remove it from the {scheme_name}:// URL")
    return RemoteURL(scheme_name, nodes, db, scheme.tls, scheme.cluster, **common)


def with_database(url: RemoteURL, db: int) -> RemoteURL:
    """A database chosen elsewhere (LMCache's ``valkey_database``)."""
    if url.cluster and db != 0:
        raise ValueError("a Redis Cluster has only database 0 (valkey_database must be 0 or unset)")
    return dataclasses.replace(url, db=db)


def with_credentials(url: RemoteURL, username: str | None, password: str | None) -> RemoteURL:
    """Credentials from elsewhere (``extra_config``); the URL's own, if any, win."""
    return dataclasses.replace(url, username=url.username or username, password=url.password or password)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    return unquote(user) or None, (unquote(password) or None) if colon else None


def _node(item: str, scheme: str, default_port: int) -> tuple[str, int]:
    if not item:
        raise ValueError(f"remote_url is missing a host ({scheme}://host:port)")
    if any(c.isspace() for c in item):
        raise ValueError("remote_url must not contain whitespace")
    if item.startswith("["):  # IPv6: [::1]:6379
        host, close, tail = item[1:].partition("]")
        if not close or not host:
            raise ValueError(f"remote_url host {item!r} has an unclosed '[' (write [ipv6]:port)")
        if tail and not tail.startswith(":"):
            raise ValueError(f"remote_url host {item!r}: write [ipv6]:port")
        port = tail[1:] or None
    elif item.count(":") > 1:
        raise ValueError(f"remote_url host {item!r}: write an IPv6 address in brackets ([ipv6]:port)")
    else:
        host, _, port_text = item.partition(":")
        port = port_text or None  # "h" and "h:" both mean the default port, as in redis-py
    if not host:
        raise ValueError(f"remote_url {item!r} is missing a host (write host:port)")
    if port is None:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"remote_url port {port[:16]!r} of {host!r} is not a number from 1 to 65535")
    return host, int(port)


def _db(path: str) -> int:
    path = path.strip("/")
    if path == "":
        return 0
    if not path.isdigit():
        raise ValueError(f"remote_url database {path[:32]!r} is not a number (write host:port/0)")
    return int(path)


def _query(
    query: str, scheme: Scheme, name: str
) -> tuple[int | None, tuple[tuple[str, Any], ...], float | None, tuple[str, ...], dict[str, str]]:
    """(db, options for redis-py, timeout, ignored options, TLS strings) from ``?a=b&c=d``."""
    db: int | None = None
    options: list[tuple[str, Any]] = []
    timeout: float | None = None
    ignored: list[str] = []
    tls_values: dict[str, str] = {}
    for key, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key in TLS_OPTIONS and not scheme.tls:
            raise ValueError(f"remote_url option {key!r} needs a TLS scheme (rediss://), not {name}://")
        if key == "db":
            db = _typed(key, raw)
            if db < 0:
                raise ValueError("remote_url option 'db' must be 0 or more")
        elif key in ("ssl_ca_certs", "ssl_cert_reqs"):
            if key == "ssl_cert_reqs" and raw not in _CERT_REQS:
                raise ValueError(f"remote_url ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
            tls_values[key] = raw
        elif key in TIMEOUT_OPTIONS:
            timeout = _typed(key, raw)
            if not timeout > 0:
                raise ValueError(f"remote_url option {key!r} must be a number of seconds > 0")
        elif key in RETRY_OPTIONS:
            ignored.append(key)
        elif key == "decode_responses":
            raise ValueError("remote_url option 'decode_responses' is refused: KVLens stores binary records")
        elif key in PASSED_OPTIONS or key in TLS_OPTIONS:
            options.append((key, _typed(key, raw)))
        else:
            known = ", ".join(sorted({"db", *PASSED_OPTIONS, *TIMEOUT_OPTIONS, *RETRY_OPTIONS, *TLS_OPTIONS}))
            raise ValueError(f"remote_url option {key[:32]!r} is not supported (known: {known})")
    return db, tuple(options), timeout, tuple(ignored), tls_values


def _typed(key: str, raw: str) -> Any:
    parser = URL_QUERY_ARGUMENT_PARSERS.get(key)
    if parser is None:
        return raw
    try:
        return parser(raw)
    except (TypeError, ValueError):
        raise ValueError(f"remote_url option {key!r} has an invalid value") from None


def _known() -> str:
    return ", ".join(f"{s}://" for s in SCHEMES)


def _cluster_of(scheme: str) -> str:
    return {"redis": "redis-cluster", "valkey": "valkey-cluster", "resp": "redis-cluster"}.get(
        scheme, scheme + "-cluster"
    )


def _join_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
