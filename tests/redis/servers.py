"""Real redis-server processes for tests: loopback only, free ports, no persistence.

Each server runs in its own process group and is killed with it; a paused (SIGSTOP) server is
continued first so nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from bench.lib.ports import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
# Debian's redis-sentinel package; redis-server --sentinel is the same program when it is missing.
REDIS_SENTINEL = shutil.which("redis-sentinel")
OPENSSL = shutil.which("openssl")


def make_certificates(folder: Path) -> Path:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it."""
    assert OPENSSL
    folder.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=folder, check=True, capture_output=True, timeout=60)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl(
        "req",
        "-x509",
        *key,
        "-days",
        "2",
        "-subj",
        "/CN=kvlens-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    ssl("req", *key, "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    )
    return folder


def wait_for_a_replica(master, timeout_s: float = 60.0) -> None:
    """Until a replica acknowledged every write the master took (WAIT's count, not its timeout:
    a replica still in its first full sync on a busy machine acknowledges nothing for a while)."""
    deadline = time.monotonic() + timeout_s
    while master.wait(1, 2000) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no replica acknowledged the writes within {timeout_s:.0f} s")


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        *args: str,
        password: str | None = None,
        tls: Path | None = None,
        unix_socket: bool = False,
        cluster_bus: bool = False,
    ) -> None:
        """``tls``: a folder with ca.pem, server.pem and server.key; the port then speaks TLS only.
        ``unix_socket``: also listen on a socket in a short /tmp folder (a path over 107 bytes fails).
        ``cluster_bus``: a cluster node, which also listens on a bus port (chosen with the port)."""
        self.workdir = workdir
        self.args = list(args)
        self.password = password
        self.tls = tls
        self.socket_path = Path(tempfile.mkdtemp(prefix="kvr")) / "redis.sock" if unix_socket else None
        self.port = 0
        self.cluster_bus = cluster_bus
        self.bus_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.socket_path is not None
        return f"unix://{self.socket_path}?db=0"

    def start(self, attempts: int = 5) -> RedisServer:
        """Start on a fresh free port, or on the same port again after ``stop``."""
        assert REDIS_SERVER, "redis-server is not installed (bash scripts/setup.sh)"
        keep_port = self.port != 0
        for _ in range(attempts):
            port = self.port if keep_port else free_port()
            # both ports are chosen again when either was taken by another process meanwhile
            bus = (self.bus_port if keep_port else free_port()) if self.cluster_bus else 0
            if self._launch(port, bus):
                self.port, self.bus_port = port, bus
                return self
            if keep_port:
                time.sleep(0.2)
        raise RuntimeError(f"redis-server did not start; log: {self.log()[-2000:]}")

    def _launch(self, port: int, bus: int = 0) -> bool:
        cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes"]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)]
        cmd += ["--logfile", str(self.workdir / "redis.log")]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.socket_path is not None:
            cmd += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.tls:
            cmd += ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
            cmd += [
                "--tls-cert-file",
                str(self.tls / "server.pem"),
                "--tls-key-file",
                str(self.tls / "server.key"),
            ]
            cmd += ["--tls-ca-cert-file", str(self.tls / "ca.pem")]
        if bus:
            cmd += ["--cluster-port", str(bus)]
        cmd += self.args
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with self.client(port=port) as probe:
                    if probe.ping():
                        return True
            except redis.exceptions.ResponseError as e:  # LOADING and the like
                if "LOADING" not in str(e):
                    return True
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.02)
        self.kill()
        return False

    def client(self, port: int | None = None) -> redis.Redis:
        """A plain client for inspecting or damaging what the tier stored."""
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls / "ca.pem")} if self.tls else {}
        return redis.Redis(
            host="127.0.0.1",
            port=port or self.port,
            password=self.password,
            socket_timeout=2,
            socket_connect_timeout=2,
            **tls,
        )

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server (keeps the port number so ``start`` can reuse it)."""
        self.kill()

    def kill(self) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        if self.socket_path is not None:
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextmanager
def running_redis_url(workdir: Path) -> Iterator[str]:
    """A plain server's URL while the block runs (a fixture's body); the test skips where
    redis-server is not installed."""
    if not REDIS_SERVER:
        pytest.skip("redis-server not installed (bash scripts/setup.sh)")
    server = RedisServer(workdir)
    try:
        yield server.start().url
    finally:
        server.kill()


SHARED_NODE_TIMEOUT_MS = 5000  # a node starved of CPU beside engines for seconds is not failed
FAILOVER_NODE_TIMEOUT_MS = 1000  # clusters of the tests that kill or pause nodes: fail over fast


class RedisClusterProcs:
    """3 masters + 3 replicas on loopback, built with ``redis-cli --cluster create``. A node is
    declared failed after ``node_timeout_ms`` without an answer: the default rides out a busy
    machine (the cluster reports itself down about two timeouts after a master stops answering);
    tests about failover pass ``FAILOVER_NODE_TIMEOUT_MS``."""

    def __init__(self, workdir: Path, node_timeout_ms: int = SHARED_NODE_TIMEOUT_MS) -> None:
        self.servers: list[RedisServer] = []
        for i in range(6):
            self.servers.append(
                RedisServer(
                    workdir / f"node{i}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    cluster_bus=True,
                )
            )

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:3])

    def start(self) -> RedisClusterProcs:
        assert REDIS_CLI, "redis-cli is not installed (Debian package redis-tools)"
        for server in self.servers:
            server.start()
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        out = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}"
            )
        self.wait_ok(timeout_s=30)
        return self

    def wait_ok(self, timeout_s: float, servers: list[RedisServer] | None = None) -> None:
        """Until every (live) node says cluster_state:ok and sees 3 masters with all slots."""
        servers = servers if servers is not None else self.live()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(_cluster_ok(s) for s in servers):
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def wait_replicated(self) -> None:
        """Until every master's replica has caught up: a replica that never synced is not
        promoted, so a test that kills a master controls what the failover can lose."""
        for server in self.live():
            with server.client() as raw:
                if raw.info("replication")["role"] == "master":
                    wait_for_a_replica(raw)

    def live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc is not None]

    def master_of(self, key: str) -> RedisServer:
        """The server that owns ``key``'s slot now."""
        with self.live()[0].client() as probe:
            slot = probe.cluster("keyslot", key)
            slots = probe.cluster("slots")
        for start, end, master, *_ in slots:
            if start <= slot <= end:
                port = int(master[1])
                return next(s for s in self.servers if s.port == port)
        raise LookupError(key)

    def kill(self) -> None:
        for server in self.servers:
            server.kill()


def _cluster_ok(server: RedisServer) -> bool:
    with server.client() as client:
        info = client.cluster("info")
    return (
        info.get("cluster_state") == "ok"
        and int(info.get("cluster_slots_ok", 0)) == 16384
        and int(info.get("cluster_size", 0)) == 3
    )


class RedisSentinelGroup:
    """A master, one replica and three sentinels (quorum 2) on loopback, as LMCache's Redis page
    sets them up; ``down_after_ms`` and ``failover_timeout_ms`` are short so a failover takes
    seconds."""

    def __init__(
        self,
        workdir: Path,
        service: str = "mymaster",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
    ) -> None:
        self.workdir = workdir
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.master = RedisServer(workdir / "master")
        self.replica: RedisServer | None = None
        self.sentinel_ports: list[int] = []
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def servers(self) -> list[RedisServer]:
        return [s for s in (self.master, self.replica) if s is not None]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis-sentinel://{hosts}/{self.service}"

    def start(self, timeout_s: float = 30) -> RedisSentinelGroup:
        assert REDIS_SERVER, "redis-server is not installed (bash scripts/setup.sh)"
        self.master.start()
        self.replica = RedisServer(
            self.workdir / "replica", "--replicaof", "127.0.0.1", str(self.master.port)
        ).start()
        for i in range(3):
            self._start_sentinel(self.workdir / f"sentinel{i}")
        deadline = time.monotonic() + timeout_s
        while not self._settled():
            if time.monotonic() > deadline:
                raise RuntimeError(f"sentinels did not settle; log: {self.sentinel_log()[-2000:]}")
            time.sleep(0.1)
        return self

    def _start_sentinel(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        conf = folder / "sentinel.conf"  # sentinels rewrite their own file: one each
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        cmd = [REDIS_SENTINEL, str(conf)] if REDIS_SENTINEL else [str(REDIS_SERVER), str(conf), "--sentinel"]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._sentinels.append(proc)
        self.sentinel_ports.append(port)

    def _settled(self) -> bool:
        """Every sentinel sees the master, its replica and the two other sentinels."""
        try:
            for port in self.sentinel_ports:
                with self.sentinel_client(port) as client:
                    state = client.sentinel_master(self.service)
                    if int(state.get("num-slaves", 0)) < 1 or int(state.get("num-other-sentinels", 0)) < 2:
                        return False
        except redis.exceptions.RedisError:
            return False
        return True

    def sentinel_client(self, port: int | None = None) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=port or self.sentinel_ports[0], socket_timeout=2, socket_connect_timeout=2
        )

    def master_port(self) -> int:
        """The master's port according to the first sentinel that answers."""
        for port in self.sentinel_ports:
            try:
                with self.sentinel_client(port) as client:
                    _, master = client.sentinel_get_master_addr_by_name(self.service)
                    return int(master)
            except (redis.exceptions.RedisError, TypeError):
                continue
        raise RuntimeError("no sentinel answers")

    def current_master(self) -> RedisServer:
        port = self.master_port()
        return next(s for s in self.servers if s.port == port)

    def wait_replicated(self) -> None:
        with self.current_master().client() as client:
            wait_for_a_replica(client)

    def wait_failover(self, old_port: int, timeout_s: float = 30) -> int:
        """Until a sentinel names a new master and redis-py's own discovery finds it (a sentinel
        reports the promoted replica as a master in good state a moment after naming it; a
        client asking before then gets MasterNotFoundError)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                port = self.master_port()
            except RuntimeError:
                port = old_port
            if port != old_port and self._discovered() == port:
                return port
            time.sleep(0.1)
        raise RuntimeError(f"no failover within {timeout_s} s; log: {self.sentinel_log()[-2000:]}")

    def _discovered(self) -> int | None:
        """The master's port as a client finds it through the sentinels; None while none is."""
        probe = {"socket_timeout": 2, "socket_connect_timeout": 2}
        nodes = [("127.0.0.1", p) for p in self.sentinel_ports]
        sentinel = redis.Sentinel(nodes, sentinel_kwargs=probe)
        try:
            return int(sentinel.discover_master(self.service)[1])
        except redis.exceptions.RedisError:
            return None

    def sentinel_log(self) -> str:
        logs = sorted(self.workdir.glob("sentinel*/sentinel.log"))
        return "\n".join(p.read_text(errors="replace") for p in logs)

    def kill(self) -> None:
        for proc in self._sentinels:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._sentinels = []
        for server in self.servers:
            server.kill()
