"""Start-up checks of the control plane's settings, run in the API-server process
before the model loads: a mistake then costs seconds, not a model load.

They call the same functions the engine-core process uses when it starts the
control plane (``control.runner.serve``), which checks everything again: a file
can change, or the port be taken, in between.
"""

from __future__ import annotations

import os
import socket

from control import secrets
from control.errors import InvalidArgument
from control.persistence import ConfigFile, check_default
from control.server import BindRefused, check_authenticated, check_token_over_tls
from pacing.settings.checks import SettingsError
from pacing.settings.flags import (
    ADDRESS_FLAG,
    CONFIG_FLAG,
    TLS_CERT_FLAG,
    TLS_CLIENT_CA_FLAG,
    TLS_KEY_FLAG,
    TOKEN_ENV,
    TOKEN_FILE_FLAG,
)
from pacing.settings.model import ControlSettings


def check(settings: ControlSettings, default_rate: int | None) -> None:
    """Raises SettingsError, naming the flag and the cause, for the first
    setting the control plane would fail on at start: token or TLS files that
    cannot be read (or an empty token file), a non-loopback address without a
    token or mTLS, or with a token and no TLS, a limits file that is not a
    readable, valid table (or, when missing, whose directory cannot hold one),
    no default limit in the file or the flags' policy (``default_rate``), a
    port that cannot be bound. With the control plane off only the limits
    file is checked: it is loaded and watched all the same."""
    if not settings.enabled:
        if settings.config_path is not None:
            check_config_file(settings.config_path, default_rate)
        return
    auth_token, tls = secrets.auth_token(settings), secrets.tls(settings)
    try:
        check_authenticated(settings.address, auth_token=auth_token, tls=tls)
    except BindRefused as exc:
        raise SettingsError(
            f"{ADDRESS_FLAG}: {exc} ({TOKEN_FILE_FLAG} or ${TOKEN_ENV} sets a "
            f"token, {TLS_CLIENT_CA_FLAG} mTLS)"
        ) from None
    try:
        check_token_over_tls(settings.address, auth_token=auth_token, tls=tls)
    except BindRefused as exc:
        raise SettingsError(
            f"{ADDRESS_FLAG}: {exc} ({TLS_CERT_FLAG} and {TLS_KEY_FLAG} set TLS)"
        ) from None
    if settings.config_path is not None:
        check_config_file(settings.config_path, default_rate)
    check_port_free(settings.address)


def check_config_file(path: str, default_rate: int | None) -> None:
    """Raises SettingsError unless ``path`` holds a valid limits table or
    is missing in a writable directory (the control plane then creates it from
    the flags), and the file or ``default_rate`` (the flags') gives a default
    limit."""
    try:
        file = ConfigFile(path)
        doc = file.load()
        check_default(
            default_rate if doc is None else doc.policy.default_rate or default_rate,
            path,
        )
        if doc is not None:
            return
    except InvalidArgument as exc:
        raise SettingsError(f"{CONFIG_FLAG}: {exc}") from None
    except OSError as exc:
        raise SettingsError(f"{CONFIG_FLAG} {path}: {exc.strerror}") from None
    # Where ConfigFile.write will put it: through a symlink, at its target.
    directory = file.path.resolve().parent
    if not directory.is_dir():
        raise SettingsError(
            f"{CONFIG_FLAG} {path}: the file is missing and its directory "
            f"{directory} does not exist, so it cannot be created"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SettingsError(
            f"{CONFIG_FLAG} {path}: the file is missing and its directory "
            f"{directory} is not writable, so it cannot be created"
        )


def check_port_free(address: str) -> None:
    """Raises SettingsError unless a listening socket can be bound to
    ``address`` (``host:port``) on at least one address its host resolves to,
    as gRPC binds: ``SO_REUSEADDR`` on, ``SO_REUSEPORT`` off. The socket is
    closed again at once. Unix-socket addresses and port 0 are not checked (gRPC
    replaces a stale socket file; port 0 picks a free port)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise SettingsError(
            f"{ADDRESS_FLAG} {address}: expected HOST:PORT with a port in 0..65535"
        )
    if port == 0:
        return
    try:
        candidates = socket.getaddrinfo(
            host.strip("[]") or None,
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
    except socket.gaierror as exc:
        raise SettingsError(
            f"{ADDRESS_FLAG} {address}: cannot resolve the host: {exc.strerror}"
        ) from None
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in candidates:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
                probe.listen()
            return
        except OSError as exc:
            error = exc
    reason = error.strerror if error is not None else "no address to bind"
    raise SettingsError(f"{ADDRESS_FLAG} {address}: cannot listen: {reason}")
