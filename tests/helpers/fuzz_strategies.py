"""Hypothesis strategies for hostile requests: JSON bodies (odd types, OpenAI's nulls, deep
nesting, numbers past 64 bits, bad UTF-8), Content-Encodings (valid, corrupt, unsupported),
headers, and whole requests as raw bytes (bad request lines, header names and values, framing).
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass

from hypothesis import strategies as st


def encode(body: object) -> bytes:
    # The standard library writes what orjson refuses to: integers past 64 bits.
    return json.dumps(body).encode()


def nested(depth: int, leaf: object = "x") -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"content": value}
    return value


def deep_raw(depth: int) -> bytes:
    """A body nested past what orjson can write (built as text)."""
    inner = b'"x"'
    for i in range(depth):
        inner = b"[" + inner + b"]" if i % 2 else b'{"content":' + inner + b"}"
    return b'{"model":"tiny","messages":[{"role":"user","content":' + inner + b"}]}"


# -- bodies ----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "tools",
    "priority",
    "vllm_xargs",
    "temperature",
]
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]) | json_values},
    optional={"content": json_values, "name": json_values, "tool_calls": json_values},
)
body_objects = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("tiny") | json_values,
        "messages": st.lists(message, max_size=3) | json_values,
        "stream": st.none() | st.booleans() | json_values,
        "n": st.none() | st.integers(-2, 3) | json_values,
        "max_tokens": st.none() | st.integers(-1, 300) | json_values,
        "stream_options": st.none() | st.just({"include_usage": True}) | json_values,
        "tools": json_values,
        "priority": json_values,
        "vllm_xargs": json_values,
    },
).map(lambda d: d if "messages" in d else {**d, "messages": [{"role": "user", "content": "hi"}]})

raw_bodies = st.one_of(
    body_objects.map(encode),
    st.dictionaries(st.sampled_from(FIELDS), json_values).map(encode),
    st.integers(1, 400).map(deep_raw),
    st.integers(1, 1100).map(lambda d: b"[" * d + b"]" * d),
    st.binary(max_size=64),
    st.just(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}], "n": 1e400}'),
)

# -- encodings and headers a client library can send -----------------------------------------

encodings = st.sampled_from(["", "gzip", "deflate", "br", "zstd", "gzip, gzip", "x-garbage"])


# How a body is spoilt after its encoding: cut in half, not the coding at all, bytes after its
# end, one byte flipped (a bad CRC or a bad deflate block). The C parser once answered every
# kind but the first with 500 (issue 22).
CORRUPTIONS = ("", "truncate", "garbage", "trailing", "flip")


def compress(data: bytes, encoding: str, corrupt: str) -> bytes:
    if encoding == "gzip":
        data = gzip.compress(data)
    elif encoding == "gzip, gzip":
        data = gzip.compress(gzip.compress(data))
    elif encoding == "deflate":
        data = zlib.compress(data)
    if corrupt == "truncate":
        return data[: len(data) // 2]
    if corrupt == "garbage":
        return b"this is not " + encoding.encode() + b" data" + data[:8]
    if corrupt == "trailing":
        return data + b"\x00trailing"
    if corrupt == "flip" and data:
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0x55]) + data[middle + 1 :]
    return data


header_sets = st.dictionaries(
    st.sampled_from(
        [
            "Connection",
            "Cookie",
            "Expect",
            "X-data-parallel-rank",
            "Content-Type",
            "TE",
            "X-Vllm-Priority",
            "Accept-Encoding",
            "Authorization",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
    max_size=3,
)
paths = st.sampled_from(["/v1/chat/completions"] * 6 + ["/v1/completions"] * 3) | st.sampled_from(
    ["/v1/models", "/healthz", "/metrics", "/v1/embeddings", "/", "/v1/chat/completions/"]
)


@dataclass(frozen=True)
class ClientCase:
    """A request an HTTP client library can send."""

    method: str
    path: str
    body: bytes
    encoding: str
    corrupt: str  # one of CORRUPTIONS
    headers: dict[str, str]


client_cases = st.builds(
    ClientCase,
    method=st.sampled_from(["POST"] * 8 + ["GET", "PUT"]),
    path=paths,
    body=raw_bodies,
    encoding=encodings,
    corrupt=st.sampled_from(CORRUPTIONS),
    headers=header_sets,
)

# -- whole requests as bytes -----------------------------------------------------------------


def mostly(
    common: st.SearchStrategy[bytes], rare: st.SearchStrategy[bytes]
) -> st.SearchStrategy[bytes]:
    """``common`` nine times in ten: ``common | rare`` picks each half the time (and one_of
    drops repeats of one strategy, hence the distinct weights)."""
    return st.integers(0, 9).flatmap(lambda i: rare if i == 0 else common)


def _line_safe(data: bytes) -> bytes:
    """Arbitrary bytes, but no CR or LF: the request still ends where the test says."""
    return data.replace(b"\r", b"").replace(b"\n", b"")


header_names = st.sampled_from(
    [
        b"Content-Length",
        b"Transfer-Encoding",
        b"Expect",
        b"Connection",
        b"Content-Encoding",
        b"Host",
        b"Authorization",
        b"api-key",
        b"Upgrade",
        b"X-Vllm-Priority",
        b"X-Tierproxy-Ticket",
        b"Bad Name",
        b"",
        b"X-\x00",
        b"\xc3\xa9",
    ]
) | st.binary(max_size=10).map(_line_safe)
header_values = st.sampled_from(
    [
        b"chunked",
        b"gzip",
        b"chunked, gzip",
        b"100-continue",
        b"close",
        b"Upgrade",
        b"h2c",
        b"-1",
        b"abc",
        b"0",
        b"",
        b" padded ",
        b"\xff\xfe",
        b"a\x01b",
        b"a\x00b",
        b"x" * 9000,
        # Credentials that are not UTF-8 (issue 22 #13: a 500 for anyone, key or not).
        b"Bearer \xff\xfe\xfd",
        b"Bearer \xc3\x28",
        b"Bearer \xed\xa0\x80",
        b"Bearer caf\xe9",
        b"Bearer a\x01b",
    ]
) | st.binary(max_size=16).map(_line_safe)
FRAMINGS = ["length", "chunked", "bad-chunk", "bad-length", "short-length", "none"]


@dataclass(frozen=True)
class RawCase:
    """A request written byte by byte: whatever a broken or hostile client might send."""

    method: bytes
    target: bytes
    version: bytes
    headers: list[tuple[bytes, bytes]]
    authorized: bool
    framing: str
    body: bytes
    bad_length: bytes

    def wire(self, authorization: bytes) -> bytes:
        lines = [self.method + b" " + self.target + b" " + self.version, b"Host: proxy"]
        lines += [name + b": " + value for name, value in self.headers]
        if self.authorized:
            lines.append(b"Authorization: " + authorization)
        body = self.body
        if self.framing == "length":
            lines.append(b"Content-Length: %d" % len(body))
        elif self.framing == "short-length":
            lines.append(b"Content-Length: %d" % (len(body) // 2))
        elif self.framing == "bad-length":
            lines.append(b"Content-Length: " + self.bad_length)
        elif self.framing == "chunked":
            lines.append(b"Transfer-Encoding: chunked")
            half = len(body) // 2
            parts = [p for p in (body[:half], body[half:]) if p]
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        elif self.framing == "bad-chunk":
            lines.append(b"Transfer-Encoding: chunked")
            body = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        else:
            body = b""
        lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


raw_cases = st.builds(
    RawCase,
    method=mostly(
        st.sampled_from([b"POST"] * 6 + [b"GET", b"PUT", b"G\x00T", b"", b"PRI"]),
        st.binary(max_size=6).map(_line_safe),
    ),
    target=mostly(
        st.sampled_from(
            [b"/v1/chat/completions"] * 4
            + [b"/v1/completions", b"/healthz", b"*", b"http://x/v1/chat/completions", b"/%zz"]
        ),
        st.binary(max_size=12).map(lambda b: b"/" + _line_safe(b).replace(b" ", b"")),
    ),
    version=st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""]),
    headers=st.lists(st.tuples(header_names, header_values), max_size=2),
    authorized=st.booleans(),
    framing=st.sampled_from(FRAMINGS),
    body=mostly(
        st.sampled_from(
            [
                b'{"model":"tiny","messages":[{"role":"user","content":"hi"}]}',
                b'{"model":"tiny","prompt":"hi","stream":true}',
            ]
        ),
        st.binary(max_size=32),
    ),
    bad_length=st.sampled_from([b"-1", b"abc", b"1 2", b"+3", b"0x10", b"", b"3, 3"]),
)
