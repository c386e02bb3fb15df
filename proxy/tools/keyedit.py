"""Edits to a tenant's `keys:` list made on the YAML text itself, so that every comment, blank
line, quote and indentation outside the edited lines stays byte for byte.

The edit points come from the YAML parser's marks (character offsets, with libyaml as with the
pure-Python parser). Only the layouts a person writes for a list of small mappings are edited (block
or flow, items as block or flow mappings of scalars); anything else is refused as `KeyEditError`
rather than guessed at. The caller (proxy.tools.keyfile) parses the result with the real loader and
checks it means exactly the intended change, so a wrong edit can never be written.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from proxy.config.yaml_load import LOADER


class KeyEditError(Exception):
    """The edit cannot be made on this file (no such tenant, a layout left to a person)."""


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str


def _scalar_pairs(node: yaml.MappingNode) -> list[tuple[yaml.ScalarNode, yaml.ScalarNode]]:
    pairs = []
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or not isinstance(value, yaml.ScalarNode):
            raise KeyEditError("a key entry holds something other than plain fields")
        pairs.append((key, value))
    return pairs


def _line_end(text: str, index: int) -> int:
    """The index just past the newline that ends the line holding ``index``."""
    newline = text.find("\n", index)
    return len(text) if newline < 0 else newline + 1


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


class KeysList:
    """The `keys:` sequence of one tenant in a config text."""

    def __init__(self, text: str, tenant: str) -> None:
        self.text = text
        root = yaml.compose(text, Loader=LOADER)  # libyaml's marks count characters too
        tenants = _child(root, "tenants")
        if not isinstance(tenants, yaml.SequenceNode):
            raise KeyEditError("the config has no tenants list")
        for item in tenants.value:
            name = _child(item, "name")
            if isinstance(name, yaml.ScalarNode) and name.value == tenant:
                keys = _child(item, "keys")
                if not isinstance(keys, yaml.SequenceNode) or not keys.value:
                    raise KeyEditError(f"tenant {tenant!r} has no keys list")
                self.node = keys
                self.items: list[yaml.MappingNode] = []
                for entry in keys.value:
                    if not isinstance(entry, yaml.MappingNode):
                        raise KeyEditError(f"a key of tenant {tenant!r} is not a mapping")
                    self.items.append(entry)
                return
        raise KeyEditError(f"no tenant {tenant!r} in the config")

    def _apply(self, edit: _Edit) -> str:
        return self.text[: edit.start] + edit.text + self.text[edit.end :]

    def _block_prefix(self, item: yaml.MappingNode) -> str:
        """The text before a block item's first field on its line (``"      - "``)."""
        start = item.start_mark.index
        prefix = self.text[_line_start(self.text, start) : start]
        if prefix.strip() != "-":
            raise KeyEditError("a key entry's layout is left to a person (edit the file by hand)")
        return prefix

    def append(self, fields: list[tuple[str, str]]) -> str:
        """The text with a new entry (``fields``: name and YAML text of each) after the last."""
        last = self.items[-1]
        if self.node.flow_style:  # keys: [{...}, {...}]
            close = self.node.end_mark.index - 1
            return self._apply(_Edit(close, close, ", " + _flow(fields)))
        prefix = self._block_prefix(last)
        at = _line_end(self.text, _scalar_pairs(last)[-1][1].end_mark.index)
        if last.flow_style:  # - {sha256: ...}
            entry = prefix + _flow(fields) + "\n"
        else:
            pad = " " * len(prefix)
            entry = "".join(
                (prefix if i == 0 else pad) + f"{name}: {value}\n"
                for i, (name, value) in enumerate(fields)
            )
        head = self.text[:at] if self.text[:at].endswith("\n") else self.text[:at] + "\n"
        return head + entry + self.text[at:]

    def set_field(self, index: int, name: str, value: str) -> str:
        """The text with entry ``index``'s field ``name`` set to ``value`` (YAML text)."""
        item = self.items[index]
        pairs = _scalar_pairs(item)
        for key, current in pairs:
            if key.value == name:
                if (
                    current.style not in (None, "'", '"')
                    or "\n" in self.text[current.start_mark.index : current.end_mark.index]
                ):
                    raise KeyEditError(f"the key's {name} is left to a person (edit by hand)")
                return self._apply(_Edit(current.start_mark.index, current.end_mark.index, value))
        if item.flow_style:
            close = item.end_mark.index - 1
            return self._apply(_Edit(close, close, f", {name}: {value}"))
        column = item.start_mark.column
        at = _line_end(self.text, pairs[-1][1].end_mark.index)
        head = self.text[:at] if self.text[:at].endswith("\n") else self.text[:at] + "\n"
        return head + " " * column + f"{name}: {value}\n" + self.text[at:]

    def remove(self, index: int) -> str:
        """The text without entry ``index`` (the lines it spans, or its part of a flow list)."""
        item = self.items[index]
        if self.node.flow_style:
            if index > 0:
                start, end = self.items[index - 1].end_mark.index, item.end_mark.index
            elif len(self.items) > 1:
                start, end = item.start_mark.index, self.items[1].start_mark.index
            else:
                start, end = item.start_mark.index, item.end_mark.index
            return self._apply(_Edit(start, end, ""))
        self._block_prefix(item)
        start = _line_start(self.text, item.start_mark.index)
        end = _line_end(self.text, _scalar_pairs(item)[-1][1].end_mark.index)
        return self._apply(_Edit(start, end, ""))


def _child(node: yaml.Node | None, name: str) -> yaml.Node | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((v for k, v in node.value if getattr(k, "value", None) == name), None)


def _flow(fields: list[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{name}: {value}" for name, value in fields) + "}"
