"""Cost in the usage log and ``tierproxy usage --cost``: each record's cost by the config's
``pricing:`` (cached prompt tokens at their own price), totalled by tenant, an unpriced model
named apart rather than silently counted as free."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from proxy.api.usage import cached_tokens
from proxy.cli import main
from proxy.config.quotas import Price, price_of


def _rec(
    tenant: str, cost: float | None, prompt: int = 100, cached: int = 0, key_id: str = "k1"
) -> bytes:
    return orjson.dumps(
        {
            "ts": 1000.0,
            "tenant": tenant,
            "key_id": key_id,
            "tier": "normal",
            "model": "tiny",
            "outcome": "ok",
            "prompt_tokens": prompt,
            "completion_tokens": 50,
            "queue_s": 0.1,
            "engine_s": 0.5,
            "cached_prompt_tokens": cached,
            "cost": cost,
        }
    )


def test_price_arithmetic_and_lookup() -> None:
    price = Price(input=3.0, cached_input=0.3, output=15.0)
    # 1,000 prompt tokens of which 800 cached, 500 output, per million tokens.
    assert price.cost(1000, 800, 500) == pytest.approx((200 * 3 + 800 * 0.3 + 500 * 15) / 1e6)
    assert price.worst_case(1000, 500) == pytest.approx((1000 * 3 + 500 * 15) / 1e6)
    assert Price(input=1, output=2).cost(10, 10, 0) == pytest.approx(10 / 1e6)  # null: input's
    table = {"tiny": Price(input=1, output=1), "llama-*": Price(input=2, output=2)}
    assert price_of(table, "tiny") is table["tiny"]
    assert price_of(table, "llama-3-8b") is table["llama-*"]
    assert price_of(table, "mistral") is None and price_of(table, None) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 32}}) == 32
    assert cached_tokens({"input_tokens_details": {"cached_tokens": 5}}) == 5
    assert cached_tokens({"prompt_tokens_details": None}) == 0 and cached_tokens(None) == 0


def test_usage_cost_totals_by_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "usage.jsonl"
    (tmp_path / "usage.jsonl.1").write_bytes(_rec("acme", 0.25, cached=60) + b"\n")
    lines = [_rec("acme", 0.5), _rec("beta", 1.125, cached=10), _rec("beta", None)]
    log.write_bytes(b"\n".join(lines) + b"\n")
    assert main(["usage", str(log), "--by", "tenant", "--cost"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == [
        "tenant",
        "requests",
        "ok",
        "prompt_tok",
        "completion_tok",
        "queue_s",
        "engine_s",
        "cached_tok",
        "cost",
    ]
    rows = {line.split()[0]: line.split() for line in out[1:4]}
    assert out[1].split()[0] == "beta"  # the costliest first
    assert rows["beta"][-2:] == ["10", "1.1250"]
    assert rows["acme"][-2:] == ["60", "0.7500"]
    assert rows["total"][1] == "4" and rows["total"][-2:] == ["70", "1.8750"]
    assert out[-1] == "(1 request(s) with tokens but no price: not in the cost)"
    # Without --cost, the table is as before.
    assert main(["usage", str(log), "--by", "tenant"]) == 0
    assert "cost" not in capsys.readouterr().out


def test_usage_by_key_shows_whether_a_rotated_out_key_is_still_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "usage.jsonl"
    lines = [_rec("acme", 0.5, key_id="old"), _rec("acme", 0.5, key_id="new")]
    log.write_bytes(b"\n".join([*lines, _rec("acme", 0.5, key_id="new")]) + b"\n")
    assert main(["usage", str(log), "--by", "key_id"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert rows["old"] == "1" and rows["new"] == "2"


def test_the_cli_offers_every_grouping_the_report_knows() -> None:
    from proxy.cli import admin
    from proxy.tools import usage_report

    assert admin.GROUPS == usage_report.GROUPS
