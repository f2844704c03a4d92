"""TLS to the store checks the server's name, whatever redis-py's default
(``store.clients``: ``ssl_check_hostname`` passed explicitly, on unless the
URL's ``ssl_check_hostname=false`` turns it off). A real ``redis-server``
serves TLS with a certificate its CA issued for another name
(``redis.elsewhere.example``): one server, a Sentinel and a Redis Cluster URL
that reach it are all refused at the start-up check with one line; with the
check turned off the handshake goes through."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import store.clients
from pacing.settings.checks import SettingsError
from pacing.settings.store import STORE_FLAG, StoreSettings
from store.clients import connect
from store.preflight import check
from tools.redis_tls import Pki, _signed, make_pki, redis_tls_server

OTHER_NAME = "redis.elsewhere.example"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The test PKI, its server certificate issued for ``OTHER_NAME`` only."""
    directory = tmp_path_factory.mktemp("pki")
    pki = make_pki(directory)
    cert, key = _signed(
        directory,
        "elsewhere",
        (pki.ca, directory / "test-ca.key"),
        f"subjectAltName=DNS:{OTHER_NAME}\nextendedKeyUsage=serverAuth",
    )
    return dataclasses.replace(pki, server_cert=cert, server_key=key)


@pytest.fixture(scope="module")
def port(pki: Pki) -> Iterator[int]:
    with redis_tls_server(pki) as tls_port:
        yield tls_port


def store_url(scheme: str, port: int, pki: Pki, **options: str | Path) -> str:
    """A URL of ``scheme`` that reaches the TLS server on ``port``, trusting
    the CA that signed its certificate."""
    path = {"rediss": "/0", "rediss+cluster": "", "rediss+sentinel": "/mymaster"}
    files = {
        "ssl_ca_certs": pki.ca,
        "ssl_certfile": pki.client_cert,
        "ssl_keyfile": pki.client_key,
    }
    query = "&".join(f"{k}={v}" for k, v in {**files, **options}.items())
    return f"{scheme}://127.0.0.1:{port}{path[scheme]}?{query}"


SCHEMES = ("rediss", "rediss+cluster", "rediss+sentinel")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_certificate_for_another_name_is_refused_with_one_line(
    scheme: str, port: int, pki: Pki
) -> None:
    with pytest.raises(SettingsError) as refused:
        check(StoreSettings(store_url(scheme, port, pki)))
    message = str(refused.value)
    print(f"\n{scheme}: {message}")
    assert message.startswith(f"{STORE_FLAG}: the TLS handshake with the store failed")
    assert "mismatch" in message  # the name, not the CA: the CA signed it
    assert "\n" not in message
    assert "ssl_keyfile" not in message  # not the connection's settings


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_url_can_turn_the_name_check_off_and_the_handshake_goes_through(
    scheme: str, port: int, pki: Pki
) -> None:
    url = store_url(scheme, port, pki, ssl_check_hostname="false")
    check(StoreSettings(url))  # no TLS refusal (a lone server is no cluster)
    if scheme == "rediss":
        client = connect(url, timeout_s=5.0)
        assert isinstance(client, redis.Redis)
        assert client.ping()


def test_a_name_check_value_other_than_true_or_false_is_refused(pki: Pki) -> None:
    with pytest.raises(ValueError, match="ssl_check_hostname must be true or false"):
        StoreSettings(store_url("rediss", 6379, pki, ssl_check_hostname="0"))


def test_the_name_check_is_no_option_without_tls() -> None:
    with pytest.raises(ValueError, match="not taken here"):
        StoreSettings("redis://127.0.0.1:6379/0?ssl_check_hostname=true")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_client_kind_is_given_the_name_check_explicitly(
    scheme: str, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not left to redis-py's default, which was off before redis-py 6."""
    built: dict[str, Any] = {}

    def cluster(**kwargs: Any) -> object:
        built.update(kwargs)
        return object()

    monkeypatch.setattr(store.clients, "RedisCluster", cluster)
    client = connect(store_url(scheme, 6379, pki))
    if isinstance(client, store.clients.LazyCluster):
        client.get()
        kinds = {"cluster nodes": built}
    else:
        pool: Any = client.connection_pool
        kinds = {"data nodes": pool.connection_kwargs}
        if scheme == "rediss+sentinel":
            sentinel = pool.sentinel_manager.sentinels[0]
            kinds["sentinels"] = sentinel.connection_pool.connection_kwargs
    for kind, kwargs in kinds.items():
        assert kwargs.get("ssl_check_hostname") is True, kind
