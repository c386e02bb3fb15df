"""Every way a config file can fail to load is a ConfigError naming the field and line (attack
round 2, k01 and finding 10): a time out of datetime's range once in UTC, YAML nested hundreds
deep, a date the YAML constructor refuses, bytes that are not UTF-8. Anything else escaped the
reload watcher (it caught only ConfigError) and `tierproxy check` printed a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.bench.inproc import make_config
from proxy.cli import main
from proxy.config.loader import ConfigError, load_config, parse_config
from proxy.config.tenants import hash_key
from proxy.config.yaml_load import MAX_DEPTH, safe_load

DIGEST = hash_key("some-key")


def _text(**key: object) -> str:
    tenants = [{"name": "t", "tier": "high", "keys": [{"sha256": DIGEST}]}]
    text = yaml.safe_dump(make_config([{"url": "http://127.0.0.1:9"}], tenants=tenants))
    fields = "".join(f"\n    {name}: {value}" for name, value in key.items())
    return text.replace(f"- sha256: {DIGEST}", f"- sha256: {DIGEST}{fields}")


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    return exc.value.problems


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


@pytest.mark.parametrize(
    ("field", "written"),
    [
        ("expires_at", "9999-12-31T23:59:59-12:00"),  # a 'never' in a local zone
        ("expires_at", "0001-01-01T00:00:00+01:00"),
        ("created_at", "'9999-12-31T23:00:00-05:00'"),  # quoted: read by datetime, not YAML
    ],
)
def test_a_time_out_of_range_in_utc_is_a_problem_on_its_line(field: str, written: str) -> None:
    text = _text(**{field: written})
    problems = _problems(text)
    line = _line_of(text, f"{field}:")
    assert problems == [
        f"tenants.0.keys.0.{field} (line {line}): Value error, {written.strip(chr(39))} is out"
        " of range once converted to UTC (years 1 to 9999)"
    ]


def test_yaml_nested_hundreds_deep_is_a_problem_with_its_line() -> None:
    deep = "zz:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(600)) + " " * 602 + "b: 1\n"
    text = _text() + deep
    problems = _problems(text)
    assert len(problems) == 1
    assert f"nested more than {MAX_DEPTH} levels deep" in problems[0]
    first = _line_of(text, "zz:")
    assert f"line {first + MAX_DEPTH}," in problems[0], problems[0]
    nested: list[object] = []
    for _ in range(MAX_DEPTH - 2):  # with the top mapping: MAX_DEPTH levels, as deep as allowed
        nested = [nested]
    n = MAX_DEPTH - 1
    assert safe_load("a: " + "[" * n + "]" * n) == {"a": nested}


@pytest.mark.parametrize("anchored", [False, True])  # the fast builder, and the full loader
def test_a_date_yaml_cannot_make_is_a_problem(anchored: bool) -> None:
    text = _text() + ("x_note: &n 2026-02-30\n" if anchored else "x_note: 2026-02-30\n")
    problems = _problems(text)
    assert len(problems) == 1 and "day is out of range for month" in problems[0]
    assert problems[0].startswith("not valid YAML")


def test_a_file_that_is_not_utf8_is_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(_text().encode() + b"# caf\xe9\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.problems[0].startswith("not UTF-8")


def test_check_prints_the_problem_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(_text(expires_at="9999-12-31T23:59:59-12:00"))
    assert main(["check", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and "tenants.0.keys.0.expires_at" in err
    path.write_bytes(b"\xff\xfe")
    assert main(["check", "-c", str(path)]) == 1
    assert "not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("anchored", [False, True])  # the fast builder, and the full loader
def test_a_key_written_twice_is_a_problem_on_its_line(anchored: bool) -> None:
    # PyYAML keeps the last silently: a second `acme-sql:` under `adapters:` made a private
    # adapter shared and dropped its price, a second `adapters:` replaced the whole catalogue
    # (red team 2026-12-02, finding 3).
    entry = "{path: /a, base_model: tiny}"
    extra = "x_note: &n 1\n" if anchored else ""
    text = _text() + extra + f"adapters:\n  acme-sql: {entry}\n  acme-sql: {entry}\n"
    problems = _problems(text)
    assert len(problems) == 1 and "duplicate key 'acme-sql'" in problems[0], problems
    assert f"line {_line_of(text, 'acme-sql') + 1}" in problems[0]
    merged = "base: &b {a: 1, b: 2}\nover: {<<: *b, b: 3}\n"  # a merge key overridden: fine
    assert safe_load(merged)["over"] == {"a": 1, "b": 3}


@pytest.mark.parametrize("written", ["yes", "true", "no"])
def test_a_yes_or_no_for_a_number_is_a_problem_on_its_line(written: str) -> None:
    """Red team R4: `max_loras: yes` was taken as one adapter slot, `max_inflight: yes` as a
    room of 1 (pydantic reads a YAML boolean as 1 or 0 for a number)."""
    text = yaml.safe_dump(make_config([{"url": "http://127.0.0.1:9"}])).replace(
        "- url: http://127.0.0.1:9", f"- url: http://127.0.0.1:9\n  max_inflight: {written}"
    )
    problems = _problems(text)
    line = _line_of(text, "max_inflight:")
    assert len(problems) == 1 and problems[0].startswith(f"backends.0.max_inflight (line {line})")
    assert "not yes/no or true/false" in problems[0]


def test_a_cross_check_names_the_line_of_what_it_refuses() -> None:
    """Red team R2: an adapter naming a tenant the file does not define was refused at
    "(top level) (line 1)", and so were an unknown tier and a backend url written twice."""
    tenants = [{"name": "acme", "tier": "high", "keys": [{"sha256": DIGEST}]}]
    adapters = {"acme-sql": {"path": "/a", "base_model": "tiny", "tenants": ["acme", "acmee"]}}
    backends = [{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:9"}]
    text = yaml.safe_dump(make_config(backends[:1], tenants=tenants, adapters=adapters))
    [problem] = _problems(text)
    assert problem.startswith(f"adapters.acme-sql.tenants.1 (line {_line_of(text, 'acmee')})")
    text = yaml.safe_dump(make_config(backends, tenants=tenants))
    [problem] = _problems(text)
    second = [i for i, t in enumerate(text.splitlines(), 1) if "127.0.0.1:9" in t][1]
    assert problem == f"backends.1.url (line {second}): Value error, a backend url appears twice"
