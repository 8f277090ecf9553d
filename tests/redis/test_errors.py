"""How redis-py failures are counted (no server needed)."""

import pickle

import pytest
from redis import exceptions as rx

from connector.tiers.redis_tier import RemoteUnavailable, failure_kind


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (rx.TimeoutError("Timeout reading from socket"), "timeout"),
        (rx.ConnectionError("Error 111 connecting"), "connection"),
        (rx.AuthenticationError("invalid username-password pair"), "auth"),
        (rx.NoPermissionError("this user has no permissions"), "auth"),
        (rx.BusyLoadingError("Redis is loading the dataset in memory"), "loading"),
        (rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "oom"),
        (rx.ResponseError("OOM command not allowed when used memory > 'maxmemory'."), "oom"),
        (rx.ReadOnlyError("You can't write against a read only replica."), "readonly"),
        (rx.ClusterDownError("The cluster is down"), "cluster"),
        (rx.MasterDownError("Link with MASTER is down"), "cluster"),
        (rx.TryAgainError("Multiple keys request during rehashing of slot"), "cluster"),
        (rx.AskError("3999 127.0.0.1:6381"), "cluster"),
        (rx.SlotNotCoveredError('Slot "1" is not covered by the cluster.'), "cluster"),
        (rx.RedisClusterException("Redis Cluster cannot be connected"), "cluster"),
        (ConnectionResetError(104, "Connection reset by peer"), "connection"),
        (rx.RedisError("something else"), "error"),
        (RuntimeError("a redis-py bug"), "error"),
    ],
)
def test_every_server_failure_has_a_kind_to_count_by(error, kind):
    assert failure_kind(error) == kind


def test_replies_about_the_data_itself_are_not_server_failures():
    wrong_type = rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert failure_kind(wrong_type) is None


def test_remote_unavailable_keeps_op_and_kind_across_processes():
    error = RemoteUnavailable("remote get on redis://h:1/0 failed (timeout): ...", op="get", kind="timeout")
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, OSError)
    assert (str(copy), copy.op, copy.kind) == (str(error), "get", "timeout")
