"""Bodies with a Content-Encoding, good and corrupt, and what the proxy answers each: shared by
the in-process test (production's listeners, Python parser) and the served one (uvloop, C
parser), where corrupt ones once got ``500 internal_error``."""

from __future__ import annotations

import gzip
import zlib

import orjson

BODY = orjson.dumps(
    {"model": "null", "messages": [{"role": "user", "content": "zipped"}], "max_tokens": 1}
)
_GZ = gzip.compress(BODY)
_RAW_DEFLATE = zlib.compressobj(wbits=-15)
RAW_DEFLATE = _RAW_DEFLATE.compress(BODY) + _RAW_DEFLATE.flush()


def members(data: bytes, n: int) -> bytes:
    """``data`` as ``n`` gzip members one after the other (the last ones may be empty)."""
    size = -(-len(data) // n)
    parts = [data[i * size : (i + 1) * size] for i in range(n)]
    return b"".join(gzip.compress(part) for part in parts)


# (name, Content-Encoding, body, status, error code or None for a 200)
CASES: list[tuple[str, str, bytes, int, str | None]] = [
    ("gzip", "gzip", _GZ, 200, None),
    ("two gzip members", "gzip", gzip.compress(BODY[:10]) + gzip.compress(BODY[10:]), 200, None),
    ("sixteen gzip members", "gzip", members(BODY, 16), 200, None),
    ("seventeen gzip members", "gzip", members(BODY, 17), 400, "invalid_content_encoding"),
    ("zlib deflate", "deflate", zlib.compress(BODY), 200, None),
    ("raw deflate", "deflate", RAW_DEFLATE, 200, None),
    ("gzip twice", "gzip, gzip", gzip.compress(_GZ), 200, None),
    ("not gzip", "gzip", b"not gzip at all", 400, "invalid_content_encoding"),
    ("gzip, trailing bytes", "gzip", _GZ + b"junk", 400, "invalid_content_encoding"),
    ("gzip, truncated", "gzip", _GZ[:-6], 400, "invalid_content_encoding"),
    ("gzip, bad crc", "gzip", _GZ[:-8] + b"\0\0\0\0" + _GZ[-4:], 400, "invalid_content_encoding"),
    ("gzip header only", "gzip", _GZ[:10], 400, "invalid_content_encoding"),
    ("not deflate", "deflate", b"\x78\x9c garbage", 400, "invalid_content_encoding"),
    ("deflate, trailing", "deflate", zlib.compress(BODY) + b"xx", 400, "invalid_content_encoding"),
    ("gzip said, deflate sent", "gzip", zlib.compress(BODY), 400, "invalid_content_encoding"),
    ("empty gzip", "gzip", b"", 400, None),
    ("br", "br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
    ("gzip, then br", "gzip, br", _GZ, 415, "unsupported_content_encoding"),
]
