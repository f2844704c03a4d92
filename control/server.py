"""The gRPC server of the control plane: the API, health, reflection, auth.

``create_server`` builds it, ``ControlServer.start`` starts it, and
``control.runner.serve`` wires it to a shared limiter and a config file.
"""

from __future__ import annotations

import ipaddress
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health as _health
from grpc_health.v1 import health_pb2 as _health_pb2
from grpc_health.v1 import health_pb2_grpc as _health_pb2_grpc
from grpc_reflection.v1alpha import reflection as _reflection
from opentelemetry import trace

from control.interceptors.auth import MAX_OPEN_CHECKS, BearerTokenInterceptor
from control.interceptors.error_mapping import ErrorMappingInterceptor
from control.interceptors.tracing import TracingInterceptor
from control.rpc_counts import RpcCounts
from control.service.operations import LimitsService
from control.servicer import MAX_WATCHES, SERVICE_NAME, OutputRateControlServicer
from protos.outputrate.v1 import output_rate_pb2_grpc as _pb2_grpc

#: Worker threads: room for every watch, as many unary calls at once, and the
#: health checks without a token that wait for their request.
MAX_WORKERS = 2 * MAX_WATCHES + MAX_OPEN_CHECKS
#: Calls beyond this many in flight are refused with RESOURCE_EXHAUSTED at once
#: rather than queued behind the workers.
MAX_CONCURRENT_RPCS = 64
#: A whole limits table (100,000 limits of 256-byte ids) is about 27 MB; the
#: server and the CLI allow messages this big both ways.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_SERVING = _health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = _health_pb2.HealthCheckResponse.NOT_SERVING


class BindRefused(ValueError):
    """The address is not loopback and no authentication is configured."""


@dataclass(frozen=True)
class TlsConfig:
    """PEM material of the server; with ``client_ca`` clients must present a
    certificate it signed (mTLS), and a client without one is refused."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None


class ControlServer:
    """A created control-plane server: start it, mark it serving once the limits
    are loaded, stop it gracefully."""

    def __init__(
        self,
        server: grpc.Server,
        health: _health.HealthServicer,
        servicer: OutputRateControlServicer,
        rpc_counts: RpcCounts,
    ) -> None:
        self.grpc_server = server
        self.health = health
        self.rpc_counts = rpc_counts
        self._servicer = servicer

    def start(self) -> None:
        """Starts serving calls (health says NOT_SERVING until ``set_serving``)."""
        self.grpc_server.start()

    def set_serving(self) -> None:
        """Health checks answer SERVING from now on."""
        for service in ("", SERVICE_NAME):
            self.health.set(service, _SERVING)

    def stop(self, grace_s: float | None = 1.0) -> threading.Event:
        """Health goes NOT_SERVING first (so balancers stop sending), watches end,
        then calls in flight get ``grace_s`` to finish. Returns an event set once
        the server has stopped."""
        self.health.enter_graceful_shutdown()
        self._servicer.stop_watches()
        return self.grpc_server.stop(grace_s)


def create_server(
    address: str,
    service: LimitsService,
    *,
    auth_token: str | None = None,
    tls: TlsConfig | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    rpc_counts: RpcCounts | None = None,
) -> tuple[ControlServer, int]:
    """Builds a server for ``service`` bound to ``address`` (``host:port``, port 0
    picks a free one) and returns it, not started, with its port.

    Raises BindRefused for a non-loopback address without ``auth_token`` or
    mTLS, or with ``auth_token`` and no TLS, and OSError when the address
    cannot be bound.
    """
    check_authenticated(address, auth_token=auth_token, tls=tls)
    check_token_over_tls(address, auth_token=auth_token, tls=tls)
    counts = rpc_counts if rpc_counts is not None else RpcCounts()
    interceptors: list[grpc.ServerInterceptor] = [
        TracingInterceptor(tracer_provider),
        ErrorMappingInterceptor(counts),
    ]
    if auth_token:
        interceptors.append(BearerTokenInterceptor(auth_token))
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=MAX_WORKERS, thread_name_prefix="output-rate-control"
        ),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Without this a second process could bind the same port and take
            # a share of the connections (grpc sets SO_REUSEPORT by default).
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    servicer = OutputRateControlServicer(service)
    _pb2_grpc.add_OutputRateControlServicer_to_server(servicer, server)
    health = _health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health.set(name, _NOT_SERVING)
    _health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _reflection.enable_server_reflection(
        (SERVICE_NAME, _health.SERVICE_NAME, _reflection.SERVICE_NAME), server
    )
    port = _bind(server, address, tls)
    return ControlServer(server, health, servicer, counts), port


def check_authenticated(
    address: str, *, auth_token: str | None, tls: TlsConfig | None
) -> None:
    """Raises BindRefused when ``address`` can be reached from other hosts and
    neither a bearer token nor mTLS guards it."""
    authenticated = bool(auth_token) or (tls is not None and tls.client_ca is not None)
    if not authenticated and not is_loopback(address):
        raise BindRefused(
            f"refusing to listen on {address}: it is reachable from other hosts and "
            "no authentication is configured; set a bearer token or mTLS, or bind "
            "a loopback address such as 127.0.0.1"
        )


def check_token_over_tls(
    address: str, *, auth_token: str | None, tls: TlsConfig | None
) -> None:
    """Raises BindRefused when ``address`` can be reached from other hosts and
    clients would send ``auth_token`` there in clear text (no TLS)."""
    if auth_token and tls is None and not is_loopback(address):
        raise BindRefused(
            f"refusing to listen on {address}: it is reachable from other hosts and "
            "bearer tokens would cross the network in clear text; configure TLS, "
            "or bind a loopback address such as 127.0.0.1"
        )


def is_loopback(address: str) -> bool:
    """Whether ``address`` (``host:port``, ``[v6]:port`` or ``unix:path``) can
    only be reached from this host."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or garbage


def _bind(server: grpc.Server, address: str, tls: TlsConfig | None) -> int:
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(tls.private_key, tls.cert_chain)],
                root_certificates=tls.client_ca,
                require_client_auth=tls.client_ca is not None,
            )
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc raises this when the bind fails
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if port == 0:  # older grpc reports a failed bind this way
        raise OSError(f"cannot listen on {address}")
    return port
