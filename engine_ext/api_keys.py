"""The API key (``--api-key``, else ``VLLM_API_KEY``) on every way into the
engine, not only where vLLM 0.32 checks it.

vLLM's own authentication middleware asks for the key only on paths under
``/v1``, ``/v2``, ``/inference`` and ``/cohere``; ``/invocations``,
``/generative_scoring``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``
and the administration routes of dev mode reach the engine without it. The
HTTP guard (``engine_ext.http_guard``) asks for it on every path but the probes
in ``KEY_FREE_ROUTES``, so a route a new vLLM adds is covered before anyone has
reviewed it.
"""

from __future__ import annotations

import hashlib
import hmac
from argparse import Namespace
from collections.abc import Mapping, Sequence
from typing import Final

#: Path -> methods answered without the key: liveness and load probes (for
#: Kubernetes, SageMaker and routers) and Prometheus's scrape, none of which
#: submits work to the engine on a client's behalf. vLLM leaves them open too.
KEY_FREE_ROUTES: Final[Mapping[str, frozenset[str]]] = {
    "/health": frozenset({"GET", "HEAD"}),
    "/ping": frozenset({"GET", "HEAD", "POST"}),
    "/load": frozenset({"GET", "HEAD"}),
    "/version": frozenset({"GET", "HEAD"}),
    "/metrics": frozenset({"GET", "HEAD"}),
}
#: The body vLLM answers a request without a valid key with (status 401).
UNAUTHORIZED_BODY: Final = b'{"error":"Unauthorized"}'


def api_keys_of(args: Namespace, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys a server started with ``args`` accepts, as vLLM reads them:
    ``--api-key`` (repeatable) if given, else ``VLLM_API_KEY``; empty ones
    are no keys."""
    given = getattr(args, "api_key", None) or [environ.get("VLLM_API_KEY")]
    return tuple(key for key in given if key)


def needs_key(kind: str, method: str | None, path: str) -> bool:
    """Whether a request of ASGI scope ``kind`` (``http`` or ``websocket``)
    to ``path`` must carry the key. CORS preflights (``OPTIONS``) carry no
    credentials and run nothing."""
    if kind == "websocket":
        return True
    if method == "OPTIONS":
        return False
    if path.startswith("/metrics/"):  # the Prometheus app is mounted there
        path = "/metrics"
    return method not in KEY_FREE_ROUTES.get(path, frozenset())


class ApiKeys:
    """The accepted keys, kept as SHA-256 digests and compared in constant
    time: how long a refusal takes tells nothing about any key."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def admits(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether ``headers`` (ASGI's) carry ``Authorization: Bearer KEY``
        with one of the keys, once."""
        values = [value for name, value in headers if name.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        sent = hashlib.sha256(token).digest()
        matched = False
        for digest in self._digests:  # every key compared, whichever matches
            matched |= hmac.compare_digest(sent, digest)
        return matched
