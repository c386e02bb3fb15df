"""docs/configuration.md is generated from the schema, complete, and never stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field

from proxy.config import reference as config_reference
from proxy.config.base import TUNING, Strict
from proxy.config.reference import (
    DOC_PATH,
    NO_DESCRIPTION,
    render,
    sections,
    split_fields,
    tuning_sections,
    type_name,
)
from proxy.config.scheduling import Policies
from proxy.config.schema import Config
from tests.helpers.paths import REPO

MINIMAL: dict[str, Any] = {
    "tiers": {
        "t": {
            "priority": 0,
            "weight": 1,
            "max_queue": 1,
            "queue_timeout_s": 1,
            "request_timeout_s": 1,
        }
    },
    "backends": [{"url": "http://127.0.0.1:8100"}],
}


def test_docs_configuration_md_is_up_to_date() -> None:
    current = (REPO / DOC_PATH).read_text(encoding="utf-8")
    assert current == render(), (
        f"{DOC_PATH} is stale: run `tierproxy config-reference -o {DOC_PATH}` and commit it"
    )


def test_every_field_of_every_section_has_a_meaning() -> None:
    models: list[type[BaseModel]] = [Config, *(model for _, model in sections())]
    missing = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not field.description
    ]
    assert missing == [], f"add Field(description=...) to: {', '.join(missing)}"
    assert NO_DESCRIPTION not in render()


def test_every_section_and_field_is_in_the_reference() -> None:
    text = render()
    for path, model in sections():
        assert f"## `{path}` ({model.__name__})" in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text
    for path in ("tiers.<name>", "tenants[]", "tenants[].keys[]", "backends[]", "policies"):
        assert any(p == path for p, _ in sections()), path


def _tables(text: str) -> dict[str, set[str]]:
    """Each `## ` heading of ``text`` -> the field names its table lists."""
    out = {}
    for chunk in text.split("\n## ")[1:]:
        heading, _, body = chunk.partition("\n")
        rows = [line for line in body.splitlines() if line.startswith("| `")]
        out[heading] = {line.split("`")[1] for line in rows}
    return out


def test_every_field_is_either_the_operators_or_tuning_and_listed_in_its_part() -> None:
    operator_part, _, appendix = render().partition('<a id="tuning"></a>\n# Tuning')
    assert appendix, "the Tuning appendix is missing"
    operator_tables, tuning_tables = _tables(operator_part), _tables(appendix)
    tuning = tuning_sections()
    every: list[tuple[str, type[BaseModel]]] = [("", Config), *sections()]
    for path, model in every:
        operator, tuned = split_fields(model, tuning)
        assert sorted(operator + tuned) == sorted(model.model_fields), model.__name__
        assert not set(operator) & set(tuned), model.__name__
        title = f"`{path}` ({model.__name__})" if path else "Top level"
        # The operator's part lists exactly its fields: no tuning field among them.
        assert operator_tables.get(title, set()) == set(operator), title
        if tuned:
            split = f"{title} (tuning)" if operator else title
            assert tuning_tables[split] == set(tuned), title
        assert not (model in tuning and title in operator_tables), title


def test_whole_sections_behind_a_tuning_field_are_tuning() -> None:
    names = {m.__name__ for m in tuning_sections()}
    assert {"AdaptiveRoom", "KvAwareKnobs", "PrefixAffinityKnobs", "VtcKnobs"} <= names
    assert "Tier" not in names and "Policies" not in names


def test_a_tuning_field_goes_to_the_appendix_and_its_section_with_it() -> None:
    class Inner(Strict):
        knob: int = Field(1, description="deep")

    class Section(Strict):
        size: int = Field(1, description="set me")
        internal: int = Field(2, description="tune me", json_schema_extra=TUNING)
        inner: Inner = Field(Inner(), description="all tuning", json_schema_extra=TUNING)

    class Root(Strict):
        section: Section = Field(Section(), description="new")

    tuning = tuning_sections(Root)
    assert tuning == {Inner}
    assert split_fields(Section, tuning) == (["size"], ["internal", "inner"])
    assert split_fields(Inner, tuning) == ([], ["knob"])


def test_policy_names_in_the_schema_are_the_registrys() -> None:
    """The config names each seam's implementations as a Literal (it imports no policy); the
    registry builds them: the two must list the same names, and the reference shows them."""
    from proxy.policies.registry import CHOICES

    text = render()
    for seam, choices in CHOICES.items():
        assert set(get_args(Policies.model_fields[seam].annotation)) == set(choices), seam
        line = next(row for row in text.splitlines() if row.startswith(f"| `{seam}` | one of"))
        for choice in choices:
            assert f"`{choice}`" in line, (seam, choice)


def test_a_new_section_appears_without_extra_work() -> None:
    class Inner(Strict):
        mode: Literal["a", "b"] = Field("a", description="which")

    class Section(Strict):
        """A section another change adds."""

        items: list[Inner] = Field(default_factory=list, description="the items")
        by_name: dict[str, Inner] = Field(default_factory=dict, description="by name")
        size: int | None = Field(None, gt=0, le=9, description="how big")

    class Root(Strict):
        section: Section = Field(Section(), description="new")

    assert [(p, m.__name__) for p, m in sections(Root)] == [
        ("section", "Section"),
        ("section.items[]", "Inner"),
    ]
    assert type_name(Section.model_fields["by_name"].annotation) == (
        "mapping of string to [Inner](#inner)"
    )
    assert type_name(Inner.model_fields["mode"].annotation) == "one of `a`, `b`"
    row = config_reference.field_row(Section, "size", Section.model_fields["size"])
    assert row == "| `size` | integer or null, > 0, ≤ 9 | `null` | how big |"


def test_every_example_in_the_reference_is_valid() -> None:
    example_file = config_reference._example_data(REPO / config_reference.EXAMPLE_PATH)
    for name, field in Config.model_fields.items():
        value = config_reference.example_of(name, field, example_file)
        if value is not None:
            Config.model_validate({**MINIMAL, "tiers": example_file["tiers"], name: value})


def test_cli_writes_and_checks_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    exe = [sys.executable, "-m", "proxy.cli", "config-reference"]
    stale = subprocess.run([*exe, "-o", str(out), "--check"], capture_output=True, text=True)
    assert stale.returncode == 1 and "stale" in stale.stdout
    subprocess.run([*exe, "-o", str(out)], check=True)
    assert out.read_text(encoding="utf-8") == render()
    fresh = subprocess.run([*exe, "-o", str(out), "--check"], capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stdout


def test_check_points_to_the_reference() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", "-c", str(REPO / "configs/example.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0 and "docs/configuration.md" in ok.stdout
