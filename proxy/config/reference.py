"""docs/configuration.md, generated from the config schema (`tierproxy config-reference`).

Walks ``Config`` and every section model it reaches, whatever sections exist: a new section
appears here by being a field of ``Config`` with ``Field(description=...)`` on its fields.
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


def _example_block(names: list[str], examples: dict[str, Any]) -> list[str]:
    shown = {n: example_of(n, Config.model_fields[n], examples) for n in names}
    shown = {n: v for n, v in shown.items() if v is not None}
    return ["", "```yaml", _yaml(shown), "```"] if shown else []


def _table(model: type[BaseModel]) -> list[str]:
    rows = ["| Field | Type | Default | Meaning |", "|---|---|---|---|"]
    rows += [field_row(model, n, f) for n, f in model.model_fields.items()]
    return rows


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
        " validates it). Every section and field below, with its type, bounds, default and"
        " meaning; unknown fields are errors. Examples come from `configs/example.yaml` where"
        " it sets the section, else from the defaults.",
        "",
        f'<a id="{_anchor(Config)}"></a>',
        "## Top level",
        "",
        " ".join((Config.__doc__ or "").split()),
        "",
        *_table(Config),
    ]
    section_tops = {path.split(".")[0].split("[")[0] for path, _ in sections()}
    out += _example_block([n for n in Config.model_fields if n not in section_tops], examples)
    for path, model in sections():
        out += ["", f'<a id="{_anchor(model)}"></a>', f"## `{path}` ({model.__name__})", ""]
        if model.__doc__:
            out += [" ".join(model.__doc__.split()), ""]
        out += _table(model)
        top = path.split(".")[0].split("[")[0]
        if path in (top, f"{top}[]", f"{top}.<name>"):
            out += _example_block([top], examples)
    out += ["", "## A complete file", "", f"`{EXAMPLE_PATH}`:", "", "```yaml"]
    out += [(REPO / EXAMPLE_PATH).read_text(encoding="utf-8").rstrip(), "```"]
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
