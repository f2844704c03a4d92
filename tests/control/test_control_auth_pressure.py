"""Peers without the token under pressure: refused before their request is
read, so they can neither make the server parse big messages nor hold its
workers or call slots; health checks, open to them, are served a few at a
time and read small requests only."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control.interceptors.auth import (
    HEALTH_CHECK,
    MAX_CHECK_REQUEST_BYTES,
    MAX_OPEN_CHECKS,
)
from control.server import MAX_CONCURRENT_RPCS, MAX_MESSAGE_BYTES
from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

TOKEN = "s3cret-token"
WITH_TOKEN = (("authorization", f"Bearer {TOKEN}"),)
SERVICE = "/outputrate.v1.OutputRateControl/"
#: Methods a peer might try to hold: unary, a big-request one, a stream.
METHODS = ("GetDefaultLimit", "ReplaceLimitsTable", "WatchUserStates")
#: Bounds of the waits below: a refusal comes in milliseconds.
WAIT_S = 5.0


@pytest.fixture
def served():
    with serving(LimitsService(make_rig(10).shared), auth_token=TOKEN) as served:
        yield served


def _raw(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable:
    """``method`` called with request bytes as they are."""
    return channel.unary_unary(
        method, request_serializer=bytes, response_deserializer=bytes
    )


class Held:
    """Calls of one method without a token that send their metadata and never
    their request; ``refill`` replaces those that ended."""

    def __init__(self, channel: grpc.Channel, method: str, count: int) -> None:
        self._gate = threading.Event()
        self._call = channel.stream_unary(
            method, request_serializer=bytes, response_deserializer=bytes
        )
        self.calls = [self._start() for _ in range(count)]

    def _start(self) -> grpc.Future:
        def never_sent() -> Iterator[bytes]:
            self._gate.wait()
            yield from ()

        return self._call.future(never_sent(), timeout=60)

    def refill(self) -> None:
        self.calls = [self._start() if c.done() else c for c in self.calls]

    def end(self) -> None:
        self._gate.set()
        for each in self.calls:
            each.cancel()


@contextlib.contextmanager
def held(channel: grpc.Channel, method: str, count: int) -> Iterator[Held]:
    """``count`` held calls of ``method``, ended on exit."""
    calls = Held(channel, method, count)
    try:
        yield calls
    finally:
        calls.end()


def _code(call: grpc.Future) -> grpc.StatusCode:
    """The status ``call`` ended with, waiting at most ``WAIT_S``."""
    error = call.exception(timeout=WAIT_S)
    return grpc.StatusCode.OK if error is None else error.code()


def _error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def test_a_huge_request_without_the_token_is_refused_unparsed(served):
    """60 MB that are no protobuf: parsed, they would fail as INTERNAL."""
    channel = grpc.insecure_channel(
        served.address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    )
    with channel:
        refused = _error(
            _raw(channel, SERVICE + "ReplaceLimitsTable"),
            b"\xff" * (60 << 20),
            timeout=WAIT_S,
        )
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer <token>" in refused.details()


@pytest.mark.parametrize("method", METHODS)
def test_a_call_without_the_token_is_refused_before_its_request_arrives(served, method):
    with held(served.channel, SERVICE + method, 1) as calls:
        assert _code(calls.calls[0]) == grpc.StatusCode.UNAUTHENTICATED


def test_calls_without_the_token_cannot_hold_the_workers_or_the_call_slots(served):
    """More held calls than the server has call slots: each is refused at once,
    and a call with the token is served meanwhile."""
    per_method = MAX_CONCURRENT_RPCS // len(METHODS) + 1
    with contextlib.ExitStack() as stack:
        calls = [
            call
            for method in METHODS
            for call in stack.enter_context(
                held(served.channel, SERVICE + method, per_method)
            ).calls
        ]
        got = served.stub.GetDefaultLimit(
            pb.GetDefaultLimitRequest(), metadata=WITH_TOKEN, timeout=WAIT_S
        )
        assert got.tokens_per_second == 10
        codes = {_code(call) for call in calls}
    assert codes == {grpc.StatusCode.UNAUTHENTICATED}


def _check(health, **kwargs) -> int:
    return health.Check(
        health_pb2.HealthCheckRequest(), timeout=WAIT_S, **kwargs
    ).status


def _until_refused(health, checks: Held) -> grpc.RpcError:
    """The first health check without a token that is refused, trying for at
    most ``WAIT_S`` (the held checks reach the server in milliseconds). A held
    check that arrived while a probe held a slot was refused: it is replaced."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        checks.refill()
        try:
            _check(health)
        except grpc.RpcError as error:
            return error
        time.sleep(0.01)
    pytest.fail(f"health checks without a token were still served after {WAIT_S} s")


def _until_served(health) -> int:
    """The status of the first health check without a token that is served,
    trying for at most ``WAIT_S`` (the server frees a cancelled call's slot in
    milliseconds)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return _check(health)
        except grpc.RpcError as error:
            if time.monotonic() > deadline:
                raise
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(0.01)


def test_health_checks_without_the_token_are_served_a_few_at_a_time(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    with held(served.channel, HEALTH_CHECK, MAX_OPEN_CHECKS) as checks:
        refused = _until_refused(health, checks)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.details() == (
            f"at most {MAX_OPEN_CHECKS} calls without credentials are served at once"
        )
        # Calls with the token are not held back by them.
        assert (
            _check(health, metadata=WITH_TOKEN)
            == health_pb2.HealthCheckResponse.SERVING
        )
        got = served.stub.GetDefaultLimit(
            pb.GetDefaultLimitRequest(), metadata=WITH_TOKEN, timeout=WAIT_S
        )
        assert got.tokens_per_second == 10
        for check in checks.calls:
            check.cancel()
        # A check that went away frees its slot.
        assert _until_served(health) == health_pb2.HealthCheckResponse.SERVING


def test_a_health_check_without_the_token_reads_a_small_request_only(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    big = health_pb2.HealthCheckRequest(service="x" * MAX_CHECK_REQUEST_BYTES)
    refused = _error(health.Check, big, timeout=WAIT_S)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details() == (
        f"request of {big.ByteSize()} bytes; at most {MAX_CHECK_REQUEST_BYTES} "
        "are parsed without credentials"
    )
    # With the token it is an ordinary call: no such service.
    unknown = _error(health.Check, big, metadata=WITH_TOKEN, timeout=WAIT_S)
    assert unknown.code() == grpc.StatusCode.NOT_FOUND


def test_a_health_watch_needs_the_token(served):
    """A watch would stay open as long as its caller likes."""
    health = health_pb2_grpc.HealthStub(served.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
    with pytest.raises(grpc.RpcError) as info:
        next(watch)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    watch = health.Watch(
        health_pb2.HealthCheckRequest(), metadata=WITH_TOKEN, timeout=WAIT_S
    )
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
