"""Authentication: bearer tokens, mTLS, and refusing to listen beyond loopback
without either."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control import secrets
from control.server import BindRefused, TlsConfig, create_server, is_loopback
from control.service.operations import LimitsService
from pacing.settings.checks import SettingsError
from pacing.settings.model import ControlSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc
from tests.control_harness import make_rig, serving

TOKEN = "s3cret-token"
GET_DEFAULT = "/outputrate.v1.OutputRateControl/GetDefaultLimit"


@pytest.fixture
def service():
    return LimitsService(make_rig(10).shared)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# -- bearer token ------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        bearer("wrong"),
        bearer(TOKEN + "x"),
        bearer(TOKEN[:-1]),
        (("authorization", TOKEN),),  # no scheme
        (("authorization", f"Basic {TOKEN}"),),
        bearer(TOKEN) + bearer(TOKEN),  # ambiguous: two headers
    ],
    ids=["none", "wrong", "longer", "shorter", "no-scheme", "basic", "twice"],
)
def test_calls_without_the_token_are_unauthenticated(service, metadata):
    with serving(service, auth_token=TOKEN) as served:
        with pytest.raises(grpc.RpcError) as info:
            served.stub.GetDefaultLimit(pb.GetDefaultLimitRequest(), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer <token>" in info.value.details()
        counts = served.server.rpc_counts.snapshot()
        assert counts[(GET_DEFAULT, "UNAUTHENTICATED")] == 1


def test_the_token_lets_calls_through(service):
    with serving(service, auth_token=TOKEN) as served:
        got = served.stub.GetDefaultLimit(
            pb.GetDefaultLimitRequest(), metadata=bearer(TOKEN)
        )
        assert got.tokens_per_second == 10


def test_streams_need_the_token_too(service):
    with serving(service, auth_token=TOKEN) as served:
        stream = served.stub.WatchUserStates(pb.WatchUserStatesRequest())
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_checks_need_no_token(service):
    with serving(service, auth_token=TOKEN) as served:
        health = health_pb2_grpc.HealthStub(served.channel)
        response = health.Check(health_pb2.HealthCheckRequest())
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_settings_read_the_token_from_a_file_then_the_environment(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("OUTPUT_RATE_CONTROL_TOKEN", "from-env")
    assert secrets.auth_token(ControlSettings()) == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert secrets.auth_token(ControlSettings(token_file=str(token_file))) == (
        "from-file"
    )
    token_file.write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        secrets.auth_token(ControlSettings(token_file=str(token_file)))
    monkeypatch.delenv("OUTPUT_RATE_CONTROL_TOKEN")
    assert secrets.auth_token(ControlSettings()) is None


# -- mTLS ----------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(subject: str, key, issuer=None, issuer_key=None, *, ca=False, usage=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage == "server":
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        ).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    if usage == "client":
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key or key, hashes.SHA256())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki():
    """A CA with a server and a client certificate, and a client certificate
    from another CA."""
    ca_key, rogue_key = _key(), _key()
    ca = _cert("test CA", ca_key, ca=True)
    rogue_ca = _cert("rogue CA", rogue_key, ca=True)

    def issue(subject, issuer, issuer_key, usage):
        key = _key()
        cert = _cert(subject, key, issuer, issuer_key, usage=usage)
        return _cert_pem(cert), _pem(key)

    return {
        "ca": _cert_pem(ca),
        "server": issue("localhost", ca, ca_key, "server"),
        "client": issue("operator", ca, ca_key, "client"),
        "stranger": issue("stranger", rogue_ca, rogue_key, "client"),
    }


def _mtls(pki) -> TlsConfig:
    cert, key = pki["server"]
    return TlsConfig(cert_chain=cert, private_key=key, client_ca=pki["ca"])


def _client(pki, who: str | None) -> grpc.ChannelCredentials:
    if who is None:
        return grpc.ssl_channel_credentials(root_certificates=pki["ca"])
    cert, key = pki[who]
    return grpc.ssl_channel_credentials(
        root_certificates=pki["ca"], private_key=key, certificate_chain=cert
    )


def test_a_client_with_a_certificate_of_the_ca_is_served(service, pki):
    with serving(
        service, tls=_mtls(pki), channel_credentials=_client(pki, "client")
    ) as s:
        assert (
            s.stub.GetDefaultLimit(pb.GetDefaultLimitRequest()).tokens_per_second == 10
        )


@pytest.mark.parametrize("who", [None, "stranger"], ids=["no-cert", "other-ca"])
def test_a_client_without_a_certificate_of_the_ca_is_refused(service, pki, who):
    with serving(service, tls=_mtls(pki), channel_credentials=_client(pki, who)) as s:
        with pytest.raises(grpc.RpcError) as info:
            s.stub.GetDefaultLimit(pb.GetDefaultLimitRequest(), timeout=5)
        # The TLS handshake fails: no call reaches the server.
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert s.server.rpc_counts.snapshot() == {}


def test_a_plaintext_client_is_refused_by_a_tls_server(service, pki):
    with serving(service, tls=_mtls(pki)) as s:
        with pytest.raises(grpc.RpcError) as info:
            s.stub.GetDefaultLimit(pb.GetDefaultLimitRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_and_token_together(service, pki):
    with serving(
        service,
        tls=_mtls(pki),
        auth_token=TOKEN,
        channel_credentials=_client(pki, "client"),
    ) as s:
        with pytest.raises(grpc.RpcError) as info:
            s.stub.GetDefaultLimit(pb.GetDefaultLimitRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        got = s.stub.GetDefaultLimit(
            pb.GetDefaultLimitRequest(), metadata=bearer(TOKEN)
        )
        assert got.tokens_per_second == 10


def test_settings_load_tls_files(tmp_path, pki):
    cert, key = pki["server"]
    for name, data in [("cert", cert), ("key", key), ("ca", pki["ca"])]:
        (tmp_path / name).write_bytes(data)
    settings = ControlSettings(
        tls_cert=str(tmp_path / "cert"),
        tls_key=str(tmp_path / "key"),
        tls_client_ca=str(tmp_path / "ca"),
    )
    assert secrets.tls(settings) == _mtls(pki)
    with pytest.raises(SettingsError, match="must be given together"):
        ControlSettings(tls_cert=str(tmp_path / "cert"))
    with pytest.raises(SettingsError, match="needs"):
        ControlSettings(tls_client_ca=str(tmp_path / "ca"))
    with pytest.raises(SettingsError, match="missing"):
        secrets.tls(ControlSettings(tls_cert="missing", tls_key="missing"))


# -- where the server may listen ---------------------------------------------


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:50151", True),
        ("127.9.9.9:1", True),
        ("localhost:1", True),
        ("[::1]:1", True),
        ("unix:/tmp/control.sock", True),
        ("0.0.0.0:1", False),
        ("[::]:1", False),
        ("10.1.2.3:1", False),
        ("control.example.com:1", False),
        (":1", False),
    ],
)
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
def test_non_loopback_bind_is_refused_without_auth(service, address):
    with pytest.raises(BindRefused, match="no authentication is configured"):
        create_server(address, service)


def test_tls_without_client_ca_is_not_auth(service, pki):
    cert, key = pki["server"]
    with pytest.raises(BindRefused):
        create_server("0.0.0.0:0", service, tls=TlsConfig(cert, key))


@pytest.mark.parametrize("auth", ["token over TLS", "mtls"])
def test_non_loopback_bind_is_allowed_with_auth(service, pki, auth):
    cert, key = pki["server"]
    kwargs = (
        {"auth_token": TOKEN, "tls": TlsConfig(cert, key)}
        if auth == "token over TLS"
        else {"tls": _mtls(pki)}
    )
    server, port = create_server("0.0.0.0:0", service, **kwargs)
    assert port > 0
    server.stop(0)


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
def test_a_token_in_clear_text_beyond_loopback_is_refused(service, address):
    """Anyone on the path could read the token and then change every limit."""
    with pytest.raises(BindRefused) as refused:
        create_server(address, service, auth_token=TOKEN)
    assert str(refused.value) == (
        f"refusing to listen on {address}: it is reachable from other hosts and "
        "bearer tokens would cross the network in clear text; configure TLS, or "
        "bind a loopback address such as 127.0.0.1"
    )


def test_a_token_in_clear_text_on_loopback_is_served(service):
    with serving(service, address="127.0.0.1:0", auth_token=TOKEN) as served:
        got = served.stub.GetDefaultLimit(
            pb.GetDefaultLimitRequest(), metadata=bearer(TOKEN)
        )
        assert got.tokens_per_second == 10


def test_an_address_in_use_is_an_os_error(service):
    with serving(service) as served, pytest.raises(OSError, match="cannot listen"):
        create_server(f"127.0.0.1:{served.port}", service)


def test_stub_module_imports_as_a_package():
    assert output_rate_pb2_grpc.OutputRateControlStub
