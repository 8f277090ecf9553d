"""The test servers themselves: a cluster node whose bus port was taken meanwhile still starts."""

from __future__ import annotations

import socket

import pytest

from . import servers
from .servers import REDIS_SERVER, RedisClusterProcs

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


def test_a_cluster_node_whose_bus_port_another_process_took_starts_on_other_ports(tmp_path, monkeypatch):
    """A cluster node also listens on a bus port. With test workers starting engines and servers
    beside each other, the port chosen free may be taken before the node binds it: the node must
    then start on other ports, as a node whose client port was taken does (found in a run where
    a cluster fixture failed five times on the same taken bus port)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    ports = iter([taken.getsockname()[1]])  # the first port asked for is the taken one
    real = servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real())
    node = RedisClusterProcs(tmp_path / "cluster").servers[0]
    try:
        node.start()
        assert node.proc is not None and node.proc.poll() is None
    finally:
        node.kill()
        taken.close()
