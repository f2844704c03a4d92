"""The store's start-up check, in the API-server process before the model
loads: one call to the store with the engines' own settings. A store that
refuses this server (its TLS certificate not trusted by ``ssl_ca_certs``, a
client certificate it does not accept, a wrong password or user) ends the
start with one line naming the flag: every engine would fail the same way,
forever. A store that does not answer is only logged: engines start degraded
and claim once it answers (``store.claimer``)."""

from __future__ import annotations

import logging
import ssl

from redis.exceptions import AuthenticationError, RedisClusterException, RedisError

from pacing.settings.checks import SettingsError
from pacing.settings.store import STORE_FLAG, StoreSettings
from store.clients import LazyCluster, connect

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: The check waits longer than a claim may: a slow first connection (TLS
#: handshakes, a cluster's layout) is not a refusal.
CHECK_TIMEOUT_S = 5.0


def check(settings: StoreSettings) -> None:
    """Raises SettingsError when the store refuses this server; see the module
    docstring."""
    try:
        client = connect(
            settings.url, password=settings.password(), timeout_s=CHECK_TIMEOUT_S
        )
        served = client.get() if isinstance(client, LazyCluster) else client
        served.ping()
        served.close()
    except AuthenticationError as error:
        raise SettingsError(
            f"{STORE_FLAG}: the store refused the credentials: {_one_line(error)}"
        ) from None
    except (RedisError, RedisClusterException) as error:
        refusal = _tls_refusal(error)
        if refusal is not None:
            raise SettingsError(
                f"{STORE_FLAG}: the TLS handshake with the store failed: {refusal}"
            ) from None
        logger.warning(
            "output-rate store not reachable at start-up (engines start degraded): %s",
            _one_line(error),
        )


def _tls_refusal(error: BaseException) -> str | None:
    """The TLS error behind ``error`` (redis-py wraps it, a cluster client
    twice), as one line; None when there is none."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return _one_line(seen)
        seen = seen.__cause__ or seen.__context__
    # Sentinel's client folds each sentinel's error into its message, after
    # the connection's settings (``ssl_*`` whatever went wrong).
    text = _one_line(error)
    start = text.find("[SSL")
    return None if start < 0 else text[start:]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
