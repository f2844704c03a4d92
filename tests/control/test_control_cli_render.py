"""``output-rate-ctl``'s output (``control.cli.render``) against a real in-process
server: aligned tables, errors on one line."""

from __future__ import annotations


def test_human_readable_tables(ctl):
    status, out, _ = ctl("list")
    assert status == 0
    assert out.splitlines() == [
        "USER   TOKENS/S  TIER  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  TEAM",
        "alice         5     -      no       -         -       -     -     -",
        "bob          20     -      no       -         -       -     -     -",
    ]


def test_a_multi_line_parser_error_is_printed_on_one_line(ctl, tmp_path):
    path = tmp_path / "table.yaml"
    path.write_text("users: [\n")
    status, _, err = ctl("import", str(path))
    assert status == 1
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert "not valid YAML: while parsing" in err
    assert len(err.splitlines()) == 1
