"""The cluster and Sentinel forms of ``--output-rate-store`` (``pacing.store_url``)
and the clients ``store.clients.connect`` builds from them, without connecting
(the one-server forms are in ``tests/store/test_store_settings.py``)."""

from __future__ import annotations

import pytest
import redis

from pacing.settings.store import (
    PASSWORD_ENV,
    PASSWORD_FILE_FLAG,
    STORE_FLAG,
    StoreSettings,
)
from pacing.store_url import StoreAddress, Topology, parse_url
from store.clients import LazyCluster, connect

SECRET = "s3cret-Pa55"


@pytest.mark.parametrize(
    ("url", "address"),
    [
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
            {"topology": Topology.CLUSTER, "tls": False},
        ),
        ("redis+cluster://h", {"nodes": (("h", 6379),)}),
        (
            "redis+cluster://engine@[::1]:7000,h:7001",
            {"nodes": (("::1", 7000), ("h", 7001)), "username": "engine"},
        ),
        (
            "rediss+cluster://h:7000?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem"
            "&ssl_keyfile=/k.pem",
            {
                "tls": True,
                "tls_files": {
                    "ssl_ca_certs": "/ca.pem",
                    "ssl_certfile": "/c.pem",
                    "ssl_keyfile": "/k.pem",
                },
            },
        ),
        (
            "redis+sentinel://s1:26380,s2/mymaster",
            {
                "topology": Topology.SENTINEL,
                "nodes": (("s1", 26380), ("s2", 26379)),
                "master": "mymaster",
                "db": 0,
            },
        ),
        ("redis+sentinel://s1/mymaster?db=3", {"db": 3}),
        (
            "rediss+sentinel://engine@s1/m?ssl_ca_certs=/ca.pem",
            {"tls": True, "username": "engine", "master": "m"},
        ),
        ("redis://h:6379/2", {"topology": Topology.SERVER, "db": 2, "nodes": ()}),
        ("unix:///run/r.sock?db=4", {"db": 4}),
    ],
)
def test_a_url_is_taken_apart(url: str, address: dict[str, object]) -> None:
    parsed = parse_url(url)
    assert isinstance(parsed, StoreAddress)
    assert {name: getattr(parsed, name) for name in address} == address
    assert StoreSettings(url).address == parsed


@pytest.mark.parametrize(
    "url",
    [
        f"redis+cluster://:{SECRET}@h:7000",
        f"redis+cluster://engine:{SECRET}@h:7000,h:7001",
        f"redis+sentinel://engine:{SECRET}@s1/mymaster",
        f"redis+sentinel://s1/mymaster?password={SECRET}",
    ],
)
def test_a_password_is_refused_in_every_form(url: str) -> None:
    with pytest.raises(ValueError) as error:
        StoreSettings(url)
    message = str(error.value)
    assert message.startswith(f"{STORE_FLAG} must not hold a password")
    assert PASSWORD_FILE_FLAG in message
    assert PASSWORD_ENV in message
    assert SECRET not in message


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://h:7000/0", "has no path"),
        ("redis+cluster://h:7000?db=1", "option 'db' is not taken"),
        ("redis+cluster://h:7000?ssl_ca_certs=/ca", "'ssl_ca_certs' is not taken"),
        ("redis+cluster:///", "lists HOST:PORT items"),
        ("redis+cluster://h:7000,,h:7001", "lists HOST:PORT items"),
        ("redis+cluster://h:x", "lists HOST:PORT items"),
        ("redis+cluster://h:0", "lists HOST:PORT items"),
        ("redis+cluster://h:70000", "lists HOST:PORT items"),
        ("redis+cluster://h:7000;h:7001", "lists HOST:PORT items"),
        ("redis+sentinel://s1:26379", "names the master after the sentinels"),
        ("redis+sentinel://s1:26379/", "names the master after the sentinels"),
        ("redis+sentinel://s1/a/b", "names the master after the sentinels"),
        ("redis+sentinel://s1/m?db=x", "db must be a database number"),
        ("redis+sentinel://s1/m?socket_timeout=1", "'socket_timeout' is not taken"),
        ("redis+Cluster://h:7000", "must be a URL starting"),
        ("rediss+cluster//h", "must be a URL starting"),
    ],
)
def test_a_bad_url_is_refused_with_one_line_naming_the_flag(
    url: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as error:
        StoreSettings(url)
    text = str(error.value)
    assert text.startswith(STORE_FLAG)
    assert "\n" not in text
    assert url not in text


def test_a_cluster_client_is_built_on_first_use_with_our_timeouts() -> None:
    client = connect(
        "rediss+cluster://engine@127.0.0.1:1,127.0.0.1:2?ssl_ca_certs=/ca.pem",
        password="pw",
        timeout_s=0.03,
    )
    # Nothing listens on ports 1 and 2: building now would raise.
    assert isinstance(client, LazyCluster)
    with pytest.raises(redis.exceptions.RedisClusterException):
        client.get()


def test_a_sentinel_client_asks_the_sentinels_with_our_timeouts_and_tls() -> None:
    client = connect(
        "rediss+sentinel://engine@s1:26380,s2/mymaster?db=2&ssl_ca_certs=/ca.pem",
        password="pw",
        timeout_s=0.03,
    )
    assert isinstance(client, redis.Redis)
    pool = client.connection_pool
    assert pool.service_name == "mymaster"
    kwargs = pool.connection_kwargs
    assert {
        name: kwargs.get(name)
        for name in ("username", "password", "db", "socket_timeout", "ssl_ca_certs")
    } == {
        "username": "engine",
        "password": "pw",
        "db": 2,
        "socket_timeout": 0.03,
        "ssl_ca_certs": "/ca.pem",
    }
    sentinels = pool.sentinel_manager.sentinels
    assert [
        (
            s.connection_pool.connection_kwargs["host"],
            s.connection_pool.connection_kwargs["port"],
        )
        for s in sentinels
    ] == [("s1", 26380), ("s2", 26379)]
    # The sentinels get TLS and the timeouts, never the master's password.
    sentinel_kwargs = sentinels[0].connection_pool.connection_kwargs
    assert sentinel_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert sentinel_kwargs["socket_timeout"] == 0.03
    assert sentinel_kwargs.get("password") is None
