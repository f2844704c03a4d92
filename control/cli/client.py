"""What every ``output-rate-ctl`` command stands on: the channel to the control
plane, the client that makes its calls, and how a command ends.

Invariant: every call goes through ``Client``, so each carries the bearer token
and the ``--timeout`` deadline (a stream carries the token only: a watch runs
until it is stopped); a command ends with one of the three exit statuses, a
problem with the command line or a local file raised as ``UsageError``. The
token comes from ``--token-file`` or the environment, never from the command
line, and goes to a non-loopback address only over TLS.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from control.server import MAX_MESSAGE_BYTES, is_loopback
from pacing.settings.flags import TOKEN_ENV
from protos.outputrate.v1 import output_rate_pb2_grpc as _pb2_grpc

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with the command line or a local file (exit status 2)."""


class Client:
    """The stub plus what every call carries (credentials, deadline)."""

    def __init__(self, channel: grpc.Channel, token: str | None, timeout: float):
        self.stub = _pb2_grpc.OutputRateControlStub(channel)
        self._metadata = (
            () if token is None else (("authorization", f"Bearer {token}"),)
        )
        self._timeout = timeout

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(
            request, metadata=self._metadata, timeout=self._timeout
        )

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        responses: Iterator[Any] = getattr(self.stub, method)(
            request, metadata=self._metadata
        )
        return responses

    def pages(self, method: str, request: Any, field: str) -> Iterator[Any]:
        """Every item of a paginated list, page after page."""
        while True:
            response = self.call(method, request)
            yield from getattr(response, field)
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token


def bearer_token(args: argparse.Namespace) -> str | None:
    """The token: ``--token-file``'s content (stripped), else ``$TOKEN_ENV``,
    else ``None``; printable ASCII, as a gRPC metadata value must be."""
    if args.token_file is None:
        token = os.environ.get(TOKEN_ENV) or None
        source = f"${TOKEN_ENV}"
    else:
        source = f"--token-file {args.token_file}"
        try:
            token = Path(args.token_file).read_text(errors="replace").strip()
        except OSError as exc:
            raise UsageError(f"{source}: {exc.strerror}") from None
        if not token:
            raise UsageError(f"{source} is empty")
    if token is not None and not all(" " <= ch <= "~" for ch in token):
        raise UsageError(f"{source}: the token must be printable ASCII")
    return token


def open_channel(args: argparse.Namespace, token: str | None) -> grpc.Channel:
    """The channel ``--address`` and the ``--tls-*`` arguments ask for; refuses
    to carry ``token`` in clear text to an address beyond loopback."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    if (args.tls_cert is None) != (args.tls_key is None):
        # gRPC aborts the process on a certificate without its key.
        raise UsageError("--tls-cert and --tls-key go together")
    if not (args.tls_ca or args.tls_cert):
        if token is not None and not is_loopback(args.address):
            raise UsageError(
                f"refusing to send the token to {args.address} in clear text: it "
                "is not a loopback address; give --tls-ca (TLS) or use a loopback "
                "address such as 127.0.0.1"
            )
        return grpc.insecure_channel(args.address, options=options)
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_optional(args.tls_ca),
            private_key=_read_optional(args.tls_key),
            certificate_chain=_read_optional(args.tls_cert),
        )
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None
    return grpc.secure_channel(args.address, credentials, options=options)


def _read_optional(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()
