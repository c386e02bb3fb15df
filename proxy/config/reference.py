"""docs/configuration.md, generated from the config schema (`tierproxy config-reference`).

Walks ``Config`` and every section model it reaches, whatever sections exist: a new section
appears here by being a field of ``Config`` with ``Field(description=...)`` on its fields. The
operator's keys come first; the fields tagged ``json_schema_extra=TUNING`` (and every field of a
section reached only through one) go to the "Tuning" appendix.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from proxy.config.base import is_tuning
from proxy.config.schema import Config

REPO = Path(__file__).resolve().parents[2]
DOC_PATH = "docs/configuration.md"
EXAMPLE_PATH = "configs/example.yaml"
NO_DESCRIPTION = "(undocumented)"

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: `integer`, `list of [Tenant](#tenant)`, ..."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def constraints(field: FieldInfo) -> list[str]:
    """The field's bounds as `> 0`, `≤ 128`, `at least 1 item`."""
    out: list[str] = []
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Gt):
            out.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Ge):
            out.append(f"≥ {meta.ge}")
        elif isinstance(meta, annotated_types.Lt):
            out.append(f"< {meta.lt}")
        elif isinstance(meta, annotated_types.Le):
            out.append(f"≤ {meta.le}")
        elif isinstance(meta, annotated_types.MinLen):
            out.append(f"at least {meta.min_length}")
        elif isinstance(meta, annotated_types.MaxLen):
            out.append(f"at most {meta.max_length}")
    return out


def default_of(field: FieldInfo) -> tuple[bool, Any]:
    """(has a default, the default)."""
    if field.default_factory is not None:
        return True, field.default_factory()  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        return False, None
    return True, field.default


def _literal(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    text = f"`{value if isinstance(value, str) else json.dumps(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024 * 1024:
        mib = value / (1024 * 1024)
        text += f" ({mib:g} MiB)" if mib < 1024 else f" ({mib / 1024:g} GiB)"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def field_row(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    kind = type_name(field.annotation)
    bounds = constraints(field)
    if bounds:
        kind += ", " + ", ".join(bounds)
    has_default, default = default_of(field)
    shown = _literal(default) if has_default else "**required**"
    meaning = field.description or NO_DESCRIPTION
    return f"| `{name}` | {_cell(kind)} | {_cell(shown)} | {_cell(meaning)} |"


def sections(root: type[BaseModel] = Config) -> list[tuple[str, type[BaseModel]]]:
    """(path in the file, model) for every model reachable from ``root``, each once, in field
    order, depth first: ``tiers.<name>``, ``tenants[]``, ``tenants[].keys[]``..."""
    seen: set[type[BaseModel]] = {root}
    found: list[tuple[str, type[BaseModel]]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            origin = get_origin(field.annotation)
            path = prefix + name
            if origin is dict:
                path += ".<name>"
            elif origin is list:
                path += "[]"
            for sub in _models_in(field.annotation):
                if sub not in seen:
                    seen.add(sub)
                    found.append((path, sub))
                    walk(sub, path + ".")

    walk(root, "")
    return found


def tuning_sections(root: type[BaseModel] = Config) -> set[type[BaseModel]]:
    """The sections reached only through a tuning field: every field of theirs is tuning."""
    operator: set[type[BaseModel]] = {root}
    todo = [root]
    while todo:
        for field in todo.pop().model_fields.values():
            if is_tuning(field):
                continue
            for sub in _models_in(field.annotation):
                if sub not in operator:
                    operator.add(sub)
                    todo.append(sub)
    return {model for _, model in sections(root)} - operator


def split_fields(
    model: type[BaseModel], tuning: set[type[BaseModel]]
) -> tuple[list[str], list[str]]:
    """(the operator's field names, the tuning ones) of ``model``."""
    if model in tuning:
        return [], list(model.model_fields)
    fields = model.model_fields
    return (
        [n for n, f in fields.items() if not is_tuning(f)],
        [n for n, f in fields.items() if is_tuning(f)],
    )


def _example_data(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError:
        return {}
    return data if isinstance(data, dict) else {}


def example_of(name: str, field: FieldInfo, example_file: dict[str, Any]) -> Any:
    """A top-level field's example: the field's own `examples`, else configs/example.yaml's
    value, else its default (None: nothing worth showing)."""
    if field.examples:
        return field.examples[0]
    if name in example_file:
        return example_file[name]
    has_default, default = default_of(field)
    if isinstance(default, BaseModel):
        return default.model_dump(mode="json")
    return default if has_default and default not in (None, [], {}) else None


def _yaml(value: dict[str, Any]) -> str:
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False, width=96).rstrip()


def _operator_part(value: Any, model: type[BaseModel] | None) -> Any:
    """An example without its section's tuning keys (the operator's page shows none)."""
    if model is None or not isinstance(value, dict):
        return value
    fields = model.model_fields
    return {k: v for k, v in value.items() if k not in fields or not is_tuning(fields[k])}


def _example_block(
    names: list[str], examples: dict[str, Any], model: type[BaseModel] | None = None
) -> list[str]:
    shown = {n: example_of(n, Config.model_fields[n], examples) for n in names}
    shown = {n: _operator_part(v, model) for n, v in shown.items() if v is not None}
    return ["", "```yaml", _yaml(shown), "```"] if shown else []


def _table(model: type[BaseModel], names: list[str]) -> list[str]:
    rows = ["| Field | Type | Default | Meaning |", "|---|---|---|---|"]
    rows += [field_row(model, n, model.model_fields[n]) for n in names]
    return rows


def _heading(anchor: str, title: str, model: type[BaseModel]) -> list[str]:
    out = ["", f'<a id="{anchor}"></a>', title, ""]
    return out + ([" ".join(model.__doc__.split()), ""] if model.__doc__ else [])


def _tuning_appendix(tuning: set[type[BaseModel]]) -> list[str]:
    out = [
        "",
        '<a id="tuning"></a>',
        "# Tuning",
        "",
        "A controller's or an implementation's internals: the defaults are measured"
        " (docs/performance.md, docs/benchmarks.md) and an operator should not need these;"
        " change one to fix a measured problem. They load, reload and validate as the keys"
        " above do.",
    ]
    _, top = split_fields(Config, tuning)
    if top:
        out += ["", f'<a id="{_anchor(Config)}-tuning"></a>', "## Top level (tuning)", ""]
        out += _table(Config, top)
    for path, model in sections():
        operator, names = split_fields(model, tuning)
        if not names:
            continue
        anchor = _anchor(model) + ("-tuning" if operator else "")
        title = f"## `{path}` ({model.__name__})" + (" (tuning)" if operator else "")
        out += (
            ["", f'<a id="{anchor}"></a>', title, ""]
            if operator
            else _heading(anchor, title, model)
        )
        out += _table(model, names)
    return out


def render(example_file: dict[str, Any] | None = None) -> str:
    """The whole reference as Markdown."""
    examples = _example_data(REPO / EXAMPLE_PATH) if example_file is None else example_file
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `tierproxy config-reference` from proxy/config/schema*.py: do not edit;"
        " regenerate with `tierproxy config-reference -o docs/configuration.md`. -->",
        "",
        "The proxy reads one YAML file (`tierproxy serve -c FILE`; `tierproxy check -c FILE`"
        " validates it). Every section and field an operator sets, with its type, bounds,"
        " default and meaning; unknown fields are errors. Examples come from"
        " `configs/example.yaml` where it sets the section, else from the defaults. The"
        " internals an expert tunes follow in the [Tuning](#tuning) appendix.",
        "",
        f'<a id="{_anchor(Config)}"></a>',
        "## Top level",
        "",
        " ".join((Config.__doc__ or "").split()),
        "",
    ]
    tuning = tuning_sections()
    top_operator, _ = split_fields(Config, tuning)
    out += _table(Config, top_operator)
    section_tops = {path.split(".")[0].split("[")[0] for path, _ in sections()}
    plain = [n for n in top_operator if n not in section_tops]
    out += _example_block(plain, examples)
    for path, model in sections():
        operator, _ = split_fields(model, tuning)
        if not operator:
            continue
        out += _heading(_anchor(model), f"## `{path}` ({model.__name__})", model)
        out += _table(model, operator)
        top = path.split(".")[0].split("[")[0]
        if path in (top, f"{top}[]", f"{top}.<name>"):
            out += _example_block([top], examples, model)
    out += ["", "## A complete file", "", f"`{EXAMPLE_PATH}`:", "", "```yaml"]
    out += [(REPO / EXAMPLE_PATH).read_text(encoding="utf-8").rstrip(), "```"]
    out += _tuning_appendix(tuning)
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tierproxy config-reference", description=__doc__)
    parser.add_argument("-o", "--output", help=f"write there (e.g. {DOC_PATH}); default stdout")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the output file is not up to date"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        target = Path(args.output or REPO / DOC_PATH)
        current = target.read_text(encoding="utf-8") if target.exists() else ""
        if current != text:
            print(f"{target} is stale: run `tierproxy config-reference -o {target}`")
            return 1
        print(f"{target} is up to date")
        return 0
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
