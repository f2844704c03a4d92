"""Settings of the control plane: command-line flags, their home in vLLM's
``additional_config``, and the secrets they point to.

The bearer token never travels in ``additional_config`` (vLLM logs its config):
it is read in the engine-core process from ``--output-rate-control-token-file``
or, failing that, the ``OUTPUT_RATE_CONTROL_TOKEN`` environment variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from control.server import TlsConfig
from engine_ext.config import flag_dest

#: Key of our settings inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "output_rate_control"
DEFAULT_ADDRESS = "127.0.0.1:50151"
#: ``--output-rate-control-address`` value that runs no control plane.
ADDRESS_OFF = "off"
TOKEN_ENV = "OUTPUT_RATE_CONTROL_TOKEN"

ADDRESS_FLAG = "--output-rate-control-address"
CONFIG_FLAG = "--user-output-rate-config"
TOKEN_FILE_FLAG = "--output-rate-control-token-file"
TLS_CERT_FLAG = "--output-rate-control-tls-cert"
TLS_KEY_FLAG = "--output-rate-control-tls-key"
TLS_CLIENT_CA_FLAG = "--output-rate-control-tls-client-ca"


class ControlSettingsError(ValueError):
    """A control-plane setting is invalid; the message names the flag."""


@dataclass(frozen=True)
class ControlSettings:
    """Where and how the control plane listens, and its config file."""

    address: str = DEFAULT_ADDRESS
    config_path: str | None = None
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ControlSettingsError(
                f"{TLS_CERT_FLAG} and {TLS_KEY_FLAG} must be given together"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ControlSettingsError(
                f"{TLS_CLIENT_CA_FLAG} (mTLS) needs {TLS_CERT_FLAG} and {TLS_KEY_FLAG}"
            )

    @property
    def enabled(self) -> bool:
        """Whether a control plane should run."""
        return self.address != ADDRESS_OFF

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ControlSettings:
        """Reads the flags ``add_cli_args`` added."""
        return cls(
            **{f.name: getattr(args, flag_dest(_FLAGS[f.name])) for f in fields(cls)}
        )

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None
    ) -> ControlSettings:
        """Reads our entry of ``additional_config`` (absent: all defaults)."""
        entry = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        if not isinstance(entry, Mapping):
            raise ControlSettingsError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be an object"
            )
        known = {f.name for f in fields(cls)}
        unknown = set(entry) - known
        if unknown:
            raise ControlSettingsError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] has unknown keys "
                f"{sorted(unknown)}; expected {sorted(known)}"
            )
        return cls(**entry)

    def to_additional_config(self) -> dict[str, Any]:
        """Our entry for ``additional_config`` (JSON-serialisable, no secrets)."""
        return asdict(self)

    def auth_token(self) -> str | None:
        """The bearer token: the token file's content (stripped), else the
        environment variable, else ``None``."""
        if self.token_file is not None:
            token = _read(self.token_file, TOKEN_FILE_FLAG).decode().strip()
            if not token:
                raise ControlSettingsError(
                    f"{TOKEN_FILE_FLAG} {self.token_file} is empty"
                )
            return token
        return os.environ.get(TOKEN_ENV) or None

    def tls(self) -> TlsConfig | None:
        """The TLS material, read from the files; ``None`` without TLS."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsConfig(
            cert_chain=_read(self.tls_cert, TLS_CERT_FLAG),
            private_key=_read(self.tls_key, TLS_KEY_FLAG),
            client_ca=(
                None
                if self.tls_client_ca is None
                else _read(self.tls_client_ca, TLS_CLIENT_CA_FLAG)
            ),
        )


def add_cli_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds the control plane's flags to ``parser`` (or an argument group)."""
    parser.add_argument(
        ADDRESS_FLAG,
        default=DEFAULT_ADDRESS,
        help="host:port of the gRPC control plane (limits, per-user state); "
        f"'{ADDRESS_OFF}' runs none. Non-loopback addresses need a token or mTLS.",
    )
    parser.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="PATH",
        help="JSON or YAML file of limits, loaded at start (it wins over the "
        "flags), rewritten after every change, watched for edits.",
    )
    parser.add_argument(
        TOKEN_FILE_FLAG,
        default=None,
        metavar="PATH",
        help=f"File holding the bearer token clients must send (default: "
        f"${TOKEN_ENV}, if set).",
    )
    parser.add_argument(
        TLS_CERT_FLAG,
        default=None,
        metavar="PEM",
        help="Server certificate chain (enables TLS).",
    )
    parser.add_argument(
        TLS_KEY_FLAG, default=None, metavar="PEM", help="Server private key."
    )
    parser.add_argument(
        TLS_CLIENT_CA_FLAG,
        default=None,
        metavar="PEM",
        help="CA of client certificates; clients without one are refused (mTLS).",
    )


#: Settings field -> its flag.
_FLAGS = {
    "address": ADDRESS_FLAG,
    "config_path": CONFIG_FLAG,
    "token_file": TOKEN_FILE_FLAG,
    "tls_cert": TLS_CERT_FLAG,
    "tls_key": TLS_KEY_FLAG,
    "tls_client_ca": TLS_CLIENT_CA_FLAG,
}


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ControlSettingsError(f"{flag} {path}: {exc.strerror}") from None
