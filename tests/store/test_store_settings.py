"""The store's settings (``pacing.settings.store``): which URLs are taken, that a
password never is one of them nor travels in the settings, and that what is
taken connects through redis-py as it says (a real ``redis-server`` for the
password)."""

from __future__ import annotations

import json

import pytest
import redis
from redis.exceptions import AuthenticationError

from pacing.settings.store import (
    PASSWORD_ENV,
    PASSWORD_FILE_FLAG,
    STORE_FLAG,
    TIMEOUT_FLAG,
    FailureMode,
    StoreSettings,
    parse_failure_mode,
    validate_url,
)
from store.clients import connect
from tests.settings_harness import settings_of
from tools.redis_server import redis_server

SECRET = "s3cret-Pa55"


@pytest.fixture(autouse=True)
def _no_password_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


# -- URLs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "connection", "where"),
    [
        (
            "redis://127.0.0.1:6379/0",
            "Connection",
            {"host": "127.0.0.1", "port": 6379, "db": 0},
        ),
        ("redis://redis.internal/3", "Connection", {"host": "redis.internal", "db": 3}),
        ("redis://[::1]:6380", "Connection", {"host": "::1", "port": 6380}),
        (
            "redis://engine@10.0.0.5:6379/1",
            "Connection",
            {"host": "10.0.0.5", "username": "engine", "db": 1},
        ),
        (
            "rediss://redis.internal:6380/0?ssl_ca_certs=/etc/ca.pem",
            "SSLConnection",
            {"host": "redis.internal", "port": 6380, "ssl_ca_certs": "/etc/ca.pem"},
        ),
        (
            "rediss://h/0?ssl_certfile=/c.pem&ssl_keyfile=/k.pem",
            "SSLConnection",
            {"ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"},
        ),
        (
            "unix:///run/redis/redis.sock",
            "UnixDomainSocketConnection",
            {"path": "/run/redis/redis.sock"},
        ),
        (
            "unix:///run/redis/redis.sock?db=2",
            "UnixDomainSocketConnection",
            {"path": "/run/redis/redis.sock", "db": 2},
        ),
    ],
)
def test_an_accepted_url_connects_through_redis_py_as_written(url, connection, where):
    settings = StoreSettings(url, timeout_ms=30)
    client = connect(settings.url, password="pw", timeout_s=settings.timeout_s)
    pool = client.connection_pool
    # redis-py builds the connection from the URL's parts without connecting.
    assert type(pool.make_connection()).__name__ == connection
    kwargs = pool.connection_kwargs
    assert {key: kwargs.get(key) for key in where} == where
    # Nothing in the URL overrides the password or the timeout.
    assert (kwargs["password"], kwargs["socket_timeout"]) == ("pw", 0.03)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@127.0.0.1:6379/0",
        f"redis://engine:{SECRET}@127.0.0.1:6379/0",
        f"rediss://engine:{SECRET}@redis.internal:6380/0",
        "redis://:@127.0.0.1:6379/0",
        f"redis://127.0.0.1:6379/0?password={SECRET}",
        f"unix:///run/redis.sock?db=0&password={SECRET}",
    ],
)
def test_a_password_in_the_url_is_refused_naming_the_two_ways(url):
    with pytest.raises(ValueError) as error:
        StoreSettings(url)
    message = str(error.value)
    assert message.startswith(f"{STORE_FLAG} must not hold a password")
    assert PASSWORD_FILE_FLAG in message
    assert PASSWORD_ENV in message
    assert SECRET not in message


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:6379/0", "must be a URL starting redis://"),
        ("REDIS://127.0.0.1:6379/0", "must be a URL starting redis://"),
        ("127.0.0.1:6379", "must be a URL starting redis://"),
        ("redis:///0", "needs a host"),
        ("redis://h:port/0", "port that is no number"),
        ("redis://h:70000/0", "port that is no number"),
        ("redis://h:0/0", "port 0"),
        ("redis://h:6379/zero", "path must be a database number"),
        ("redis://h:6379/0/1", "path must be a database number"),
        ("redis://h:6379/0?db=1", "names the database twice"),
        ("redis://h:6379?db=x", "db must be a database number"),
        ("redis://h:6379/0?socket_timeout=5", "option 'socket_timeout' is not taken"),
        ("redis://h:6379/0?ssl_ca_certs=/ca", "option 'ssl_ca_certs' is not taken"),
        ("rediss://h:6379/0?retry_on_timeout=1", "is not taken"),
        ("redis://h:6379/0?db", "malformed query string"),
        ("redis://h:6379?db=1&db=2", "needs one value"),
        ("unix://host/run/redis.sock", "a unix:// URL names no host"),
        ("unix://", "needs the socket's path"),
        (5, "must be a string"),
    ],
)
def test_a_bad_url_is_refused_naming_the_flag(url, message):
    with pytest.raises(ValueError, match=message) as error:
        validate_url(url)
    assert str(error.value).startswith(STORE_FLAG)


def test_an_option_that_is_not_taken_points_to_the_timeout_flag():
    with pytest.raises(ValueError, match=TIMEOUT_FLAG):
        validate_url("redis://h:6379/0?socket_timeout=5")


# -- the other settings ------------------------------------------------------------


def test_the_defaults_keep_the_local_share_after_five_seconds_and_time_out_at_50_ms():
    settings = StoreSettings("redis://127.0.0.1:6379/0")
    assert settings.failure_mode is FailureMode.KEEP_LOCAL_SHARE
    assert (settings.failure_after_s, settings.timeout_ms) == (5.0, 50)
    assert settings.timeout_s == 0.05
    assert settings.password_file is None


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        ("keep-local-share", FailureMode.KEEP_LOCAL_SHARE),
        ("Fail-Open", FailureMode.FAIL_OPEN),
        (" fail-closed ", FailureMode.FAIL_CLOSED),
        (FailureMode.FAIL_OPEN, FailureMode.FAIL_OPEN),
    ],
)
def test_failure_modes_are_parsed_by_name(raw, mode):
    assert parse_failure_mode(raw) is mode
    assert StoreSettings("redis://h/0", failure_mode=raw).failure_mode is mode


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"failure_mode": "fail-slow"}, "must be one of keep-local-share, fail-open"),
        ({"failure_mode": None}, "must be one of"),
        ({"failure_after_s": -1}, "non-negative number of seconds"),
        ({"failure_after_s": float("inf")}, "non-negative number of seconds"),
        ({"failure_after_s": float("nan")}, "non-negative number of seconds"),
        ({"failure_after_s": True}, "non-negative number of seconds"),
        ({"failure_after_s": "5"}, "non-negative number of seconds"),
        ({"timeout_ms": 0}, "whole number of milliseconds in 1..60000"),
        ({"timeout_ms": 60_001}, "whole number of milliseconds"),
        ({"timeout_ms": 2.5}, "whole number of milliseconds"),
        ({"timeout_ms": True}, "whole number of milliseconds"),
        ({"password_file": ""}, "must be a non-empty path"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        StoreSettings("redis://h/0", **changes)
    assert str(error.value).startswith("--output-rate-store")


def test_zero_seconds_applies_the_failure_mode_at_the_first_failure():
    assert StoreSettings("redis://h/0", failure_after_s=0).failure_after_s == 0


# -- the password ------------------------------------------------------------------


def test_the_password_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "password"
    path.write_text(f"{SECRET}\n")  # editors end files with a newline
    settings = StoreSettings("redis://h/0", password_file=str(path))
    assert settings.password(environ={PASSWORD_ENV: "other"}) == SECRET


def test_without_a_file_the_password_comes_from_the_environment(monkeypatch):
    settings = StoreSettings("redis://h/0")
    assert settings.password(environ={PASSWORD_ENV: SECRET}) == SECRET
    assert settings.password(environ={PASSWORD_ENV: ""}) is None
    assert settings.password(environ={}) is None
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    assert settings.password() == SECRET  # the process's own environment


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file or directory"), (b" \n", "is empty"), (b"\xff", "UTF-8")],
)
def test_an_unusable_password_file_is_refused_naming_the_flag(
    tmp_path, content, message
):
    path = tmp_path / "password"
    if content is not None:
        path.write_bytes(content)
    settings = StoreSettings("redis://h/0", password_file=str(path))
    for check in (settings.password, settings.check_files):
        with pytest.raises(ValueError, match=message) as error:
            check()
        assert str(error.value).startswith(f"{PASSWORD_FILE_FLAG} {path}")


def test_the_tls_files_are_checked_too(tmp_path):
    ca = tmp_path / "ca.pem"
    settings = StoreSettings(f"rediss://h:6380/0?ssl_ca_certs={ca}")
    assert settings.tls_files == {"ssl_ca_certs": str(ca)}
    with pytest.raises(ValueError, match=r"option ssl_ca_certs .*: No such file"):
        settings.check_files()
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    settings.check_files()


def test_the_environment_is_not_read_by_the_file_check(monkeypatch):
    # The API process checks only files: the variable is read where it connects.
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    StoreSettings("redis://h/0").check_files()


def test_the_password_never_travels_in_additional_config(tmp_path, monkeypatch):
    path = tmp_path / "password"
    path.write_text(SECRET)
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    paced = settings_of(
        default_rate=10,
        store=StoreSettings("redis://h/0", password_file=str(path)),
    )
    entry = paced.to_additional_config()
    assert entry["store"]["password_file"] == str(path)
    assert SECRET not in json.dumps(entry)
    assert SECRET not in repr(paced)


# -- against a real redis-server ---------------------------------------------------


def test_the_password_from_the_file_authenticates_a_redis_acl_user(tmp_path):
    with redis_server() as url:
        admin = connect(url, timeout_s=5.0)
        admin.acl_setuser(
            "engine",
            enabled=True,
            passwords=[f"+{SECRET}"],
            keys=["*"],
            commands=["+@all"],
        )
        admin.config_set("requirepass", "admin-only")  # no anonymous access
        path = tmp_path / "password"
        path.write_text(SECRET + "\n")
        store_url = url.replace("redis://", "redis://engine@")
        settings = StoreSettings(store_url, password_file=str(path), timeout_ms=2000)
        client = connect(
            settings.url, password=settings.password(), timeout_s=settings.timeout_s
        )
        assert client.acl_whoami() == "engine"
        assert client.ping()
        with pytest.raises(AuthenticationError):
            connect(store_url, timeout_s=2.0).ping()
        with pytest.raises(AuthenticationError):
            connect(url, timeout_s=2.0).ping()
        for opened in (client, admin):
            opened.close()


def test_redis_py_lets_the_urls_query_options_win_over_arguments():
    # Why validate_url allows only a few options: redis-py hands any other one
    # to the connection, where it wins over what the claimer passes.
    pool = redis.ConnectionPool.from_url(
        "redis://h/0?socket_timeout=9&password=x", socket_timeout=0.05, password="y"
    )
    assert pool.connection_kwargs["socket_timeout"] == 9.0
    assert pool.connection_kwargs["password"] == "x"
