import pytest

from connector.tiers.remote_url import PASSWORD_ENV, RemoteURL, parse_remote_url

SECRET = "s3cr3t-Pa55"


def test_plain_redis_url_gives_host_port_and_db():
    url = parse_remote_url("redis://cache.local:6380/2", environ={})
    assert url == RemoteURL("redis", (("cache.local", 6380),), 2, tls=False, cluster=False)
    assert url.redacted() == "redis://cache.local:6380/2"


def test_database_defaults_to_zero():
    assert parse_remote_url("redis://h:1", environ={}).db == 0
    assert parse_remote_url("redis://h:1/", environ={}).db == 0


@pytest.mark.parametrize(
    ("scheme", "tls", "cluster"),
    [
        ("redis", False, False),
        ("valkey", False, False),
        ("rediss", True, False),
        ("valkeys", True, False),
        ("redis-cluster", False, True),
        ("rediss-cluster", True, True),
        ("valkey-cluster", False, True),
        ("valkeys-cluster", True, True),
        ("REDIS", False, False),
    ],
)
def test_scheme_decides_tls_and_cluster(scheme, tls, cluster):
    url = parse_remote_url(f"{scheme}://h:6379", environ={})
    assert (url.scheme, url.tls, url.cluster) == (scheme.lower(), tls, cluster)


def test_cluster_url_lists_every_node_given():
    url = parse_remote_url("redis-cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002", environ={})
    assert url.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    assert url.redacted() == "redis-cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002"


def test_ipv6_host_in_brackets():
    url = parse_remote_url("redis://[fe80::1]:6379/1", environ={})
    assert url.nodes == (("fe80::1", 6379),) and url.db == 1
    assert url.redacted() == "redis://[fe80::1]:6379/1"


def test_password_only_and_user_with_password_from_url():
    url = parse_remote_url(f"redis://:{SECRET}@h:1", environ={})
    assert (url.username, url.password) == (None, SECRET)
    url = parse_remote_url(f"redis://alice:{SECRET}@h:1", environ={})
    assert (url.username, url.password) == ("alice", SECRET)


def test_percent_encoded_and_raw_special_characters_in_password():
    assert parse_remote_url("redis://:p%40ss%2Fw@h:1", environ={}).password == "p@ss/w"
    # An unencoded '@' or '/' still works: the last '@' ends the credentials.
    assert parse_remote_url("redis://:p@ss/w@h:1/3", environ={}).password == "p@ss/w"


def test_password_from_environment_when_url_has_none():
    url = parse_remote_url("redis://h:1", environ={PASSWORD_ENV: SECRET})
    assert url.password == SECRET
    url = parse_remote_url("redis://bob@h:1", environ={PASSWORD_ENV: SECRET})
    assert (url.username, url.password) == ("bob", SECRET)


def test_url_password_wins_over_environment():
    url = parse_remote_url("redis://:from-url@h:1", environ={PASSWORD_ENV: "from-env"})
    assert url.password == "from-url"


def test_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    assert parse_remote_url("redis://h:1").password == SECRET
    monkeypatch.setenv(PASSWORD_ENV, "")
    assert parse_remote_url("redis://h:1").password is None


@pytest.mark.parametrize(
    "text",
    [f"redis://:{SECRET}@h:1/0", f"redis://alice:{SECRET}@h:1", f"rediss-cluster://:{SECRET}@a:1,b:2"],
)
def test_password_never_shows_in_redacted_str_or_repr(text):
    url = parse_remote_url(text, environ={})
    for shown in (url.redacted(), str(url), repr(url), f"{url}", f"{url!r}"):
        assert SECRET not in shown
    assert ":***@" in url.redacted()


def test_environment_password_never_shows_either():
    url = parse_remote_url("redis://h:1", environ={PASSWORD_ENV: SECRET})
    assert SECRET not in repr(url) and SECRET not in str(url)
    assert url.redacted() == "redis://:***@h:1/0"


def test_username_is_kept_in_redacted_form():
    assert parse_remote_url("redis://alice@h:1", environ={}).redacted() == "redis://alice@h:1/0"


def test_tls_options_from_query():
    url = parse_remote_url("rediss://h:1?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=none", environ={})
    assert (url.ssl_ca_certs, url.ssl_cert_reqs) == ("/etc/ca.pem", "none")
    assert parse_remote_url("rediss://h:1", environ={}).ssl_cert_reqs == "required"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "must look like"),
        ("h:6379", "must look like"),
        ("http://h:1", "scheme 'http' is not a Redis scheme"),
        ("redis://", "missing a host"),
        ("redis://:1", "missing a host"),
        ("redis://h:abc", "not a number from 1 to 65535"),
        ("redis://h:0", "not a number from 1 to 65535"),
        ("redis://h:65536", "not a number from 1 to 65535"),
        ("redis://[::1:1", "unclosed"),
        ("redis://h:1/x", "database 'x' is not a number"),
        ("redis://h:1/-1", "is not a number"),
        ("redis://a:1,b:2", "use redis-cluster://"),
        ("rediss://a:1,b:2", "use rediss-cluster://"),
        ("redis-cluster://a:1,b:2/3", "only database 0"),
        ("redis-cluster://a:1,,b:2", "missing a host"),
        ("redis://h:1#frag", "fragment"),
        ("redis://h:1?nope=3", "option 'nope' is not supported"),
        ("redis://h:1?socket_timeout=abc", "option 'socket_timeout' has an invalid value"),
        ("redis://h:1?socket_timeout=0", "must be a number of seconds > 0"),
        ("redis://h:1?decode_responses=true", "binary records"),
        ("redis://h:1?db=x", "option 'db' has an invalid value"),
        ("unix://relative.sock", "absolute path"),
        ("unix://", "absolute path"),
        ("redis://fe80::1:6379", "IPv6 address in brackets"),
        ("redis-sentinel://a:1,b:2/x/y", "one path part"),
        ("redis-cluster://a:1?db=2", "only database 0"),
        ("redis://h:1?ssl_ca_certs=/x", "needs a TLS scheme"),
        ("rediss://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("redis://h :1", "whitespace"),
    ],
)
def test_bad_urls_say_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        parse_remote_url(text, environ={})


@pytest.mark.parametrize(
    "text",
    [
        f"redis://:{SECRET}@h:0",
        f"redis://:{SECRET}@h:port",
        f"unix://:{SECRET}@sock",
        f"redis-sentinel://:{SECRET}@a:1,b:x",
        f"redis://u:{SECRET}@h:1/x",
        f"redis://:{SECRET}@a:1,b:2",
        f"redis-cluster://:{SECRET}@a:1/5",
        f"redis://:{SECRET}@h:1?foo=1",
        f"ftp://:{SECRET}@h:1",
        f"redis://:{SECRET}@",
    ],
)
def test_errors_never_echo_the_password(text):
    with pytest.raises(ValueError) as info:
        parse_remote_url(text, environ={})
    assert SECRET not in str(info.value)


def test_cluster_accepts_explicit_database_zero():
    assert parse_remote_url("redis-cluster://a:1/0", environ={}).db == 0
