"""Page tokens (AIP-158): tamper-evident, bound to the request that made them.

A token is ``base64url(payload) "." base64url(HMAC-SHA256(key, payload))`` where
the payload is JSON ``{"s": scope, "p": position}``: ``scope`` names the
collection and the request parameters a token may only be reused with (e.g. its
``order_by``), ``position`` is the sort key of the last item served. Lists
resume *after* that key (keyset pagination), so an item inserted or removed
between two pages never shifts the others: each item that exists throughout is
served exactly once, in order.

The key is random per process: tokens die with the process that issued them,
and clients cannot forge positions.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from typing import Any

from control.errors import InvalidArgument

#: Longest token accepted (a position holds at most a 256-byte user id and a few
#: numbers, about 500 characters once encoded).
MAX_TOKEN_CHARS = 2048
_MAC_BYTES = 16


class PageTokens:
    """Issues and checks page tokens with one HMAC key."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    def encode(self, scope: str, position: list[Any]) -> str:
        """A token resuming ``scope`` after ``position`` (JSON-serialisable)."""
        payload = json.dumps(
            {"s": scope, "p": position}, separators=(",", ":"), ensure_ascii=False
        ).encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def decode(self, token: str, scope: str) -> list[Any]:
        """The position of ``token``; InvalidArgument if it was not issued by this
        process for ``scope``, or was altered."""
        if len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
            raise _invalid()
        body, mac = token.split(".")
        try:
            payload = _unb64(body)
            valid = hmac.compare_digest(_unb64(mac), self._mac(payload))
        except (binascii.Error, ValueError):
            raise _invalid() from None
        if not valid:
            raise _invalid()
        content = json.loads(payload)  # our own JSON: the MAC matched
        if content["s"] != scope:
            raise InvalidArgument(
                "page_token belongs to a request with other parameters (such as "
                "order_by); repeat the request that returned it"
            )
        position: list[Any] = content["p"]
        return position

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:_MAC_BYTES]


def _invalid() -> InvalidArgument:
    return InvalidArgument(
        "page_token is not valid: pass next_page_token unchanged, from this server "
        "since its last restart"
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
