"""Property-based fuzzing of the real proxy (``running_proxy``: create_app on production's
Listeners) with an in-process backend: requests an HTTP client library can send (odd JSON
bodies, encodings, headers, paths) and requests written as raw bytes (bad request lines, header
names and values, framing). Never a 5xx, every error OpenAI-shaped JSON, nothing left held.

``TIERPROXY_FUZZ_CASES`` cases (default 10,000). Hypothesis draws ``BATCH`` cases per example
(its cost per example, not per case, dominates), all sent through one app, one client session
and one event loop; the status histogram is printed in pytest's summary and written to
.tierproxy/test-logs/fuzz-histogram.json.
"""

from __future__ import annotations

from tests.helpers.fuzzing import FUZZ_CASES, Harness, fuzz


def test_fuzzed_requests_never_get_a_5xx_nor_leak() -> None:
    fuzz(Harness(), FUZZ_CASES)
