"""The ``tracing:`` section (the spans are ``proxy.telemetry.tracing``; docs/tracing.md)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from proxy.config.base import TUNING, Strict

# What each protocol's exporter needs (the ``tracing`` extra of the package brings both).
EXPORTER_MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}
SDK_MODULE = "opentelemetry.sdk.trace"
INSTALL_HINT = "pip install 'vllm-tierproxy[tracing]'"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class TracingSettings(Strict):
    """``tracing:`` — OpenTelemetry spans of each request, exported over OTLP; none: off
    (no span is made and the tracer is never loaded). Read at start."""

    endpoint: str = Field(
        min_length=1,
        description="The OTLP receiver: `http://HOST:4317` for grpc (or `unix:///PATH`),"
        " `http://HOST:4318/v1/traces` for http/protobuf (the full URL of the traces path)."
        " `https://` uses TLS; anything else is plaintext.",
        examples=["http://127.0.0.1:4317"],
    )
    protocol: Literal["grpc", "http/protobuf"] = Field(
        "grpc", description="OTLP over gRPC or over HTTP with protobuf bodies."
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of traces recorded (by trace id), a client's continued traces"
        " included unless `follow_client_sampling` is on.",
    )
    follow_client_sampling: bool = Field(
        False,
        description="Opt-in: a client's `traceparent` with its sampled flag set is recorded"
        " whatever `sample_ratio` says, up to `client_sampled_per_minute` requests per tenant;"
        " past that, and for a flag not set, `sample_ratio` decides. Off (the default): the"
        " proxy's ratio decides for every request (a tenant cannot make the proxy record, and"
        " the operator pay for, all its requests); the client's trace is continued either way.",
    )
    client_sampled_per_minute: int = Field(
        60,
        ge=0,
        description="With `follow_client_sampling`: the most requests per tenant and minute that"
        " a client's sampled flag alone gets recorded.",
    )
    service_name: str = Field(
        "tierproxy", min_length=1, description="The `service.name` of the proxy's spans."
    )
    export_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Bound on one export call (spans are exported off the loop).",
        json_schema_extra=TUNING,
    )

    @model_validator(mode="after")
    def _exporter_installed(self) -> TracingSettings:
        # Fail at load, not at the first request: tracing on without its packages is a mistake.
        for module in (SDK_MODULE, EXPORTER_MODULES[self.protocol]):
            if not _importable(module):
                raise ValueError(f"tracing is on but {module} is not installed ({INSTALL_HINT})")
        return self
