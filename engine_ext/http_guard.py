"""ASGI middleware that settles, before the engine sees a request, who it belongs
to and whether it may run, on every vLLM endpoint whose body can name a user
(``GUARDED_PATHS``: JSON bodies, and the audio endpoints' forms).

It answers 400 for an invalid user id, for beam search, and, when the id comes
from a header or the OpenAI ``user`` field (``--output-rate-user-source``), for
a client-sent ``vllm_xargs.output_rate_user``; 401 for a request that names no
user when ``--output-rate-require-user`` is set. Otherwise it passes the body
on: unchanged, or with the id it read written into the body's extra args, the
one field the engine reads a request's user from. With a gateway source it
also writes the team (``--output-rate-team-source header:NAME``) and the
objective (``OBJECTIVE_HEADERS``, the Inference Extension's and llm-d's) the
gateway named; each is refused from a client's body.

In the attested mode (a gateway source or a required user) it also writes a
fresh request binding and the id's attestation (``pacing.attestation``) there,
and refuses client-sent ones: the engine charges a named user
only when that matches, so a request that reaches the engine around this guard
is charged to ``__anonymous__`` or refused. Websockets (vLLM's ``/v1/realtime``)
carry no extra args: they are anonymous, and refused when a user is required.

vLLM adds it inside its own authentication (``--api-key``), so an
unauthenticated client is refused before its body is read.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import TypeAdapter, ValidationError

# The function Starlette's router matches paths with: the guard must see the
# same path as the router, with or without ``--root-path``. Private, so a
# Starlette that moved it fails at import, not silently.
from starlette._utils import get_route_path

from engine_ext.api_keys import UNAUTHORIZED_BODY, ApiKeys, needs_key
from engine_ext.form_bodies import (
    EncodedForm,
    encode_form,
    read_form,
    unquotable_name,
)
from pacing.attestation import (
    ATTESTATION_FIELD,
    REQUEST_FIELD,
    attest,
    attested_mode,
    key_from,
    new_binding,
)
from pacing.identity import (
    HEADER,
    OBJECTIVE_FIELD,
    OBJECTIVE_HEADERS,
    OPENAI_USER,
    TABLE_TEAM_SOURCE,
    TEAM_FIELD,
    USER_FIELD,
    XARGS,
    XARGS_SOURCE,
    TeamSource,
    UserSource,
    validate_user,
)
from pacing.settings.flags import (
    ALLOW_UNATTRIBUTED_FLAG,
    REQUIRE_USER_FLAG,
    USER_SOURCE_FLAG,
)
from pacing.settings.model import OutputRateSettings

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(f"vllm.{__name__}")


class BodyShape(NamedTuple):
    """Where a guarded endpoint's JSON body carries what the guard checks."""

    #: Keys from the body's top level to the dict vLLM hands the engine as
    #: ``SamplingParams.extra_args``.
    xargs: tuple[str, ...]
    #: Whether the body's top-level ``use_beam_search`` is honoured.
    beam_search: bool
    #: Whether the body's top-level ``user`` is the OpenAI ``user`` field.
    openai_user: bool
    #: Whether the endpoint submits the request to the engine (render
    #: endpoints only build its input): only then is a user charged.
    samples: bool = True
    #: Whether vLLM answers this endpoint's errors in Anthropic's format.
    anthropic_errors: bool = False
    #: Whether the body is a form (multipart or urlencoded) whose
    #: ``vllm_xargs`` field is a JSON string, not a JSON document.
    form: bool = False


_XARGS = ("vllm_xargs",)
_OPENAI = BodyShape(_XARGS, beam_search=True, openai_user=True)
_RESPONSES = BodyShape(_XARGS, beam_search=False, openai_user=True)
_AUDIO = BodyShape(_XARGS, beam_search=True, openai_user=False, form=True)

#: Every vLLM 0.32 endpoint whose body can carry a user id (checked against
#: vLLM's own routes by tests/scheduling/test_http_guard.py), and its body's shape.
GUARDED_PATHS: Mapping[str, BodyShape] = MappingProxyType(
    {
        "/v1/completions": _OPENAI,
        "/v1/chat/completions": _OPENAI,
        # Not a declared field, but vLLM copies extra fields into each
        # conversation's ChatCompletionRequest.
        "/v1/chat/completions/batch": _OPENAI,
        "/v1/responses": _RESPONSES,
        "/v1/messages": BodyShape(
            _XARGS, beam_search=False, openai_user=False, anthropic_errors=True
        ),
        # SageMaker: dispatches a completion or chat body to those handlers.
        "/invocations": _OPENAI,
        # Scale-out (--enable-scale-out, --tokens-only): render only builds the
        # engine input, generate submits it.
        "/v1/completions/render": _OPENAI._replace(samples=False),
        "/v1/chat/completions/render": _OPENAI._replace(samples=False),
        "/v1/responses/render": _RESPONSES._replace(samples=False),
        "/v1/messages/render": BodyShape(
            _XARGS, beam_search=False, openai_user=False, samples=False
        ),
        "/inference/v1/generate": BodyShape(
            ("sampling_params", "extra_args"), beam_search=False, openai_user=False
        ),
        # Served when the model transcribes (Whisper...): a form whose
        # vllm_xargs field vLLM parses with json.loads.
        "/v1/audio/transcriptions": _AUDIO,
        "/v1/audio/translations": _AUDIO,
    }
)

#: vLLM 0.32 endpoints that submit engine requests no user id can reach:
#: generation built from named fields only, and pooling (no sampling params).
#: Charged to ``__anonymous__``; refused when a user is required (401) and,
#: unless ``--output-rate-allow-unattributed-routes``, with a gateway source
#: (403): a tenant must not choose the anonymous budget by choosing a route.
UNATTRIBUTED_PATHS = frozenset(
    {
        "/v1/systemone",
        "/generative_scoring",
        "/cohere/v2/chat",
        # Pooling models only.
        "/pooling",
        "/classify",
        "/v1/embeddings",
        "/v2/embed",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
#: Scores each of its ``items`` in an engine request of its own.
SCORING_PATH = "/generative_scoring"
#: The most ``items`` one ``/generative_scoring`` request may fan out to.
MAX_SCORING_ITEMS = 64

#: vLLM reads ``use_beam_search`` as a pydantic ``bool`` (lax: "true", "on", 1...).
_PYDANTIC_BOOL = TypeAdapter(bool)


class IdentityPolicy(NamedTuple):
    """Where a request's user id comes from, whether one is required, the
    key that attests it (the attested mode only), where its team comes
    from (a header only with a gateway user source), and whether routes no id
    can reach are served with a gateway source."""

    source: UserSource = XARGS_SOURCE
    require_user: bool = False
    key: bytes | None = None
    team_source: TeamSource = TABLE_TEAM_SOURCE
    allow_unattributed: bool = False

    @classmethod
    def from_settings(
        cls, paced: OutputRateSettings, environ: Mapping[str, str]
    ) -> IdentityPolicy:
        """The policy of ``paced``; raises AttestationKeyError when the
        attested mode has no key in ``environ``."""
        attested = attested_mode(paced.user_source, paced.require_user)
        key = key_from(environ) if attested else None
        return cls(
            paced.user_source,
            paced.require_user,
            key,
            paced.team_source,
            paced.allow_unattributed,
        )


#: Today's behaviour: the client names its user in the body, or none.
DEFAULT_POLICY = IdentityPolicy()
#: What ``_named_user`` finds where a request names no user.
_ABSENT = object()


class Rejection(NamedTuple):
    """Why a request is refused, the body field to blame (if any), and the
    HTTP status: 400 for a bad request, 401 for one that names no user."""

    message: str
    param: str | None
    status: int = 400


def check_request_body(
    body: bytes,
    shape: BodyShape,
    policy: IdentityPolicy = DEFAULT_POLICY,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> bytes | Rejection:
    """The body to pass on for a guarded endpoint's JSON request, or the
    reason to refuse it. ``headers`` are the request's, as ASGI hands them over.

    The body passed on is ``body`` itself, unless ``check_payload`` has extra
    args to write: then it is ``body`` with those (re-encoded by ``json.dumps``,
    which ``json.loads`` reads back to the same values).

    A body that ``json.loads`` cannot parse (invalid JSON or UTF-8, an integer
    beyond Python's digit limit) is passed on unchanged: vLLM parses the same
    bytes with the same function in the same process, so it fails the same way
    and answers 400 itself. A body nested too deep for the parser's recursion
    limit is rejected here: that limit depends on the stack depth, so vLLM,
    parsing it elsewhere, might read a user this guard never checked. There is
    no size limit beyond vLLM's own (none): the body is buffered once and
    replayed.
    """
    try:
        payload = json.loads(body)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, too many digits
        return body
    except RecursionError:
        field = ".".join((*shape.xargs, USER_FIELD))
        return Rejection(f"request body is nested too deeply to check {field}", None)
    if not isinstance(payload, dict):
        return body
    written = check_payload(payload, shape, policy, headers)
    if written is None or isinstance(written, Rejection):
        return body if written is None else written
    return _with_xargs(payload, shape, written)


def check_payload(
    payload: dict[str, Any],
    shape: BodyShape,
    policy: IdentityPolicy,
    headers: Sequence[tuple[bytes, bytes]],
) -> dict[str, str] | Rejection | None:
    """What to write into the extra args of a request whose parsed body is
    ``payload`` (None: nothing, pass the body on as it is), or the reason to
    refuse it.

    The id is written when it comes from a header or the ``user`` field
    (``policy.source``), with its attestation in the attested mode, and only
    where the endpoint samples. A request that names no user is charged to
    ``__anonymous__``, or refused with 401 when ``policy.require_user`` is set
    and it samples. With such a gateway source, the team (a team header
    source) and the objective (``OBJECTIVE_HEADERS``) the gateway named are
    written and attested beside the id; a bad one is refused with 400 even
    where nothing is written.
    """
    field = ".".join((*shape.xargs, USER_FIELD))
    if shape.beam_search and _asks_for_beam_search(payload):
        return Rejection(
            "beam search is not supported with per-user output pacing",
            "use_beam_search",
        )
    xargs: Any = payload
    for key in shape.xargs:
        xargs = xargs.get(key) if isinstance(xargs, dict) else None
    sent = isinstance(xargs, dict) and USER_FIELD in xargs
    source = policy.source
    if sent and source.kind != XARGS:
        return Rejection(
            f"{field} must not be sent: this server takes the user id from "
            f"{source.where} ({USER_SOURCE_FLAG} {source.spec})",
            field,
        )
    if policy.key is not None and isinstance(xargs, dict):
        for written_here in (
            ATTESTATION_FIELD,
            REQUEST_FIELD,
            TEAM_FIELD,
            OBJECTIVE_FIELD,
        ):
            if written_here in xargs:
                where = ".".join((*shape.xargs, written_here))
                return Rejection(
                    f"{where} must not be sent: only this server writes it", where
                )
    team: str | None = None
    team_header = policy.team_source.header
    if team_header is not None:
        sent_team = _header_value(headers, team_header, policy.team_source.where)
        if isinstance(sent_team, Rejection):
            return sent_team
        if sent_team:  # an empty header names no team, as for users
            try:
                team = validate_user(sent_team, field=policy.team_source.where)
            except ValueError as exc:
                return Rejection(str(exc), None)
    objective: str | None = None
    if source.kind != XARGS:
        # Trusted only from the gateway that names the user, as the team.
        named_objective = _named_objective(headers)
        if isinstance(named_objective, Rejection):
            return named_objective
        objective = named_objective
    named = _named_user(payload, xargs if sent else None, shape, source, headers)
    if isinstance(named, Rejection):
        return named
    user, where = named
    # A header is no body field: there is no param to blame.
    param = None if source.kind == HEADER else where
    if user is _ABSENT:
        if policy.require_user and shape.samples:
            return _no_user(source, shape, where, param)
        return None
    try:
        valid = validate_user(user, field=where)
    except ValueError as exc:
        return Rejection(str(exc), param)
    if not shape.samples or (source.kind == XARGS and policy.key is None):
        return None
    written = {USER_FIELD: valid}
    if team is not None:
        written[TEAM_FIELD] = team
    if objective is not None:
        written[OBJECTIVE_FIELD] = objective
    if policy.key is not None:
        # Binds the attestation to this HTTP request: every engine request vLLM
        # derives from it carries the same extra args.
        binding = written[REQUEST_FIELD] = new_binding()
        written[ATTESTATION_FIELD] = attest(
            policy.key,
            valid,
            int(time.time()),
            binding=binding,
            team=team,
            objective=objective,
        )
    return written


def _named_objective(headers: Sequence[tuple[bytes, bytes]]) -> str | Rejection | None:
    """The objective the gateway named in ``OBJECTIVE_HEADERS`` (None: none;
    an empty header names none, as for users), under the user-id rule; sent
    under both names, the two must agree. Whether the policy maps it to a band
    is the engine's to decide: the policy can change there at any time."""
    sent: list[tuple[str, str]] = []
    for header in OBJECTIVE_HEADERS:
        where = f"request header {header}"
        value = _header_value(headers, header, where)
        if isinstance(value, Rejection):
            return value
        if value is not None:
            sent.append((where, value))
    if len(sent) > 1 and sent[0][1] != sent[1][1]:
        current, deprecated = OBJECTIVE_HEADERS
        return Rejection(
            f"request headers {current} and {deprecated} (its deprecated name) "
            "name different objectives: send one, or both with the same value",
            None,
        )
    if not sent or not sent[0][1]:
        return None
    where, value = sent[0]
    try:
        return validate_user(value, field=where)
    except ValueError as exc:
        return Rejection(str(exc), None)


def _named_user(
    payload: dict[str, Any],
    xargs: dict[str, Any] | None,
    shape: BodyShape,
    source: UserSource,
    headers: Sequence[tuple[bytes, bytes]],
) -> tuple[object, str] | Rejection:
    """The user id the request names where ``source`` says (``_ABSENT``: none;
    not yet validated) and that place in words; ``xargs`` is the body's extra
    args if they hold ``output_rate_user``. An empty or null header or ``user``
    field names no user; an empty or null ``output_rate_user`` is invalid, as
    it always was."""
    if source.kind == XARGS:
        where = ".".join((*shape.xargs, USER_FIELD))
        return (_ABSENT if xargs is None else xargs[USER_FIELD]), where
    if source.kind == HEADER:
        assert source.header is not None  # a header source names one
        value = _header_value(headers, source.header, source.where)
        if isinstance(value, Rejection):
            return value
        return (value or _ABSENT), source.where
    value = payload.get("user") if shape.openai_user else None
    return (_ABSENT if value in (None, "") else value), "user"


def _header_value(
    headers: Sequence[tuple[bytes, bytes]], header: str, where: str
) -> str | Rejection | None:
    """The value of header ``header`` (``where``: its name in messages),
    stripped as HTTP field values are; None when absent."""
    name = header.encode("latin-1")
    values = [value for key, value in headers if key.lower() == name]
    if not values:
        return None
    if len(values) > 1:
        return Rejection(f"{where} must be sent once, got {len(values)}", None)
    try:
        value = values[0].decode("utf-8").strip(" \t")
    except UnicodeDecodeError:
        return Rejection(f"{where} must be UTF-8", None)
    if "," in value:
        # A proxy merges a header sent twice into "a, b": each combination
        # would be an id (and a budget) of its own.
        return Rejection(
            f"{where} must hold one id: it must not contain a comma",
            None,
        )
    return value


def _no_user(
    source: UserSource, shape: BodyShape, where: str, param: str | None
) -> Rejection:
    if source.kind == OPENAI_USER:
        missing = (
            "the OpenAI `user` field is missing or empty"
            if shape.openai_user
            else "this endpoint's body has no OpenAI `user` field"
        )
    elif source.kind == XARGS:
        missing = f"{where} is missing"
    else:
        missing = f"{where} is missing or empty"
    return _unauthorized(missing, param)


def _unauthorized(missing: str, param: str | None) -> Rejection:
    return Rejection(
        f"no user id: {missing}; this server charges every request to a user "
        f"({REQUIRE_USER_FLAG})",
        param,
        401,
    )


def _unattributed_refusal(policy: IdentityPolicy, why: str) -> Rejection | None:
    """Why a request to a route no user id can reach is refused (``why``: the
    route in words), or None to charge it to ``__anonymous__``."""
    if policy.require_user:
        return _unauthorized(why, None)
    if policy.source != XARGS_SOURCE and not policy.allow_unattributed:
        return Rejection(
            f"no user id: {why}, and this server takes the user id from "
            f"{policy.source.where} ({USER_SOURCE_FLAG} {policy.source.spec}); "
            f"{ALLOW_UNATTRIBUTED_FLAG} serves such routes, charged to the "
            "shared anonymous budget",
            None,
            403,
        )
    return None


def check_scoring_body(body: bytes) -> Rejection | None:
    """Why a ``/generative_scoring`` body is refused (its ``items`` would fan
    out to more than ``MAX_SCORING_ITEMS`` engine requests), or None to pass
    it on (vLLM answers a body it cannot parse itself)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    except RecursionError:
        return Rejection("request body is nested too deeply to check items", None)
    items = payload.get("items") if isinstance(payload, dict) else None
    if isinstance(items, list) and len(items) > MAX_SCORING_ITEMS:
        return Rejection(
            f"items must hold at most {MAX_SCORING_ITEMS} entries, got {len(items)}: "
            "each is an engine request of its own",
            "items",
        )
    return None


def _with_xargs(
    payload: dict[str, Any], shape: BodyShape, written: dict[str, str]
) -> bytes | Rejection:
    """``payload`` encoded with ``written`` merged into its extra args, or a
    rejection when a key on the way holds something other than an object (vLLM
    would refuse that body too)."""
    target = payload
    for depth, key in enumerate(shape.xargs):
        inner = target.get(key)
        last = depth == len(shape.xargs) - 1
        if inner is None and last:
            inner = {}
        if not isinstance(inner, dict):
            where = ".".join(shape.xargs[: depth + 1])
            return Rejection(f"{where} must be an object", where)
        if last:
            target[key] = {**inner, **written}
        target = inner
    return json.dumps(payload).encode()


def _asks_for_beam_search(payload: dict[str, Any]) -> bool:
    try:
        return _PYDANTIC_BOOL.validate_python(payload.get("use_beam_search", False))
    except ValidationError:
        return False  # vLLM rejects the value itself


def policy_of(app: object) -> IdentityPolicy:
    """The identity policy of the server ``app`` serves: its settings, read
    from the ``vllm_config`` vLLM keeps in the app's state."""
    try:
        vllm_config = app.state.vllm_config  # type: ignore[attr-defined]
    except AttributeError:
        raise RuntimeError(
            "vLLM internals moved: the API server's app state holds no "
            "vllm_config; engine_ext supports vLLM 0.32.x only"
        ) from None
    paced = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    return IdentityPolicy.from_settings(paced, os.environ)


class OutputRateRequestGuard:
    """With an API key set, refuses (401) every request without it but the
    probes (``engine_ext.api_keys``). Buffers the body of POSTs to
    ``GUARDED_PATHS``, refuses a bad one, and replays the body (as
    ``check_request_body`` or ``check_form_body`` returns it) to the app
    otherwise. Refuses POSTs to ``UNATTRIBUTED_PATHS`` and every websocket
    with a user required (401) or a gateway source (403, unless
    ``--output-rate-allow-unattributed-routes``), and bounds the fan-out of
    ``/generative_scoring`` where it is served."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str] = ()) -> None:
        self.app = app
        self._keys = ApiKeys(api_keys)
        #: Read on the first request: vLLM sets the app's state after it adds
        #: middleware.
        self._policy: IdentityPolicy | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = get_route_path(scope)
        if (
            self._keys
            and needs_key(kind, scope.get("method"), path)
            and not self._keys.admits(scope["headers"])
        ):
            await _refuse_unauthenticated(scope, receive, send)
            return
        if kind == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        shape = GUARDED_PATHS.get(path)
        if shape is None and path not in UNATTRIBUTED_PATHS:
            await self.app(scope, receive, send)
            return
        if self._policy is None:
            self._policy = policy_of(scope.get("app"))
        if shape is None:
            refused = _unattributed_refusal(
                self._policy, "this endpoint cannot carry one to the scheduler"
            )
            if refused is not None:
                await _send_error(send, refused, anthropic=False)
                return
            if path == SCORING_PATH:
                await self._bounded_fan_out(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        received = await _read_body(receive)
        if received is None:
            return
        body: bytes | Rejection
        try:
            if shape.form:
                checked = await check_form_body(scope, received, shape, self._policy)
                if isinstance(checked, EncodedForm):
                    body, content_type = checked
                    scope = {
                        **scope,
                        "headers": _with_header(
                            scope["headers"], b"content-type", content_type
                        ),
                    }
                else:
                    body = checked
            else:
                body = check_request_body(
                    received, shape, self._policy, scope["headers"]
                )
        except Exception:
            # Fail closed: a request whose user was not checked must not reach
            # the engine, and a bug here must not become a 500.
            logger.exception("output-rate guard failed on a %s body", scope["path"])
            body = Rejection("request body could not be checked", None)
        if isinstance(body, Rejection):
            await _send_error(send, body, anthropic=shape.anthropic_errors)
            return
        if body is not received:
            length = str(len(body)).encode()
            scope = {
                **scope,
                "headers": _with_header(scope["headers"], b"content-length", length),
            }
        await self.app(scope, _replayer(body, receive), send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A websocket (vLLM's ``/v1/realtime``) builds its requests without
        extra args: anonymous, and refused at the handshake (close code 1008,
        which the server answers with 403) when a user is required or the
        user comes from a gateway (unless unattributed routes are allowed)."""
        if self._policy is None:
            self._policy = policy_of(scope.get("app"))
        refused = _unattributed_refusal(
            self._policy, "a websocket cannot carry one to the scheduler"
        )
        if refused is None:
            await self.app(scope, receive, send)
            return
        await _close_websocket(receive, send, refused.message)

    async def _bounded_fan_out(
        self, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Passes a ``/generative_scoring`` request on unless its ``items``
        list, one engine request each, is longer than ``MAX_SCORING_ITEMS``."""
        body = await _read_body(receive)
        if body is None:
            return
        refused = check_scoring_body(body)
        if refused is not None:
            await _send_error(send, refused, anthropic=False)
            return
        await self.app(scope, _replayer(body, receive), send)


async def check_form_body(
    scope: Scope, body: bytes, shape: BodyShape, policy: IdentityPolicy
) -> bytes | EncodedForm | Rejection:
    """For a guarded endpoint's form request: ``body`` itself to pass it on
    unchanged, a new body and its content type when extra args are written
    (the whole form encoded anew, see ``engine_ext.form_bodies``), or the
    reason to refuse it. ``vllm_xargs`` is a JSON string, read as vLLM reads it
    (``json.loads``); a field the checks read must be sent at most once."""
    form = await read_form(scope, body)
    if form is None:
        return body  # vLLM's parser refuses the same bytes
    payload: dict[str, Any] = {}
    for name in {shape.xargs[0], "use_beam_search"}:
        values = form.getlist(name)
        if len(values) > 1:
            return Rejection(f"{name} must be sent once, got {len(values)}", name)
        if values and not isinstance(values[0], str):
            return Rejection(f"{name} must be a form field, not a file", name)
        if values:
            payload[name] = values[0]
    xargs_text = payload.get(shape.xargs[0])
    if xargs_text is not None:
        try:
            payload[shape.xargs[0]] = json.loads(xargs_text)
        except ValueError:
            return body  # vLLM answers 400 for the same string
        except RecursionError:
            return Rejection(f"{shape.xargs[0]} is nested too deeply to check", None)
    written = check_payload(payload, shape, policy, scope["headers"])
    if written is None or isinstance(written, Rejection):
        return body if written is None else written
    xargs = payload.get(shape.xargs[0])
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        return Rejection(f"{shape.xargs[0]} must be an object", shape.xargs[0])
    odd = unquotable_name(form)
    if odd is not None:
        return Rejection(
            "form field and file names must not contain quotes, backslashes or "
            "line breaks",
            None,
        )
    merged = json.dumps({**xargs, **written})
    fields = [(name, value) for name, value in form.multi_items()]
    fields = [
        (name, merged if name == shape.xargs[0] else value) for name, value in fields
    ]
    if xargs_text is None:
        fields.append((shape.xargs[0], merged))
    encoded = await encode_form(fields)
    await form.close()
    return encoded


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client went away first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replayer(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` at once, then ``receive``'s
    messages (the client's disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse_unauthenticated(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers a request without a valid API key as vLLM does (401), before
    its body is read; a websocket's handshake is refused."""
    if scope["type"] == "websocket":
        await _close_websocket(receive, send, "Unauthorized")
        return
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(UNAUTHORIZED_BODY)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})


async def _close_websocket(receive: Receive, send: Send, reason: str) -> None:
    """Refuses a websocket at its handshake: close code 1008 (policy
    violation), which the server answers with 403."""
    message = await receive()
    if message["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1008, "reason": reason})


def _with_header(
    headers: Sequence[tuple[bytes, bytes]], name: bytes, value: bytes
) -> list[tuple[bytes, bytes]]:
    """``headers`` with ``name`` (lower case) set to ``value`` alone."""
    kept = [(k, v) for k, v in headers if k.lower() != name]
    return [*kept, (name, value)]


#: The error type vLLM's OpenAI errors name for a status.
_ERROR_TYPES = {401: "AuthenticationError", 403: "PermissionDeniedError"}


async def _send_error(send: Send, rejection: Rejection, *, anthropic: bool) -> None:
    """Answers ``rejection`` in the error format vLLM uses on the endpoint."""
    kind = _ERROR_TYPES.get(rejection.status, "BadRequestError")
    if anthropic:
        error: dict[str, Any] = {
            "type": "error",
            "error": {"type": kind, "message": rejection.message},
        }
    else:
        error = {
            "error": {
                "message": rejection.message,
                "type": kind,
                "param": rejection.param,
                "code": rejection.status,
            }
        }
    payload = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": rejection.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
