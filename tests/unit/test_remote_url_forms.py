"""Every URL form redis-py's from_url takes, and LMCache's cluster, Valkey and Sentinel forms."""

import pytest
from redis.connection import parse_url

from connector.tiers.remote_url import (
    DEFAULT_SERVICE_NAME,
    SERVICE_NAME_ENV,
    parse_remote_url,
    with_credentials,
    with_database,
)

SECRET = "pa55-W0rd"


@pytest.mark.parametrize(
    "text",
    [
        "redis://localhost",
        "redis://localhost:6380",
        "redis://localhost/3",
        "redis://localhost:6380/3",
        "redis://localhost?db=2",
        "redis://localhost:6380/1?db=2",  # the query's db wins, as in redis-py
        "redis://alice:pw@cache.example.com:7000/4",
        "redis://:pw@cache.example.com",
        "redis://alice@cache.example.com",
        "redis://:p%40ss@h:1/0",
        "redis://[::1]:6379/2",
        "redis://[::1]",
        "rediss://alice:pw@h:6380/0?ssl_cert_reqs=none",
        "unix:///run/redis/redis.sock",
        "unix:///run/redis/redis.sock?db=5",
        "unix://:pw@/run/redis/redis.sock",
        "redis://h:6379/0?socket_timeout=1.5&health_check_interval=10",
    ],
)
def test_agrees_with_redis_py_on_every_form_it_parses(text):
    expected = parse_url(text)
    url = parse_remote_url(text, environ={})
    if url.socket_path is not None:
        assert url.socket_path == expected["path"]
        assert url.nodes == ()
    else:
        assert url.nodes == ((expected.get("host", "localhost"), expected.get("port", 6379)),)
    assert url.db == expected.get("db", 0)
    assert url.username == expected.get("username")
    assert url.password == expected.get("password")
    assert url.tls == text.startswith("rediss")
    if "socket_timeout" in expected:
        assert url.timeout_s == expected["socket_timeout"]
        assert dict(url.options)["health_check_interval"] == expected["health_check_interval"]


def test_default_port_is_6379_for_servers_and_26379_for_sentinels():
    assert parse_remote_url("redis://cache", environ={}).nodes == (("cache", 6379),)
    assert parse_remote_url("redis://cache:", environ={}).nodes == (("cache", 6379),)
    assert parse_remote_url("valkey://cache", environ={}).nodes == (("cache", 6379),)
    url = parse_remote_url("redis-sentinel://s1,s2:26380,s3", environ={})
    assert url.nodes == (("s1", 26379), ("s2", 26380), ("s3", 26379))


def test_query_options_are_typed_by_redis_py():
    url = parse_remote_url(
        "redis://h:1/0?socket_keepalive=true&max_connections=8&client_name=me&protocol=3", environ={}
    )
    assert dict(url.options) == {
        "socket_keepalive": True,
        "max_connections": 8,
        "client_name": "me",
        "protocol": 3,
    }


@pytest.mark.parametrize("name", ["socket_timeout", "socket_connect_timeout", "timeout"])
def test_timeout_options_become_kvlens_timeout(name):
    assert parse_remote_url(f"redis://h?{name}=0.25", environ={}).timeout_s == 0.25


def test_retry_options_are_accepted_and_reported_as_not_applied():
    url = parse_remote_url("redis://h?retry_on_timeout=true", environ={})
    assert url.ignored_options == ("retry_on_timeout",) and url.options == ()


def test_unix_socket_with_password_and_database():
    url = parse_remote_url(f"unix://:{SECRET}@/var/run/redis.sock?db=3", environ={})
    assert (url.socket_path, url.db, url.password) == ("/var/run/redis.sock", 3, SECRET)
    assert url.redacted() == "unix://:***@/var/run/redis.sock?db=3"
    assert SECRET not in repr(url)


def test_sentinel_service_name_from_path_then_environment_then_lmcache_default():
    assert parse_remote_url("redis-sentinel://a:1,b:2/mymaster", environ={}).service_name == "mymaster"
    env = {SERVICE_NAME_ENV: "from-env"}
    assert parse_remote_url("redis-sentinel://a:1,b:2/mymaster", environ=env).service_name == "mymaster"
    assert parse_remote_url("redis-sentinel://a:1,b:2", environ=env).service_name == "from-env"
    assert parse_remote_url("redis-sentinel://a:1,b:2", environ={}).service_name == DEFAULT_SERVICE_NAME


def test_sentinel_url_keeps_credentials_for_the_master_and_redacts_them():
    url = parse_remote_url(f"redis-sentinel://bob:{SECRET}@a:26379,b:26380/mymaster?db=2", environ={})
    assert url.sentinel and not url.cluster
    assert (url.username, url.password, url.db) == ("bob", SECRET, 2)
    assert url.redacted() == "redis-sentinel://bob:***@a:26379,b:26380/mymaster?db=2"


def test_lmcache_valkey_cluster_node_list_may_have_spaces_after_commas():
    url = parse_remote_url("valkey://n1:7000, n2:7001, n3:7002", environ={}, cluster=True)
    assert url.cluster and url.nodes == (("n1", 7000), ("n2", 7001), ("n3", 7002))


def test_several_valkey_nodes_without_cluster_mode_are_one_server_too_many():
    with pytest.raises(ValueError, match="valkey_mode: cluster"):
        parse_remote_url("valkey://n1:7000,n2:7001", environ={})


def test_cluster_mode_takes_one_seed_node_too():
    url = parse_remote_url("valkey://seed:7000", environ={}, cluster=True)
    assert url.cluster and url.redacted() == "valkey://seed:7000"


def test_resp_scheme_is_the_redis_protocol():
    url = parse_remote_url("resp://localhost:6379", environ={})
    assert (url.nodes, url.tls, url.cluster) == ((("localhost", 6379),), False, False)


def test_credentials_and_database_from_elsewhere():
    url = parse_remote_url("valkey://h:6379", environ={})
    url = with_database(with_credentials(url, "user", SECRET), 4)
    assert (url.username, url.password, url.db) == ("user", SECRET, 4)
    own = with_credentials(parse_remote_url("valkey://me:mine@h", environ={}), "user", SECRET)
    assert (own.username, own.password) == ("me", "mine")  # the URL's own win
    with pytest.raises(ValueError, match="only database 0"):
        with_database(parse_remote_url("valkey://h", environ={}, cluster=True), 2)
    with pytest.raises(ValueError, match="cannot be reached as a cluster"):
        parse_remote_url("unix:///s.sock", environ={}, cluster=True)
