"""Fast ``yaml.safe_load`` for config files: libyaml's C parser, Python objects built straight
from its events.

PyYAML's own loaders run the composer, the resolver and the constructor in Python even with
the C parser (a 10,000-tenant config: ~1 s of 1.1 s). Configs use a small part of YAML, so the
builder here handles plain documents of mappings, sequences and scalars and hands anything else
(anchors, aliases, explicit tags, merge keys, complex keys, several documents) to the full
loader, which gives the same result or the same error.
"""

from __future__ import annotations

import time
from typing import Any

import yaml

# libyaml where PyYAML was built with it; the pure-Python parser otherwise.
LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR = "tag:yaml.org,2002:str"


class _Unusual(Exception):
    """A construct the fast builder leaves to the full loader."""


# Deeper than any config (tenants[].keys[].field is 4): the builder recurses in Python, so a
# hostile or broken file nested ~500 deep would raise RecursionError instead of a YAML error.
MAX_DEPTH = 64


def _mark(event: yaml.Event) -> yaml.Mark | None:
    """The event's place as the error's mark (libyaml's own Mark type is another class)."""
    at = event.start_mark
    return None if at is None else yaml.Mark(at.name, at.index, at.line, at.column, None, 0)


class _Builder:
    def __init__(self, text: str) -> None:
        self.loader: Any = LOADER(text)  # PyYAML's parser methods carry no types
        self.plain: dict[str, Any] = {}  # plain scalar text -> its value (immutable values)

    def document(self) -> Any:
        loader = self.loader
        loader.get_event()  # StreamStart
        if loader.check_event(yaml.StreamEndEvent):
            return None
        loader.get_event()  # DocumentStart
        value = self.node(loader.get_event(), 1)
        loader.get_event()  # DocumentEnd
        if not loader.check_event(yaml.StreamEndEvent):
            raise _Unusual("several documents")
        return value

    def node(self, event: yaml.Event, depth: int) -> Any:
        if getattr(event, "anchor", None) is not None or isinstance(event, yaml.AliasEvent):
            raise _Unusual("anchor or alias")
        if isinstance(event, yaml.ScalarEvent):
            return self.scalar(event)
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            if not event.implicit:
                raise _Unusual("explicit tag")
            if depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_DEPTH} levels deep", _mark(event)
                )
            if isinstance(event, yaml.MappingStartEvent):
                return self.mapping(depth)
            return self.seq(depth)
        raise _Unusual(type(event).__name__)

    def scalar(self, event: yaml.ScalarEvent) -> Any:
        if event.tag not in (None, "!"):
            raise _Unusual("explicit tag")
        if event.tag == "!" or not event.implicit[0]:
            return event.value  # quoted, block or '!' scalar: a string
        text = event.value
        try:
            return self.plain[text]
        except KeyError:
            pass
        tag = self.loader.resolve(yaml.ScalarNode, text, (True, False))
        if tag == _STR:
            value: Any = text
        elif tag in self.loader.yaml_constructors and tag.rsplit(":", 1)[1] in _SIMPLE:
            try:
                value = self.loader.yaml_constructors[tag](self.loader, yaml.ScalarNode(tag, text))
            except (ValueError, OverflowError) as exc:  # a date like 2026-02-30 or 0000-01-01
                raise yaml.constructor.ConstructorError(
                    None, None, f"{text!r}: {exc}", _mark(event)
                ) from exc
        else:
            raise _Unusual(f"scalar tag {tag}")  # merge keys, '=' values
        self.plain[text] = value
        return value

    def mapping(self, depth: int) -> dict[Any, Any]:
        loader = self.loader
        out: dict[Any, Any] = {}
        while not loader.check_event(yaml.MappingEndEvent):
            event = loader.get_event()
            key = self.node(event, depth + 1)
            if isinstance(key, list | dict):
                raise _Unusual("complex key")
            if key in out:
                raise _duplicate(key, _mark(event))
            out[key] = self.node(loader.get_event(), depth + 1)
        loader.get_event()
        return out

    def seq(self, depth: int) -> list[Any]:
        loader = self.loader
        out: list[Any] = []
        while not loader.check_event(yaml.SequenceEndEvent):
            out.append(self.node(loader.get_event(), depth + 1))
            if len(out) % YIELD_EVERY == 0:
                yield_gil()
        loader.get_event()
        return out


# A long list (10,000 tenants) is parsed in a worker thread during a live reload: hand the
# GIL to the event loop now and then, or every I/O call there waits out the interpreter's
# switch interval behind the parser (the GIL convoy), and requests stall for the whole parse.
YIELD_EVERY = 64


def yield_gil() -> None:
    time.sleep(0)


def _duplicate(key: Any, mark: yaml.Mark | None) -> yaml.YAMLError:
    # YAML says a mapping's keys are unique; PyYAML keeps the last silently. In a config that
    # turns a second `acme-sql:` into a silent replacement of the first (a private adapter
    # shared, its price gone): refused instead, with its line.
    return yaml.constructor.ConstructorError(
        None, None, f"duplicate key {key!r} (a key may appear once in a mapping)", mark
    )


class _UniqueKeys(LOADER):  # type: ignore[misc,valid-type]
    """The full loader (anchors, merge keys) refusing duplicate keys too; a merged key that
    the mapping sets again is an override, as YAML means it, not a duplicate."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _duplicate(key, key_node.start_mark)
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor's own error follows
                break
        return super().construct_mapping(node, deep)  # type: ignore[no-any-return]


# Resolved plain-scalar tags whose values are immutable, safe to share through the cache.
_SIMPLE = frozenset({"null", "bool", "int", "float", "timestamp"})


def safe_load(text: str) -> Any:
    """What ``yaml.safe_load(text)`` returns, several times faster; every failure is a
    ``yaml.YAMLError`` (with its line where the parser gives one): a scalar the constructor
    refuses (``2026-02-30``), or nesting deeper than ``MAX_DEPTH``."""
    builder = _Builder(text)
    try:
        return builder.document()
    except _Unusual:
        pass
    finally:
        builder.loader.dispose()
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # a safe loader
    except (ValueError, OverflowError) as exc:  # a scalar's constructor (dates): no mark here
        raise yaml.constructor.ConstructorError(None, None, str(exc)) from exc


class Lines:
    """Line numbers for error messages: the YAML is composed again, with marks, only when
    something must be reported (the happy path parses once)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._root: yaml.Node | None = None
        self._composed = False

    def of(self, loc: tuple[int | str, ...]) -> int | None:
        """The 1-based line of the deepest YAML node that ``loc`` reaches."""
        if not self._composed:
            self._root = yaml.compose(self._text, Loader=LOADER)
            self._composed = True
        node = self._root
        line = node.start_mark.line + 1 if node is not None else None
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                match = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
                if match is None:
                    break
                node = match
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
                if part >= len(node.value):
                    break
                node = node.value[part]
            else:
                break
            line = node.start_mark.line + 1
        return line
