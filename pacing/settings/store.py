"""The global store's settings (``--output-rate-store`` and its flags): where the
Redis deployment is (``pacing.store_url``: one server, a cluster or Sentinel),
which fleet's keys to use there, how long a call may take, what an engine does
once the store has been unreachable for a while (and how many engines it
assumes before it has seen their count), and where its password comes from.

The password is never a setting: it would show in ``ps``, in vLLM's logged
arguments and in ``additional_config`` (which vLLM logs too). A URL holding one
is refused; the settings carry only the password file's *path*, and the process
that connects reads the file, or else ``OUTPUT_RATE_STORE_PASSWORD`` from its
environment (``password``). No Redis import here: the client side is ``store/``.

Errors are ValueError naming the flag; ``pacing.settings.model`` turns them into its
SettingsError. A message never echoes a URL, which may hold a password.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The flags and URL rules are the settings' own, whose readers import them here.
from pacing.store_url import FLEET_FLAG as FLEET_FLAG
from pacing.store_url import PASSWORD_ENV as PASSWORD_ENV
from pacing.store_url import PASSWORD_FILE_FLAG as PASSWORD_FILE_FLAG
from pacing.store_url import STORE_FLAG as STORE_FLAG
from pacing.store_url import TIMEOUT_FLAG as TIMEOUT_FLAG
from pacing.store_url import StoreAddress, parse_url
from pacing.store_url import validate_fleet as validate_fleet
from pacing.store_url import validate_url as validate_url

FAILURE_MODE_FLAG = "--output-rate-store-failure-mode"
FAILURE_AFTER_FLAG = "--output-rate-store-failure-after"
EXPECTED_ENGINES_FLAG = "--output-rate-store-expected-engines"

#: ``StoreSettings`` field -> its flag; the URL's flag turns the store on.
STORE_FLAGS = {
    "url": STORE_FLAG,
    "password_file": PASSWORD_FILE_FLAG,
    "failure_mode": FAILURE_MODE_FLAG,
    "failure_after_s": FAILURE_AFTER_FLAG,
    "timeout_ms": TIMEOUT_FLAG,
    "fleet": FLEET_FLAG,
    "expected_engines": EXPECTED_ENGINES_FLAG,
}

#: Seconds of outage before the failure mode applies.
DEFAULT_FAILURE_AFTER_S = 5.0
#: One store call's timeout: the claimer would rather report a slow store than
#: wait on it, and claims are sized for ~50 ms of consumption.
DEFAULT_TIMEOUT_MS = 50
#: Beyond a minute the store is down, not slow.
MAX_TIMEOUT_MS = 60_000
#: More engines than any fleet runs: a larger stated size is a typo.
MAX_EXPECTED_ENGINES = 100_000


class FailureMode(str, enum.Enum):
    """What an engine does once the store has been unreachable for
    ``failure_after_s``. Before that, and from then on with the default, it
    spends what it holds and then paces each user locally at ``R / N_live``;
    an engine that has not yet read ``N_live`` from the store divides by
    ``expected_engines`` instead, and without that pauses limited users
    (``pacing.claims.ClaimedBalances.share_divisor``)."""

    #: Go on pacing each user at its local share (the default).
    KEEP_LOCAL_SHARE = "keep-local-share"
    #: Stop limiting: every user runs unpaced until the store returns.
    FAIL_OPEN = "fail-open"
    #: Pause every paced user until the store returns.
    FAIL_CLOSED = "fail-closed"

    def __str__(self) -> str:
        return self.value


def parse_failure_mode(raw: object, *, field: str = FAILURE_MODE_FLAG) -> FailureMode:
    """``raw`` as a ``FailureMode``; ValueError naming ``field`` and the choices."""
    if isinstance(raw, FailureMode):
        return raw
    if isinstance(raw, str):
        try:
            return FailureMode(raw.strip().lower())
        except ValueError:
            pass
    choices = ", ".join(mode.value for mode in FailureMode)
    raise ValueError(f"{field} must be one of {choices}, got {raw!r}")


@dataclass(frozen=True)
class StoreSettings:
    """The store's settings, validated; see the module docstring."""

    url: str
    password_file: str | None = None
    failure_mode: FailureMode = FailureMode.KEEP_LOCAL_SHARE
    failure_after_s: float = DEFAULT_FAILURE_AFTER_S
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    #: The key prefix's fleet name (``--output-rate-store-fleet`` or the URL's
    #: ``fleet``); ``None``: the keys of a store without fleets.
    fleet: str | None = None
    #: The fleet's stated size, assumed until the store's count is read.
    expected_engines: int | None = None

    def __post_init__(self) -> None:
        in_url = parse_url(self.url).fleet
        if self.fleet is not None:
            validate_fleet(self.fleet)
            if in_url is not None and in_url != self.fleet:
                raise ValueError(
                    f"{FLEET_FLAG} {self.fleet!r} and the fleet in {STORE_FLAG} "
                    f"({in_url!r}) differ: name it once"
                )
        object.__setattr__(self, "fleet", self.fleet or in_url)
        if self.expected_engines is not None:
            validate_expected_engines(self.expected_engines)
        if self.password_file is not None and (
            not isinstance(self.password_file, str) or not self.password_file
        ):
            raise ValueError(f"{PASSWORD_FILE_FLAG} must be a non-empty path")
        object.__setattr__(self, "failure_mode", parse_failure_mode(self.failure_mode))
        validate_failure_after(self.failure_after_s)
        validate_timeout_ms(self.timeout_ms)

    @property
    def timeout_s(self) -> float:
        """``timeout_ms`` in seconds (what socket timeouts take)."""
        return self.timeout_ms / 1000

    @property
    def address(self) -> StoreAddress:
        """The URL taken apart: the deployment's kind, nodes, TLS files."""
        return parse_url(self.url)

    @property
    def tls_files(self) -> dict[str, str]:
        """The URL's TLS file options (``ssl_ca_certs`` ...) and their paths."""
        return self.address.tls_files

    def password(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The password: the password file's content (surrounding whitespace
        stripped), else ``environ[PASSWORD_ENV]``, else ``None`` (the server
        asks for none). ValueError naming the flag for a file that cannot be
        read or is empty."""
        if self.password_file is not None:
            try:
                password = _read(self.password_file, PASSWORD_FILE_FLAG).decode()
            except UnicodeDecodeError:
                raise ValueError(
                    f"{PASSWORD_FILE_FLAG} {self.password_file}: not UTF-8 text"
                ) from None
            password = password.strip()
            if not password:
                raise ValueError(f"{PASSWORD_FILE_FLAG} {self.password_file} is empty")
            return password
        return environ.get(PASSWORD_ENV) or None

    def check_files(self) -> None:
        """Reads every file the settings name (the password file and the URL's
        TLS files), as the connecting process will: ValueError naming the flag
        or option for the first that cannot be read. For the start-up checks,
        so that a mistake ends the start instead of showing as a store outage."""
        self.password(environ={})
        for name, path in self.tls_files.items():
            _read(path, f"{STORE_FLAG} option {name}")


def validate_failure_after(value: object, *, field: str = FAILURE_AFTER_FLAG) -> float:
    """Returns ``value`` if it is a finite, non-negative number of seconds (0:
    the failure mode applies at the first failed call), else raises ValueError
    naming ``field``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"{field} must be a non-negative number of seconds, got {value!r}"
        )
    return value


def validate_timeout_ms(value: object, *, field: str = TIMEOUT_FLAG) -> int:
    """Returns ``value`` if it is a whole number of milliseconds in
    1..``MAX_TIMEOUT_MS``, else raises ValueError naming ``field``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_TIMEOUT_MS
    ):
        raise ValueError(
            f"{field} must be a whole number of milliseconds in "
            f"1..{MAX_TIMEOUT_MS}, got {value!r}"
        )
    return value


def validate_expected_engines(
    value: object, *, field: str = EXPECTED_ENGINES_FLAG
) -> int:
    """Returns ``value`` if it is a whole number of engines in
    1..``MAX_EXPECTED_ENGINES``, else raises ValueError naming ``field``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_EXPECTED_ENGINES
    ):
        raise ValueError(
            f"{field} must be a whole number of engines in "
            f"1..{MAX_EXPECTED_ENGINES}, got {value!r}"
        )
    return value


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
