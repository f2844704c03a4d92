"""tools.vllm_drift: no drift in the installed vLLM 0.32.0, each kind of drift
found in small source trees written here, clear errors for what is not vLLM,
and the list of internals (tools.vllm_internals) covering what our code names."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import zipfile
from pathlib import Path

import pytest

from engine_ext.scheduling.upstream import REQUEST_FIELDS, STEP_HOOK_NAMES
from tools.vllm_drift import (
    MISSING,
    MOVED,
    SAME,
    SIGNATURE,
    SourceError,
    VllmSource,
    check_all,
    drifted,
    main,
)
from tools.vllm_internals import INTERNALS, REFERENCE_VERSION, Internal, Uses

REPO = Path(__file__).resolve().parents[2]


def _installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def test_the_installed_vllm_is_the_reference_and_nothing_drifted(capsys):
    source = VllmSource(_installed_vllm())
    assert source.version == REFERENCE_VERSION
    results = check_all(source)
    assert len(results) == len(INTERNALS)
    assert drifted(results) == []
    assert main([str(_installed_vllm())]) == 0
    assert f"vLLM {REFERENCE_VERSION} (" in capsys.readouterr().out


def test_the_hooks_call_sites_relied_on_are_those_of_the_reference():
    """The places docs/development.md's hooks table states, as the list records
    them."""
    uses = {i.label: i.uses for i in INTERNALS if i.uses is not None}
    lookahead = uses["Scheduler._reserve_prefill_lookahead"]
    assert lookahead is not None
    assert sorted(lookahead.expected) == [
        "schedule: running loop",
        "schedule: waiting loop",
    ]
    blocked = uses["Scheduler._handle_blocked_waiting_request"]
    assert blocked is not None and blocked.expected == ("schedule: waiting loop",)
    active = uses["Scheduler.max_num_active_reqs"]
    assert active is not None and active.method is None  # anywhere in Scheduler
    assert active.expected == ("schedule: waiting loop (if → break)",)


# -- synthetic sources ----------------------------------------------------------

SCHED = """
from vllm.base import Base


class Scheduler(Base):
    def __init__(self, config):
        self.running = []
        self.waiting = []
        self.kv_holding_waiting = []
        self.max_num_active_reqs = config

    def _reserve(self, request, num_new_tokens):
        return num_new_tokens

    def _blocked(self, request):
        return True

    @staticmethod
    def add_cli_args(parser, strict=False):
        return parser

    def schedule(self):
        index = 0
        while index < len(self.running):
            tokens = self._reserve(self.running[index], 1)
            index += 1
        while True:
            queue = self.kv_holding_waiting or self.waiting
            if len(self.running) >= self.max_num_active_reqs:
                break
            if not self._blocked(queue[0]):
                continue
            tokens = self._reserve(queue[0], 1)
            self.running.append(queue.pop(0))
        return tokens
"""

BASE = """
class Base:
    def step(self):
        return None
"""

MODULE = "vllm.sched"
USES_SCHEDULE = {"module": MODULE, "owner": "Scheduler", "method": "schedule"}

#: A table of the same shape as tools.vllm_internals' for the source above.
TABLE = (
    Internal(MODULE, "Scheduler", "Scheduler", "class", "Base", "test"),
    Internal(
        MODULE,
        "Scheduler",
        "_reserve",
        "method",
        "(self, request, num_new_tokens)",
        "test",
        uses=Uses(
            access="call",
            expected=("schedule: running loop", "schedule: waiting loop"),
            **USES_SCHEDULE,
        ),
    ),
    Internal(
        MODULE,
        "Scheduler",
        "_blocked",
        "method",
        "(self, request)",
        "test",
        uses=Uses(access="call", expected=("schedule: waiting loop",), **USES_SCHEDULE),
    ),
    Internal(
        MODULE,
        "Scheduler",
        "add_cli_args",
        "method",
        "@staticmethod (parser, strict=False)",
        "test",
        direct=True,
    ),
    Internal(MODULE, "Scheduler", "step", "method", "(self)", "test"),
    Internal(
        MODULE,
        "Scheduler",
        "max_num_active_reqs",
        "attribute",
        "instance attribute",
        "test",
        uses=Uses(
            MODULE,
            "Scheduler",
            "read",
            ("schedule: waiting loop (if → break)",),
            statement=True,
        ),
    ),
)


def _tree(root: Path, sched: str = SCHED, base: str = BASE) -> Path:
    package = root / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text("__version__ = version = '9.9.0'\n")
    (package / "sched.py").write_text(sched)
    (package / "base.py").write_text(base)
    return root


def _changed(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def _statuses(root: Path) -> dict[str, tuple[str, str]]:
    results = check_all(VllmSource(root), TABLE)
    return {r.internal: (r.status, r.detail) for r in results}


def test_the_synthetic_source_as_written_has_no_drift(tmp_path):
    statuses = _statuses(_tree(tmp_path))
    assert {status for status, _ in statuses.values()} == {SAME}, statuses


def test_a_missing_method_is_found(tmp_path):
    sched = _changed(SCHED, "    def _blocked(self", "    def _renamed(self")
    status, detail = _statuses(_tree(tmp_path, sched))["Scheduler._blocked"]
    assert status == MISSING
    assert "Scheduler._blocked is gone" in detail


def test_a_missing_module_and_a_missing_class_are_found(tmp_path):
    renamed = _changed(SCHED, "class Scheduler(", "class NewScheduler(")
    statuses = _statuses(_tree(tmp_path / "a", renamed))
    assert statuses["Scheduler._reserve"] == (
        MISSING,
        "class Scheduler is gone from vllm.sched",
    )
    (tmp_path / "b" / "vllm").mkdir(parents=True)
    (tmp_path / "b" / "vllm" / "__init__.py").write_text("")
    statuses = _statuses(tmp_path / "b")
    assert statuses["Scheduler"] == (MISSING, "module vllm.sched is gone")


@pytest.mark.parametrize(
    ("old", "new", "internal", "now"),
    [
        (
            "def _reserve(self, request, num_new_tokens)",
            "def _reserve(self, request, num_new_tokens, lookahead)",
            "Scheduler._reserve",
            "(self, request, num_new_tokens, lookahead)",
        ),
        (
            "def _blocked(self, request)",
            "def _blocked(self, request, /)",
            "Scheduler._blocked",
            "(self, request, /)",
        ),
        (
            "parser, strict=False)",
            "parser, *, strict=True)",
            "Scheduler.add_cli_args",
            "@staticmethod (parser, *, strict=True)",
        ),
        (
            "    @staticmethod\n",
            "    @classmethod\n",
            "Scheduler.add_cli_args",
            "@classmethod (parser, strict=False)",
        ),
        (
            "class Scheduler(Base):",
            "class Scheduler:",
            "Scheduler",
            "(no bases)",
        ),
    ],
    ids=["parameter", "kind", "default", "decorator", "bases"],
)
def test_a_changed_signature_is_found(tmp_path, old, new, internal, now):
    status, detail = _statuses(_tree(tmp_path, _changed(SCHED, old, new)))[internal]
    assert status == SIGNATURE
    assert detail.endswith(f"now {now}"), detail


def test_an_attribute_turned_property_is_a_changed_signature(tmp_path):
    sched = _changed(
        SCHED,
        "    def _reserve(",
        "    @property\n    def max_num_active_reqs(self):\n        return 1\n\n"
        "    def _reserve(",
    )
    status, detail = _statuses(_tree(tmp_path, sched))["Scheduler.max_num_active_reqs"]
    assert status == SIGNATURE
    assert "was instance attribute; now property" in detail


def test_a_call_moved_out_of_the_waiting_loop_is_found(tmp_path):
    sched = _changed(
        SCHED,
        "            tokens = self._reserve(queue[0], 1)\n",
        "",
    )
    sched = _changed(
        sched, "        return tokens", "        return self._reserve(0, 1)"
    )
    status, detail = _statuses(_tree(tmp_path, sched))["Scheduler._reserve"]
    assert status == MOVED
    assert detail == (
        "call sites in Scheduler: schedule: 0 in 0.32, 1 here (line 34); "
        "schedule: waiting loop: 1 in 0.32, 0 here"
    )


def test_a_second_call_site_is_found(tmp_path):
    sched = _changed(
        SCHED,
        "        return tokens",
        "        self._blocked(None)\n        return tokens",
    )
    status, detail = _statuses(_tree(tmp_path, sched))["Scheduler._blocked"]
    assert status == MOVED
    assert "schedule: 0 in 0.32, 1 here" in detail


def test_a_read_that_no_longer_ends_the_loop_is_found(tmp_path):
    sched = _changed(
        SCHED,
        "            if len(self.running) >= self.max_num_active_reqs:\n"
        "                break\n",
        "            full = len(self.running) >= self.max_num_active_reqs\n",
    )
    status, detail = _statuses(_tree(tmp_path, sched))["Scheduler.max_num_active_reqs"]
    assert status == MOVED
    assert "schedule: waiting loop (assignment): 0 in 0.32, 1 here" in detail


def test_a_loop_that_is_no_longer_the_waiting_loop_moves_its_calls(tmp_path):
    """The waiting loop is the one reading the KV-holding queue."""
    sched = _changed(SCHED, "self.kv_holding_waiting or ", "")
    status, _ = _statuses(_tree(tmp_path, sched))["Scheduler._blocked"]
    assert status == MOVED


def test_a_hooked_method_only_inherited_is_missing(tmp_path):
    sched = _changed(SCHED, "    @staticmethod\n    def add_cli_args", "    def _x")
    base = BASE + "\n    @staticmethod\n    def add_cli_args(parser, strict=False):\n"
    base += "        return parser\n"
    statuses = _statuses(_tree(tmp_path, sched, base))
    status, detail = statuses["Scheduler.add_cli_args"]
    assert status == MISSING
    assert "only inherited from Base" in detail
    assert statuses["Scheduler.step"][0] == SAME  # a base's method is enough


def test_classes_are_found_through_re_exports(tmp_path):
    root = _tree(tmp_path)
    package = root / "vllm" / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .impl import Real as Exported\n")
    (package / "impl.py").write_text("class Real:\n    flag: bool = False\n")
    internal = Internal(
        "vllm.pkg", "Exported", "flag", "attribute", "class attribute", "test"
    )
    (result,) = check_all(VllmSource(root), [internal])
    assert result.status == SAME


def test_a_wheel_reads_like_its_source_folder(tmp_path):
    root = _tree(tmp_path / "src", _changed(SCHED, "def _blocked", "def _gone"))
    wheel = tmp_path / "vllm-9.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted(root.rglob("*.py")):
            archive.write(path, path.relative_to(root).as_posix())
    from_wheel = check_all(VllmSource(wheel), TABLE)
    assert from_wheel == check_all(VllmSource(root), TABLE)
    assert [r.internal for r in drifted(from_wheel)] == ["Scheduler._blocked"]
    assert VllmSource(wheel).version == "9.9.0"


def test_the_command_exits_1_on_drift_and_reports_json(tmp_path, capsys):
    root = _tree(tmp_path)  # none of the real internals are in it
    assert main([str(root), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["version"] == "9.9.0"
    assert report["drifted"] == len(INTERNALS)
    assert {r["status"] for r in report["results"]} == {MISSING}
    assert main([str(root)]) == 1
    out = capsys.readouterr().out
    assert f"{len(INTERNALS)} of {len(INTERNALS)} internals drifted" in out
    assert "Scheduler._reserve_prefill_lookahead" in out


def test_the_package_folder_itself_is_accepted(tmp_path):
    assert VllmSource(_tree(tmp_path) / "vllm").version == "9.9.0"


@pytest.mark.parametrize("kind", ["missing", "empty dir", "text file", "other zip"])
def test_what_is_not_vllm_is_refused_with_a_clear_error(tmp_path, capsys, kind):
    path = tmp_path / "thing.whl"
    if kind == "empty dir":
        path.mkdir()
    elif kind == "text file":
        path.write_text("not a wheel")
    elif kind == "other zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("other/__init__.py", "")
    with pytest.raises(SourceError, match=re.escape(str(path))):
        VllmSource(path)
    assert main([str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {path}: ")
    assert "no such file" in error if kind == "missing" else "not a vLLM" in error


# -- the list covers what our code names ----------------------------------------


def _labels() -> set[str]:
    return {internal.label for internal in INTERNALS}


def test_the_list_has_each_request_field_and_step_hook_upstream_py_names():
    labels = _labels()
    assert {f"Request.{field}" for field in REQUEST_FIELDS} <= labels
    assert {f"Scheduler.{name}" for name in STEP_HOOK_NAMES} <= labels


def test_the_list_has_every_internal_of_the_documented_hooks_table():
    text = (REPO / "docs" / "development.md").read_text()
    table = text[text.index("| hook | vLLM 0.32 internal") :].split("\n\n")[0]
    named: set[str] = set()
    for row in table.splitlines()[2:]:
        owner = ""
        for token in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if "/" in token:
                continue
            if "." in token:
                owner, _, name = token.partition(".")
            else:
                name = token
            named.add(f"{owner}.{name}")
    assert len(named) >= 15
    assert named <= _labels(), sorted(named - _labels())


def _attributes_of(path: Path, receivers: set[str]) -> set[str]:
    return {
        node.attr
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and (ast.unparse(node.value) in receivers)
    }


def test_the_list_has_what_upstream_py_reads_of_the_scheduler():
    read = _attributes_of(
        REPO / "engine_ext/scheduling/upstream.py", {"scheduler", "self._scheduler"}
    )
    assert read
    assert {f"Scheduler.{name}" for name in read} <= _labels()


def test_the_list_has_every_upstream_method_scheduler_py_calls_through_super():
    called = _attributes_of(REPO / "engine_ext/scheduler.py", {"super()"})
    assert "_reserve_prefill_lookahead" in called
    assert {f"Scheduler.{name}" for name in called} <= _labels()


def test_the_list_has_every_method_hooks_py_wraps_as_defined_on_its_class():
    tree = ast.parse((REPO / "engine_ext/hooks.py").read_text())
    wrapped = {
        f"{ast.unparse(call.args[0])}.{ast.literal_eval(call.args[1])}"
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "_wrap"
    }
    assert len(wrapped) == 7
    direct = {internal.label for internal in INTERNALS if internal.direct}
    assert wrapped <= direct, sorted(wrapped - direct)
