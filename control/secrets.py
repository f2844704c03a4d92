"""The secrets the control plane's settings point to, read where the control
plane runs (and by the API process's start-up checks), never carried in
``additional_config`` (vLLM logs its config).

The bearer token comes from ``--output-rate-control-token-file`` or, failing
that, the ``OUTPUT_RATE_CONTROL_TOKEN`` environment variable.
"""

from __future__ import annotations

import os
from pathlib import Path

from control.server import TlsConfig
from pacing.settings.checks import SettingsError
from pacing.settings.flags import (
    TLS_CERT_FLAG,
    TLS_CLIENT_CA_FLAG,
    TLS_KEY_FLAG,
    TOKEN_ENV,
    TOKEN_FILE_FLAG,
)
from pacing.settings.model import ControlSettings


def auth_token(settings: ControlSettings) -> str | None:
    """The bearer token: the token file's content (stripped), else the
    environment variable, else ``None``."""
    if settings.token_file is not None:
        token = _read(settings.token_file, TOKEN_FILE_FLAG).decode().strip()
        if not token:
            raise SettingsError(f"{TOKEN_FILE_FLAG} {settings.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def tls(settings: ControlSettings) -> TlsConfig | None:
    """The TLS material, read from the files; ``None`` without TLS."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return TlsConfig(
        cert_chain=_read(settings.tls_cert, TLS_CERT_FLAG),
        private_key=_read(settings.tls_key, TLS_KEY_FLAG),
        client_ca=(
            None
            if settings.tls_client_ca is None
            else _read(settings.tls_client_ca, TLS_CLIENT_CA_FLAG)
        ),
    )


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"{flag} {path}: {exc.strerror}") from None
