"""The test servers themselves: a cluster node whose bus port was taken meanwhile still starts."""

from __future__ import annotations

import socket
import time

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


def test_a_shared_cluster_rides_out_a_master_starved_of_cpu(tmp_path):
    """The cluster tests share (``RedisClusterProcs`` as built by default) must stay up when the
    machine is busy: beside two workers' engines a node can get no CPU for seconds, and with a
    node timeout of one second its peers declared the cluster failed after two (a contract test
    then found it down: ``ClusterDownError`` in a CI run). Tests that are about failover build
    their own cluster with a short timeout."""
    cluster = RedisClusterProcs(tmp_path / "cluster").start()
    try:
        stalled = next(s for s in cluster.servers if _role(s) == "master")
        witness = next(s for s in cluster.servers if s is not stalled)
        stalled.pause()
        states = []
        with witness.client() as client:
            for _ in range(6):
                time.sleep(0.5)
                states.append(client.cluster("info")["cluster_state"])
        stalled.resume()
        assert states == ["ok"] * 6
    finally:
        cluster.kill()


def _role(server) -> str:
    with server.client() as client:
        return client.info("replication")["role"]
