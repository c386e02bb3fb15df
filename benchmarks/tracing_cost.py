"""CPU time of one request's spans (proxy.telemetry.spans), apart from everything else the proxy
does: the calls the pipeline makes for a streamed request (server span, queue wait, dispatch,
upstream with its first-token event, relay), timed in process CPU time (not wall time: a busy
machine does not inflate it), at sample ratios 0 and 1, with the spans handed to an exporter
that drops them or that encodes them to OTLP protobuf as the real one does before sending.

    python benchmarks/tracing_cost.py [--requests 5000]

The end-to-end figure (the whole proxy under wrk, spans sent over OTLP/HTTP) is
``benchmarks/overhead.py --tracing 0.01,1`` (docs/performance.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from proxy.api.outcome import Outcome
from proxy.config.tracing import TracingSettings
from proxy.relay.forward import RelayResult
from proxy.telemetry.tracing import Tracing


class NullExporter(SpanExporter):
    def __init__(self, encode: bool) -> None:
        self.encode = encode
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.encode:
            encode_spans(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


# What the relay returns for a stream (its first token at the call's time).
RESULT = RelayResult(
    web.StreamResponse(),
    Outcome.OK,
    200,
    usage={"prompt_tokens": 7, "completion_tokens": 3},
    first_token_at=time.monotonic(),
)


class FakeRequest:
    method = "POST"
    path = "/v1/chat/completions"
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": "Bearer sk-bench"}))


def one_request(tracing: Tracing) -> None:
    now = time.monotonic()
    spans = tracing.begin(FakeRequest(), "req-1", now, now, "tenant")  # type: ignore[arg-type]
    spans.queue_wait("normal", 0, 0, now)
    spans.upstream(
        backend="http://127.0.0.1:8000",
        address="127.0.0.1:8000",
        room=8.0,
        inflight=1,
        granted_at=now,
        path="/v1/chat/completions",
        now=now,
    )
    spans.upstream_done(RESULT, now)
    spans.end("tenant", "normal", "ok", 200, now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    n = args.requests
    print("| sample ratio | exporter | spans/request | CPU µs/request |\n|---|---|---|---|")
    for ratio in (0.0, 1.0):
        for encode in (False, True):
            exporter = NullExporter(encode)
            settings = TracingSettings(endpoint="http://127.0.0.1:9", sample_ratio=ratio)
            tracing = Tracing(settings, processor=SimpleSpanProcessor(exporter))
            for _ in range(200):  # warm up
                one_request(tracing)
            exporter.spans = 0
            start = time.process_time()
            for _ in range(n):
                one_request(tracing)
            cpu = time.process_time() - start
            tracing.shutdown()
            kind = "encodes OTLP protobuf" if encode else "drops"
            print(f"| {ratio:g} | {kind} | {exporter.spans / n:g} | {cpu / n * 1e6:.1f} |")


if __name__ == "__main__":
    main()
