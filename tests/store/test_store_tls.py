"""The store over TLS with a real ``redis-server`` (Debian's is built with TLS):
certificates made with ``openssl`` in a temporary directory (``tools.redis_tls``),
``rediss://`` with ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile``. A
store this server cannot trust, or that refuses it, ends the start in vLLM's
own flag parsing with one line and exit code 2 (``store.preflight``); one that
does not answer is only logged."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from engine_ext.plugin import register
from pacing.settings.store import STORE_FLAG, StoreSettings
from store.clients import connect
from store.plugin import register as register_store
from store.redis_store import RedisStore
from tools.redis_server import free_port
from tools.redis_tls import Pki, make_pki, redis_tls_server

register()
register_store()  # its entry point, should vLLM not have loaded it yet


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_port(pki: Pki) -> Iterator[int]:
    with redis_tls_server(pki) as port:
        yield port


def url(port: int, **files: Path) -> str:
    query = "&".join(f"{name}={path}" for name, path in files.items())
    return f"rediss://127.0.0.1:{port}/0?{query}"


def trusted(pki: Pki, port: int) -> str:
    return url(
        port,
        ssl_ca_certs=pki.ca,
        ssl_certfile=pki.client_cert,
        ssl_keyfile=pki.client_key,
    )


def start(store_url: str) -> AsyncEngineArgs:
    """vLLM's own flag parsing with pacing and the store, the control plane
    off (its default address may be taken on a shared machine)."""
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "m",
            "--default-user-output-tokens-per-second",
            "10",
            STORE_FLAG,
            store_url,
            "--output-rate-control-address",
            "off",
        ]
    )
    return AsyncEngineArgs.from_cli_args(args)


def test_rediss_with_a_ca_and_a_client_certificate_serves_the_store(
    pki: Pki, tls_port: int
) -> None:
    settings = StoreSettings(trusted(pki, tls_port))
    assert set(settings.tls_files) == {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"}
    store = RedisStore(connect(settings.url, timeout_s=5.0))
    assert store.claim("alice", 1, 10).granted == 1
    additional = start(settings.url).additional_config
    assert additional["output_rate"]["store"]["url"] == settings.url


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("a CA that did not sign the server's certificate", "verify failed"),
        ("no client certificate", ""),
    ],
)
def test_a_store_that_refuses_this_server_ends_the_start_with_one_line(
    pki: Pki, tls_port: int, capsys: pytest.CaptureFixture[str], case: str, reason: str
) -> None:
    store_url = {
        "a CA that did not sign the server's certificate": url(
            tls_port,
            ssl_ca_certs=pki.other_ca,
            ssl_certfile=pki.client_cert,
            ssl_keyfile=pki.client_key,
        ),
        "no client certificate": url(tls_port, ssl_ca_certs=pki.ca),
    }[case]
    with pytest.raises(SystemExit) as exit_info:
        start(store_url)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    print(f"\n{case}: {err}")
    assert err.count("\n") == 1
    assert err.startswith(
        f"error: {STORE_FLAG}: the TLS handshake with the store failed: "
    )
    assert reason in err


def test_a_store_that_does_not_answer_is_logged_and_the_start_goes_on(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    closed = free_port()  # nothing listens there
    with caplog.at_level(logging.WARNING):
        start(trusted(pki, closed))
    assert "output-rate store not reachable at start-up" in caplog.text
