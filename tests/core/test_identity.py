"""The one rule for a valid user id (``pacing.identity.validate_user``), and
proof that every entry point applies it: the limits file, the flags, the gRPC
control plane (a real server) and offline requests. The HTTP guard's own tests
are in test_http_guard.py and test_e2e_server.py."""

from __future__ import annotations

import json
import unicodedata

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from control import names
from control.errors import InvalidArgument
from control.persistence import ConfigFile
from control.service.operations import LimitsService
from control.table import loads, shown
from engine_ext.http_guard import (
    GUARDED_PATHS,
    IdentityPolicy,
    Rejection,
    check_request_body,
)
from pacing.identity import (
    ANONYMOUS_USER,
    MAX_USER_BYTES,
    USER_FIELD,
    XARGS_SOURCE,
    UserSource,
    parse_user_source,
    user_from_extra_args,
    validate_user,
)
from pacing.settings.checks import SettingsError
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving
from tests.settings_harness import settings_of

SURROGATE = "bad\ud800"
C1 = "a\u0085b"  # NEXT LINE, category Cc

# -- the rule ----------------------------------------------------------------

INVALID = [
    # (id, value, message part)
    ("lone high surrogate", SURROGATE, "well-formed Unicode"),
    ("lone low surrogate", "x\udc00", "well-formed Unicode"),
    ("surrogate only", "\ud83d", "well-formed Unicode"),
    ("NUL", "a\x00b", "control characters"),
    ("newline", "a\nb", "control characters"),
    ("tab", "a\tb", "control characters"),
    ("unit separator", "a\x1fb", "control characters"),
    ("DEL", "a\x7fb", "control characters"),
    ("C1 first", "a\x80b", "control characters"),
    ("C1 NEL", C1, "control characters"),
    ("C1 last", "a\x9fb", "control characters"),
    ("line separator", "a\u2028b", "line separators"),
    ("paragraph separator", "a\u2029b", "paragraph separators"),
    ("zero-width space", "a\u200bb", "invisible format characters"),
    ("zero-width joiner", "\U0001f468\u200d\U0001f469", "format characters"),
    ("BOM", "\ufeffalice", "invisible format characters"),
    ("RTL override", "alice\u202etxt.exe", "invisible format characters"),
    ("soft hyphen", "al\u00adice", "invisible format characters"),
    ("tag character", "a\U000e0041", "invisible format characters"),
    ("empty", "", "must not be empty"),
    ("257 ASCII bytes", "x" * 257, f"at most {MAX_USER_BYTES} bytes"),
    ("257 bytes of 2-byte chars", "x" + "é" * 128, f"at most {MAX_USER_BYTES}"),
    ("258 bytes of 3-byte chars", "中" * 86, f"at most {MAX_USER_BYTES} bytes"),
    ("260 bytes of 4-byte chars", "\U0001f600" * 65, f"at most {MAX_USER_BYTES}"),
    ("int", 5, "must be a string, got int"),
    ("None", None, "must be a string, got NoneType"),
    ("bytes", b"alice", "must be a string, got bytes"),
    ("list", ["alice"], "must be a string, got list"),
    ("bool", True, "must be a string, got bool"),
]

VALID = [
    # (id, value)
    ("ascii", "alice"),
    ("one char", "a"),
    ("slash", "team/alice"),
    ("spaces", " alice smith "),
    ("punctuation", "a-b_c.d@e:f+g"),
    ("CJK", "用户一"),
    ("emoji", "\U0001f600 smile"),
    ("emoji with variation selector", "\u2764\ufe0f"),
    ("flag emoji", "\U0001f1fa\U0001f1e6"),
    ("combining accent", "e\u0301"),
    ("no-break space", "a\u00a0b"),
    ("ideographic space", "a\u3000b"),
    ("private use", "\ue000"),
    ("256 ASCII bytes", "x" * 256),
    ("256 bytes of 2-byte chars", "é" * 128),
    ("256 bytes mixed 3-byte", "中" * 85 + "x"),
    ("256 bytes of 4-byte chars", "\U0001f600" * 64),
]


@pytest.mark.parametrize(
    ("value", "message"),
    [(value, message) for _, value, message in INVALID],
    ids=[case[0] for case in INVALID],
)
def test_invalid_ids_are_refused_with_a_message_naming_the_field(value, message):
    with pytest.raises(ValueError) as info:
        validate_user(value, field="the field")
    assert str(info.value).startswith("the field ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "value", [value for _, value in VALID], ids=[case[0] for case in VALID]
)
def test_valid_ids_are_returned_unchanged(value):
    assert validate_user(value) is value


def test_the_byte_limit_counts_utf8_bytes_not_characters():
    assert len(("é" * 128).encode()) == MAX_USER_BYTES
    validate_user("é" * 128)
    with pytest.raises(ValueError, match="at most 256 bytes"):
        validate_user("é" * 128 + "x")


@pytest.mark.parametrize(
    "value",
    ["x" * 10_000 + "\x85", "\ud800" * 10_000, "\u200b" * 300, SURROGATE, C1],
    ids=["long with C1", "long surrogates", "long Cf", "surrogate", "C1"],
)
def test_error_messages_never_echo_the_value(value):
    with pytest.raises(ValueError) as info:
        validate_user(value, field="f")
    message = str(info.value)
    assert len(message) < 120
    message.encode("utf-8")  # plain text, safe to send anywhere
    assert value not in message


FORBIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def _is_valid(value: str) -> bool:
    """The documented rule, written out plainly."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    return 1 <= size <= MAX_USER_BYTES and not any(
        unicodedata.category(ch) in FORBIDDEN for ch in value
    )


@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=80))
def test_validation_matches_the_documented_rule(value):
    """The fast path (``str.isprintable``) decides exactly as the rule does,
    over all of Unicode, surrogates included."""
    try:
        validate_user(value)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == _is_valid(value)


# -- every entry point --------------------------------------------------------

# -- where the id comes from (--output-rate-user-source) ----------------------


@pytest.mark.parametrize(
    ("raw", "source", "where"),
    [
        ("xargs", XARGS_SOURCE, "vllm_xargs.output_rate_user"),
        (" XArgs ", XARGS_SOURCE, "vllm_xargs.output_rate_user"),
        ("openai-user", UserSource("openai-user"), "the OpenAI `user` field"),
        ("OpenAI-User", UserSource("openai-user"), "the OpenAI `user` field"),
        (
            "header:X-User-Id",
            UserSource("header", "x-user-id"),
            "request header x-user-id",
        ),
        (
            "HEADER: x-user-id ",
            UserSource("header", "x-user-id"),
            "request header x-user-id",
        ),
        (
            "header:X_Consumer~1",
            UserSource("header", "x_consumer~1"),
            "request header x_consumer~1",
        ),
    ],
)
def test_user_sources_parse_case_insensitively_and_round_trip(raw, source, where):
    parsed = parse_user_source(raw)
    assert parsed == source
    assert parsed.where == where
    assert parse_user_source(parsed.spec) == parsed


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("body", "the flag must be xargs, header:NAME or openai-user, got 'body'"),
        ("", "the flag must be xargs, header:NAME or openai-user, got ''"),
        ("openai", "must be xargs, header:NAME or openai-user"),
        ("header:", "the flag names no valid HTTP header ('')"),
        ("header:X User", "names no valid HTTP header ('X User')"),
        ("header:x-user:id", "names no valid HTTP header"),
        ("header:x-üser", "names no valid HTTP header"),
        ("header::authority", "names no valid HTTP header"),
        ("header:Authorization", "the flag must not be Authorization: it carries a"),
        ("header:proxy-authorization", "carries a credential"),
        ("header:COOKIE", "carries a credential"),
        (5, "the flag must be a string (xargs, header:NAME or openai-user), got int"),
        (None, "must be a string"),
    ],
)
def test_bad_user_sources_are_refused_naming_the_field(raw, message):
    with pytest.raises(ValueError) as info:
        parse_user_source(raw, field="the flag")
    assert message in str(info.value)


BAD_IDS = pytest.mark.parametrize(
    ("user", "message"),
    [(SURROGATE, "well-formed Unicode"), (C1, "control characters")],
    ids=["surrogate", "C1"],
)


@BAD_IDS
@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_the_limits_file_refuses_the_id(user, message, fmt):
    # JSON is valid YAML, and its \\uXXXX escapes mean the same in YAML.
    text = json.dumps({"default_tokens_per_second": 1000, "users": {user: 3}})
    with pytest.raises(InvalidArgument) as info:
        loads(text, fmt, source="limits")
    assert str(info.value).startswith(f"limits: users[{shown(user)}]: user id must ")
    assert message in str(info.value)


def test_the_issue_reproduction_file_is_refused(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(
        '{"default_tokens_per_second":1000,"users":{"slow":5,"bad\\ud800":3}}\n'
    )
    with pytest.raises(InvalidArgument, match="lone surrogate") as info:
        ConfigFile(path).load()
    str(info.value).encode("utf-8")  # the message itself is safe to log or send


def test_a_huge_bad_id_in_the_file_is_not_echoed():
    huge = "x" * 100_000 + "\\u0085"
    with pytest.raises(InvalidArgument) as info:
        loads(f'{{"users": {{"{huge}": 1}}}}', "json", source="f")
    assert len(str(info.value)) < 200


@BAD_IDS
def test_the_flags_refuse_the_id(user, message):
    with pytest.raises(SettingsError, match=message):
        settings_of(default_rate=1000, user_rates={"slow": 5, user: 3})
    with pytest.raises(SettingsError, match=message):
        settings_of(
            default_rate=1000, user_rates=json.loads(json.dumps({"slow": 5, user: 3}))
        )


@BAD_IDS
def test_offline_requests_refuse_the_id(user, message):
    with pytest.raises(ValueError, match=message):
        user_from_extra_args({USER_FIELD: user})
    assert user_from_extra_args({}) == ANONYMOUS_USER


@BAD_IDS
def test_the_http_guard_refuses_the_id_from_every_source(user, message):
    shape = GUARDED_PATHS["/v1/completions"]
    from_xargs = json.dumps({"prompt": "hi", "vllm_xargs": {USER_FIELD: user}})
    from_user = json.dumps({"prompt": "hi", "user": user})
    header = [(b"x-user-id", user.encode("utf-8", "surrogatepass"))]
    verdicts = {
        "xargs": check_request_body(from_xargs.encode(), shape),
        "openai-user": check_request_body(
            from_user.encode(), shape, IdentityPolicy(parse_user_source("openai-user"))
        ),
        "header": check_request_body(
            b'{"prompt": "hi"}',
            shape,
            IdentityPolicy(parse_user_source("header:X-User-Id")),
            header,
        ),
    }
    # A header's bytes are decoded as strict UTF-8: a surrogate's never decode.
    well_formed = user != SURROGATE
    for source, verdict in verdicts.items():
        assert isinstance(verdict, Rejection), source
        assert verdict.status == 400
        expected = message if well_formed or source != "header" else "must be UTF-8"
        assert expected in verdict.message, source


@BAD_IDS
def test_grpc_resource_names_refuse_the_id(user, message):
    with pytest.raises(InvalidArgument, match=message):
        names.parse_user(names.limit_name(user), names.LIMITS, field="name")


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5})


@pytest.fixture
def served(rig):
    with serving(LimitsService(rig.shared)) as served:
        yield served


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (C1, "control characters"),
        ("a\u2028b", "line separators"),
        ("a\u200bb", "invisible format characters"),
    ],
    ids=["C1", "U+2028", "U+200B"],
)
def test_grpc_refuses_the_id_with_invalid_argument(served, rig, bad, message):
    calls = [
        lambda: served.stub.CreateLimit(
            pb.CreateLimitRequest(limit_id=bad, limit=pb.Limit(tokens_per_second=3))
        ),
        lambda: served.stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name=names.limit_name(bad), tokens_per_second=3),
                allow_missing=True,
            )
        ),
        lambda: served.stub.GetLimit(pb.GetLimitRequest(name=names.limit_name(bad))),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
    assert rig.limiter.user_rates == {"alice": 5}


def test_a_surrogate_cannot_reach_the_grpc_service(served, rig):
    """Protobuf strings are UTF-8: a client cannot encode a surrogate, and the
    bytes one would encode to are refused before the servicer runs."""
    with pytest.raises(ValueError):
        pb.CreateLimitRequest(limit_id=SURROGATE)
    wire = pb.CreateLimitRequest(
        limit_id="badXXX", limit=pb.Limit(tokens_per_second=3)
    ).SerializeToString()
    wire = wire.replace(b"XXX", b"\xed\xa0\x80")  # "\ud800" as surrogatepass
    raw_call = served.channel.unary_unary(
        "/outputrate.v1.OutputRateControl/CreateLimit"
    )
    with pytest.raises(grpc.RpcError) as info:
        raw_call(wire)
    # grpc's own answer to an undecodable request; no servicer code ran.
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "Exception deserializing request!"
    assert rig.limiter.user_rates == {"alice": 5}
    assert served.server.rpc_counts.snapshot() == {}
