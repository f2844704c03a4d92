"""The grammar of ``--output-rate-store``: which Redis deployment a URL names, read
into a ``StoreAddress`` (pure: the client side that connects is ``store.clients``).

- one server: ``redis://HOST[:PORT][/DB]``, ``rediss://...`` (TLS) or
  ``unix:///PATH`` (database with ``?db=N``), passed to redis-py's ``from_url``
  as written;
- Redis Cluster: ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (TLS:
  ``rediss+cluster://``), the nodes to learn the cluster's layout from (any
  one that answers will do); a cluster has only database 0, so no path;
- Sentinel: ``redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[?db=N]``
  (TLS: ``rediss+sentinel://``, to the sentinels and the master alike), the
  sentinels to ask where the master named ``MASTER_NAME`` is. Ports default
  to 6379 (a cluster node) and 26379 (a sentinel).

For every form: a user name is fine (Redis ACLs: it and the password are the
data nodes', never the sentinels'), a password is not (``_NO_PASSWORD``); the
query takes ``db`` where a database can be chosen, ``fleet`` (the key prefix:
``validate_fleet``) and, with TLS, the files ``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile`` and ``ssl_check_hostname`` (``true``, the
default, or ``false``: whether the server's certificate must name the host
connected to). Any other option would override a setting of ours (redis-py
lets the query win) or hold a secret.

Errors are ValueError naming ``STORE_FLAG``; a message never holds the URL.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

STORE_FLAG = "--output-rate-store"
PASSWORD_FILE_FLAG = "--output-rate-store-password-file"
TIMEOUT_FLAG = "--output-rate-store-timeout-ms"
FLEET_FLAG = "--output-rate-store-fleet"
#: Environment variable holding the store's password when no password file is
#: given (read by the process that connects).
PASSWORD_ENV = "OUTPUT_RATE_STORE_PASSWORD"

DB_OPTION = "db"
FLEET_OPTION = "fleet"
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
CHECK_HOSTNAME_OPTION = "ssl_check_hostname"
#: The options that are ours alone, never handed to redis-py.
OWN_OPTIONS = (FLEET_OPTION, CHECK_HOSTNAME_OPTION)
#: A fleet name: short, and no character with a meaning in a key (``:``
#: separates a key's parts, braces make a cluster hash tag).
_FLEET = re.compile("[A-Za-z0-9_.-]{1,64}")

CLUSTER_PORT = 6379
SENTINEL_PORT = 26379

_NO_PASSWORD = (
    f"must not hold a password (a command line shows in `ps` and in logs): use "
    f"{PASSWORD_FILE_FLAG} PATH or the environment variable {PASSWORD_ENV}"
)
_DIGITS = re.compile("[0-9]+")


class Topology(str, enum.Enum):
    """What kind of Redis deployment a URL names."""

    SERVER = "server"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


#: Scheme -> (topology, TLS). redis-py checks a scheme as written, lower case.
SCHEMES: dict[str, tuple[Topology, bool]] = {
    "redis": (Topology.SERVER, False),
    "rediss": (Topology.SERVER, True),
    "unix": (Topology.SERVER, False),
    "redis+cluster": (Topology.CLUSTER, False),
    "rediss+cluster": (Topology.CLUSTER, True),
    "redis+sentinel": (Topology.SENTINEL, False),
    "rediss+sentinel": (Topology.SENTINEL, True),
}


@dataclass(frozen=True)
class StoreAddress:
    """A validated ``--output-rate-store`` URL, taken apart."""

    url: str
    topology: Topology
    tls: bool
    #: The cluster's seed nodes or the sentinels; empty for one server.
    nodes: tuple[tuple[str, int], ...] = ()
    #: The master's name (Sentinel only).
    master: str | None = None
    username: str | None = None
    db: int = 0
    #: The TLS file options and their paths.
    tls_files: dict[str, str] = field(default_factory=dict)
    #: The fleet the URL names (``None``: none).
    fleet: str | None = None
    #: With TLS: whether the server's certificate must name the host.
    check_hostname: bool = True

    @property
    def redis_py_url(self) -> str:
        """The URL without the options that are ours alone, for redis-py's
        ``from_url`` (which would take them as connection arguments)."""
        base, _, query = self.url.partition("?")
        kept = "&".join(
            item
            for item in query.split("&")
            if unquote(item.split("=")[0]) not in OWN_OPTIONS
        )
        return f"{base}?{kept}" if kept else base


def validate_fleet(fleet: object, *, field: str = FLEET_FLAG) -> str:
    """Returns ``fleet`` if it is a fleet name (1 to 64 of ``A-Z a-z 0-9 _ .
    -``), else raises ValueError naming ``field``."""
    if not isinstance(fleet, str) or not _FLEET.fullmatch(fleet):
        raise ValueError(
            f"{field} must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' "
            f"and '-', got {fleet!r}"
        )
    return fleet


def validate_url(url: object) -> str:
    """Returns ``url`` if ``parse_url`` takes it, else raises its ValueError."""
    return parse_url(url).url


def parse_url(url: object) -> StoreAddress:
    """``url`` taken apart (see the module docstring); ValueError naming
    ``STORE_FLAG`` for one that is not taken."""
    if not isinstance(url, str):
        raise ValueError(f"{STORE_FLAG} must be a string, got {type(url).__name__}")
    scheme = next((s for s in SCHEMES if url.startswith(f"{s}://")), None)
    if scheme is None:
        raise ValueError(
            f"{STORE_FLAG} must be a URL starting redis://, rediss:// (TLS), "
            "unix:// (a socket), redis+cluster:// or redis+sentinel:// (rediss+ "
            "for TLS), like redis://127.0.0.1:6379/0"
        )
    topology, tls = SCHEMES[scheme]
    parts = urlsplit(url)
    query = _query(parts, scheme, tls, with_db=topology is not Topology.CLUSTER)
    options = _Options(
        {name: query[name][0] for name in TLS_OPTIONS if name in query},
        _fleet(query),
        _check_hostname(query),
    )
    if topology is Topology.SERVER:
        db = _server_db(parts, scheme, query)
        return StoreAddress(url, topology, tls, db=db, **options._asdict())
    username, nodes = _nodes(
        parts.netloc,
        SENTINEL_PORT if topology is Topology.SENTINEL else CLUSTER_PORT,
        scheme,
    )
    path = parts.path.removeprefix("/")
    if topology is Topology.CLUSTER:
        if path:
            raise ValueError(
                f"{STORE_FLAG}: a {scheme}:// URL has no path (a cluster has "
                "database 0 only), like redis+cluster://10.0.0.1:6379,10.0.0.2:6379"
            )
        return StoreAddress(
            url, topology, tls, nodes, username=username, **options._asdict()
        )
    master = unquote(path)
    if not master or "/" in master:
        raise ValueError(
            f"{STORE_FLAG}: a {scheme}:// URL names the master after the "
            "sentinels, like redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster"
        )
    db = int(query[DB_OPTION][0]) if DB_OPTION in query else 0
    return StoreAddress(
        url, topology, tls, nodes, master, username, db, **options._asdict()
    )


def _query(
    parts: SplitResult, scheme: str, tls: bool, *, with_db: bool
) -> dict[str, list[str]]:
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ValueError(f"{STORE_FLAG} has a malformed query string") from None
    allowed = (
        ((DB_OPTION,) if with_db else ())
        + (FLEET_OPTION,)
        + ((*TLS_OPTIONS, CHECK_HOSTNAME_OPTION) if tls else ())
    )
    for name, values in query.items():
        if name == "password":
            raise ValueError(f"{STORE_FLAG} {_NO_PASSWORD}")
        if name not in allowed:
            taken = f"only {', '.join(allowed)}" if allowed else "none"
            raise ValueError(
                f"{STORE_FLAG}: option {name!r} is not taken here (with "
                f"{scheme}:// {taken}; the timeout is {TIMEOUT_FLAG})"
            )
        if len(values) > 1 or not values[0]:
            raise ValueError(f"{STORE_FLAG}: option {name!r} needs one value")
    if DB_OPTION in query and not _DIGITS.fullmatch(query[DB_OPTION][0]):
        raise ValueError(f"{STORE_FLAG}: db must be a database number")
    return query


class _Options(NamedTuple):
    """The query's options every form takes alike (``StoreAddress`` fields)."""

    tls_files: dict[str, str]
    fleet: str | None
    check_hostname: bool


def _fleet(query: dict[str, list[str]]) -> str | None:
    if FLEET_OPTION not in query:
        return None
    return validate_fleet(query[FLEET_OPTION][0], field=f"{STORE_FLAG} option fleet")


def _check_hostname(query: dict[str, list[str]]) -> bool:
    value = query.get(CHECK_HOSTNAME_OPTION, ["true"])[0]
    if value not in ("true", "false"):
        raise ValueError(
            f"{STORE_FLAG}: ssl_check_hostname must be true or false, got {value!r}"
        )
    return value == "true"


def _server_db(parts: SplitResult, scheme: str, query: dict[str, list[str]]) -> int:
    """The database of a one-server URL, after checking its host and path."""
    try:
        port = parts.port
    except ValueError:
        raise ValueError(
            f"{STORE_FLAG} has a port that is no number in 0..65535"
        ) from None
    if parts.password is not None:
        raise ValueError(f"{STORE_FLAG} {_NO_PASSWORD}")
    in_query = int(query[DB_OPTION][0]) if DB_OPTION in query else None
    if scheme == "unix":
        if parts.hostname is not None or port is not None:
            raise ValueError(
                f"{STORE_FLAG}: a unix:// URL names no host, like unix:///run/redis.sock"
            )
        if len(parts.path) < 2:
            raise ValueError(f"{STORE_FLAG}: a unix:// URL needs the socket's path")
        return in_query or 0
    if not parts.hostname:
        raise ValueError(f"{STORE_FLAG} needs a host, like redis://127.0.0.1:6379/0")
    if port == 0:
        raise ValueError(f"{STORE_FLAG} has port 0")
    db = parts.path.removeprefix("/")
    if db and not _DIGITS.fullmatch(db):
        raise ValueError(
            f"{STORE_FLAG}: the path must be a database number, like "
            "redis://127.0.0.1:6379/0"
        )
    if db and in_query is not None:
        raise ValueError(f"{STORE_FLAG} names the database twice (path and ?db=)")
    return int(db) if db else in_query or 0


def _nodes(
    netloc: str, default_port: int, scheme: str
) -> tuple[str | None, tuple[tuple[str, int], ...]]:
    """The user name and the ``HOST[:PORT]`` list of a cluster or Sentinel URL."""
    userinfo, at, hosts = netloc.rpartition("@")
    username = None
    if at:
        name, colon, _ = userinfo.partition(":")
        if colon:
            raise ValueError(f"{STORE_FLAG} {_NO_PASSWORD}")
        username = unquote(name) or None
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        node = urlsplit(f"//{item}")
        try:
            port = node.port
        except ValueError:
            port = 0
        if not item or not node.hostname or port == 0 or node.netloc != item:
            raise ValueError(
                f"{STORE_FLAG}: a {scheme}:// URL lists HOST:PORT items "
                "separated by commas, every port a number in 1..65535"
            )
        nodes.append((node.hostname, default_port if port is None else port))
    return username, tuple(nodes)
