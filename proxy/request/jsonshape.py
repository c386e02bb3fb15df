"""The shape of a parsed JSON body, measured in one bounded pass: how deep it nests, how many
values it holds, and what it holds in memory.

A small body can hold a great many values (``[{},{},...]``: one per 3 bytes, 2.8 million in
8 MiB), and every later step walks them in Python on the event loop; so the walk counts values
as it goes and stops at ``input.max_json_elements``, whatever the rest of the body is. Only
containers are visited, with exact ``type() is`` checks (orjson makes nothing else), a level at
a time (no tuple per container).

What a parsed body holds, measured with tracemalloc on CPython 3.11 (bytes per body byte;
``tests/unit/request/test_jsonshape.py`` checks the bound on each): ASCII text 1.0x, chat text 1.4x,
floats 1.7x, token ids 5.7x, short chat messages 9.5x, short strings 14.5x, ``[[1],...]``
18x, ``[[],...]`` 21x, ``[{},...]`` and ``[{"a":1},...]`` 24x; ASCII text beside one emoji
4.0x. Per value that is at most a pointer and an object (8 + 56; a str of one non-ASCII
character 74 + 8, from 5 bytes of JSON at 4x), per object member a key and a hash-table slot
(40 more), per object 64-232 bytes, per array 56. ``JsonShape.held_bytes`` adds those up: an
upper bound for every shape above, 1.0-2.7x what is held (6x for CJK text: see
``TEXT_FACTOR_NON_ASCII``), where the old flat 6x per byte was 4x short for ``[{},...]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PER_ELEMENT = 64  # a pointer in its container + the value's own object (int 32, float 24, str 49+)
PER_MEMBER = 40  # an object member's key and hash-table slot, on top of its value
PER_OBJECT = 128
PER_ARRAY = 64
# A str is as wide as its widest character: one astral character (4 UTF-8 bytes, or a
# \ud8xx escape) makes 4 bytes of every ASCII character beside it. Finding out whether a body
# holds one costs more than parsing it (2 ns a byte), so any body that is not plain ASCII is
# counted at 4 (CJK text, 3 UTF-8 bytes to a 2-byte character, is then over-counted 6x).
TEXT_FACTOR_NON_ASCII = 4


class TooDeep(ValueError):
    """The value nests arrays and objects deeper than allowed."""


class TooManyElements(ValueError):
    """The value holds more values (``what``: "values" or "objects and arrays") than allowed."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"more than {limit} {what}")
        self.what = what
        self.limit = limit


@dataclass(frozen=True, slots=True)
class JsonShape:
    elements: int  # values inside arrays and objects (every level)
    members: int  # of which object members
    objects: int
    arrays: int

    def held_bytes(self, body: bytes) -> int:
        """An upper bound of the memory the parsed ``body`` (of this shape) holds."""
        text = len(body) * text_factor(body)
        return (
            text
            + self.elements * PER_ELEMENT
            + self.members * PER_MEMBER
            + self.objects * PER_OBJECT
            + self.arrays * PER_ARRAY
        )


def text_factor(body: bytes) -> int:
    """The most bytes a string of ``body`` holds per byte of its JSON text: 1 for ASCII without
    ``\\u`` escapes, else 4. A one-byte search first (memchr; a two-byte one is a byte-by-byte
    loop, 0.7 ms a MiB)."""
    if body.isascii() and (b"\\" not in body or b"\\u" not in body):
        return 1
    return TEXT_FACTOR_NON_ASCII


def measure(value: Any, *, max_depth: int, max_elements: int, max_containers: int) -> JsonShape:
    """The shape of ``value`` (what ``orjson.loads`` made; itself depth 1); ``TooDeep`` at the
    first level past ``max_depth`` that holds a container; ``TooManyElements`` as soon as the
    containers seen so far hold more than ``max_elements`` values, or a level would bring the
    objects and arrays past ``max_containers`` (each costs ~1 µs in the steps after parsing,
    a scalar ~0.2 µs)."""
    elements = members = objects = arrays = 0
    level: list[Any] = [value] if type(value) is dict or type(value) is list else []
    depth = 1
    while level:
        if depth > max_depth:
            raise TooDeep(depth)
        if objects + arrays + len(level) > max_containers:
            raise TooManyElements("objects and arrays", max_containers)
        below: list[Any] = []
        push = below.append
        for item in level:
            if type(item) is dict:
                objects += 1
                size = len(item)
                members += size
                children = item.values()
            else:
                arrays += 1
                size = len(item)
                children = item
            elements += size
            if elements > max_elements:
                raise TooManyElements("values", max_elements)
            for child in children:
                kind = type(child)
                if kind is dict or kind is list:
                    push(child)
        level = below
        depth += 1
    return JsonShape(elements, members, objects, arrays)


def nesting_exceeds(value: object, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels (``value`` itself is level 1)."""
    try:
        measure(value, max_depth=limit, max_elements=2**62, max_containers=2**62)
    except TooDeep:
        return True
    return False
