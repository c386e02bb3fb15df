"""Backend choosers compared on a conversation scenario over two local vLLM engines with small
prefix caches: each policy in turn through a fresh proxy process, the engines' caches emptied
between runs (``POST /reset_prefix_cache``, which needs ``VLLM_SERVER_DEV_MODE=1``).

Per run: prefill tokens vLLM computed (its prompt-token counter less its prefix-cache hits),
the hit rate, TTFT p50/p99 per tier, output tokens/s, each engine's share of the requests, and,
where the proxy's usage log carries the index's prediction (``predicted_cached_tokens``), how
often it equals vLLM's ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.bench.convclient import ChatRecord, run_load
from proxy.bench.conversations import ConversationScenario
from proxy.bench.kvbreakdown import breakdown
from proxy.bench.proxy_config import DEFAULT_TIERS
from proxy.bench.scrape import fetch_metrics, wait_idle
from proxy.bench.stack import ProxyProcess
from proxy.bench.stats import percentile
from proxy.bench.tenantcost import tenant_mean, tenant_shares
from proxy.config.tenants import hash_key
from proxy.ops.process import free_port
from proxy.telemetry import prometheus
from proxy.tools.engine import EngineProcess, local_engine

COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "requests": "vllm:request_success_total",
    "preemptions": "vllm:num_preemptions_total",
}
HTTP = aiohttp.ClientTimeout(total=30)


def engine_args(scenario: ConversationScenario) -> list[str]:
    """Past the KV-event flags (``kv_event_args``): a prefix cache of the scenario's size."""
    args = ["--num-gpu-blocks-override", str(scenario.engine.kv_blocks)]
    if scenario.engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(scenario.engine.max_num_batched_tokens)]
    return args


def start_engines(scenario: ConversationScenario, logs: Path, n: int = 2) -> list[EngineProcess]:
    """``n`` stock engines (no plugin), confined to the engine cores, one OMP core each. A port
    taken by another process between its choice and the bind (the engine dies at start) is
    chosen again, twice at most."""
    for attempt in range(3):
        engines = []
        for i in range(n):
            spec = local_engine(
                index=i,
                max_num_seqs=scenario.engine.max_num_seqs,
                max_model_len=scenario.engine.max_model_len,
                plugin=False,
                kv_events_port=free_port(),
                block_size=scenario.engine.block_size,
                extra_args=engine_args(scenario),
                env={"VLLM_SERVER_DEV_MODE": "1"},
            )
            engines.append(EngineProcess(spec, logs / f"kv-engine-{i}.log"))
        try:
            for e in engines:
                e.start()
            for e in engines:
                e.wait_ready()
            return engines
        except RuntimeError as exc:
            for e in engines:
                e.stop()
            if attempt == 2:
                raise
            print(f"engines failed to start ({exc}); again", file=sys.stderr)
        except BaseException:
            for e in engines:
                e.stop()
            raise
    raise AssertionError("unreachable")


def proxy_config(
    scenario: ConversationScenario,
    urls: list[str],
    policy: str,
    usage_log: Path,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """The run's proxy config; ``tokenizer`` (the served model's directory): the KV index and
    the prompts' blocks on, for ``kv_aware``."""
    # resync_s 0 (the default): each run starts from caches just emptied, so a subscriber
    # joining the engines' event streams midway holds all they hold from the start.
    kv_cache = {
        "enabled": True,
        "block_size": scenario.engine.block_size,
        "tokenizer": tokenizer,
        "resync_s": 0,
    }
    # kv_aware@BEST/WORST[/HOLD_S[/WORK_WEIGHT]]
    name, _, weights = policy.removesuffix("+kv").partition("@")
    policies: dict[str, Any] = {"backends": name}
    if weights:
        best, worst, *more = (float(w) for w in weights.split("/"))
        knobs: dict[str, float] = {"room_weight_best": best, "room_weight_worst": worst}
        for knob, value in zip(("hold_s", "work_weight"), more, strict=False):
            knobs[knob] = value
        policies["kv_aware"] = knobs
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "tiers": {t: DEFAULT_TIERS[t] for t in scenario.tiers},
        "tenants": [
            {
                "name": t.name,
                "tier": t.tier,
                "keys": [{"sha256": hash_key(t.api_key)}],
                **({"cache_group": t.cache_group} if t.cache_group else {}),
            }
            for t in scenario.tenants
        ],
        "backends": [{"url": u, "max_inflight": scenario.max_inflight} for u in urls],
        "policies": policies,
        "usage_log": {"path": str(usage_log)},
        **({"kv_cache": kv_cache} if tokenizer is not None else {}),
    }


@dataclass
class RunFigures:
    policy: str
    round: int
    requests: int
    failed: int
    prompt_tokens: float
    prefill_computed: float
    hit_rate: float
    output_tok_s: float
    ttft_ms: dict[str, tuple[float, float]]  # tier -> (p50, p99)
    engine_share: list[float]
    preemptions: float
    index_exact: float | None  # share of requests whose predicted cached tokens were exact
    index_compared: int = 0
    notes: list[str] = field(default_factory=list)
    lost: dict[str, float] = field(default_factory=dict)  # kvbreakdown.Breakdown.shares()
    # Each chat tenant's computed share, from vLLM's cached_tokens of its turns
    # (``tenantcost.tenant_shares``): the run's share with every tenant alike is their mean.
    tenant_shares: dict[str, float] = field(default_factory=dict)


async def _counters(urls: list[str]) -> list[dict[str, float]]:
    out = []
    async with aiohttp.ClientSession(timeout=HTTP) as session:
        for url in urls:
            text = await wait_idle(session, url, timeout_s=120, settle_s=0.5) or (
                await fetch_metrics(session, url) or ""
            )
            out.append({k: prometheus.total(text, name) for k, name in COUNTERS.items()})
    return out


async def reset_caches(urls: list[str]) -> None:
    async with aiohttp.ClientSession(timeout=HTTP) as session:
        for url in urls:
            async with session.post(f"{url}/reset_prefix_cache") as resp:
                if resp.status != 200:
                    raise RuntimeError(
                        f"{url}/reset_prefix_cache: {resp.status} {await resp.text()}"
                    )


def _usage_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(
    policy: str,
    round_: int,
    records: list[ChatRecord],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    usage: list[dict[str, Any]],
    duration_s: float,
    block_size: int,
) -> RunFigures:
    backends = {u["request_id"]: u["backend"] for u in usage if u.get("backend")}
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    prompt = sum(d["prompt"] for d in delta)
    hits = sum(d["hits"] for d in delta)
    queries = sum(d["queries"] for d in delta)
    served = [d["requests"] for d in delta]
    ok = [r for r in records if r.status == 200]
    ttft: dict[str, tuple[float, float]] = {}
    for tier in dict.fromkeys(r.tier for r in records):
        values = sorted(r.ttft * 1000 for r in ok if r.tier == tier and r.ttft is not None)
        if values:
            ttft[tier] = (percentile(values, 50), percentile(values, 99))
    predicted = [u for u in usage if isinstance(u.get("predicted_cached_tokens"), int)]
    exact = [u for u in predicted if u["predicted_cached_tokens"] == u.get("cached_prompt_tokens")]
    return RunFigures(
        policy=policy,
        round=round_,
        requests=len(records),
        failed=len(records) - len(ok),
        prompt_tokens=prompt,
        prefill_computed=prompt - hits,
        hit_rate=hits / queries if queries else 0.0,
        output_tok_s=sum(r.completion_tokens for r in ok) / duration_s,
        ttft_ms=ttft,
        engine_share=[s / sum(served) if sum(served) else 0.0 for s in served],
        preemptions=sum(d["preemptions"] for d in delta),
        index_exact=len(exact) / len(predicted) if predicted else None,
        index_compared=len(predicted),
        lost=breakdown(records, backends, block_size).shares(),
        tenant_shares=tenant_shares(
            (r.tenant, r.prompt_tokens, r.prompt_tokens - r.cached_tokens)
            for r in ok
            if r.kind == "turn" and r.cached_tokens is not None
        ),
    )


def run_dir_name(policy: str, round_: int) -> str:
    """The folder of one run's proxy config, logs and ``records.json``."""
    return f"{policy.replace('/', '-')}-{round_}"


def run_policy(
    scenario: ConversationScenario,
    urls: list[str],
    policy: str,
    round_: int,
    out_dir: Path,
    duration_s: float,
    tokenizer: str | None = None,
    replica: int = 0,
) -> RunFigures:
    """One policy through a fresh proxy, from emptied caches; ``replica``: the clients' draw."""
    asyncio.run(reset_caches(urls))
    before = asyncio.run(_counters(urls))
    run_dir = out_dir / run_dir_name(policy, round_)
    run_dir.mkdir(parents=True, exist_ok=True)
    usage_log = run_dir / "usage.jsonl"
    usage_log.unlink(missing_ok=True)
    config_path = run_dir / "proxy.yaml"
    data = proxy_config(scenario, urls, policy, usage_log, tokenizer)
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    port = free_port()
    proxy = ProxyProcess(config_path, port, run_dir / "proxy.log")
    print(f"[{policy} #{round_}] proxy on {proxy.url}, {duration_s:.0f} s", file=sys.stderr)
    proxy.start()
    try:
        records = asyncio.run(run_load(proxy.url, scenario, duration_s, replica))
    finally:
        proxy.stop()  # the usage log is flushed on a clean stop
    after = asyncio.run(_counters(urls))
    (run_dir / "records.json").write_text(json.dumps([asdict(r) for r in records]))
    usage = _usage_lines(usage_log)
    block = scenario.engine.block_size
    return figures(policy, round_, records, before, after, usage, duration_s, block)


def pinned_urls(scenario: ConversationScenario, urls: list[str]) -> dict[str, str]:
    """Each tenant to one fixed engine, in turn by the scenario's order (the reference a
    cache-aware chooser has to beat: no spill, no tenant's prompts on two engines)."""
    return {t.name: urls[i % len(urls)] for i, t in enumerate(scenario.tenants)}


def run_pinned(
    scenario: ConversationScenario,
    urls: list[str],
    round_: int,
    out_dir: Path,
    duration_s: float,
    replica: int = 0,
) -> RunFigures:
    """The load sent straight to the engines, each tenant to its own (``pinned_urls``): its
    prefill figures compare; its TTFT has no proxy and no queueing in it, so it does not."""
    asyncio.run(reset_caches(urls))
    before = asyncio.run(_counters(urls))
    run_dir = out_dir / run_dir_name("pinned", round_)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[pinned #{round_}] straight to the engines, {duration_s:.0f} s", file=sys.stderr)
    records = asyncio.run(run_load(pinned_urls(scenario, urls), scenario, duration_s, replica))
    after = asyncio.run(_counters(urls))
    (run_dir / "records.json").write_text(json.dumps([asdict(r) for r in records]))
    block = scenario.engine.block_size
    return figures("pinned", round_, records, before, after, [], duration_s, block)


def render(
    runs: list[RunFigures], baseline: str = "least_utilised", *, last_only: bool = False
) -> str:
    """A markdown table. Prefill computed is also given as a share of the prompt tokens, and
    that share against the baseline's in the same round: the load is closed-loop, so a
    faster policy sends more requests (more prompt tokens) in the same time. ``last_only``:
    the last run's row alone, against its round's baseline among ``runs`` (as runs end)."""
    base = {
        r.round: r.prefill_computed / r.prompt_tokens
        for r in runs
        if r.policy == baseline and r.prompt_tokens
    }
    shown = runs[-1:] if last_only else runs
    tiers = list(dict.fromkeys(t for r in shown for t in r.ttft_ms))
    head = ["policy", "round", "requests (failed)", "prefill computed", f"share x {baseline}"]
    head += ["each tenant alike", "hit rate"] + [f"TTFT {t} p50/p99 ms" for t in tiers]
    head += ["output tok/s", "engine share", "index exact"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in shown:
        share = r.prefill_computed / r.prompt_tokens if r.prompt_tokens else float("nan")
        ratio = share / base[r.round] if base.get(r.round) else float("nan")
        cells = [
            f"`{r.policy}`",
            str(r.round),
            f"{r.requests} ({r.failed})",
            f"{r.prefill_computed:,.0f} of {r.prompt_tokens:,.0f} ({share:.0%})",
            f"{ratio:.2f}",
            f"{tenant_mean(r.tenant_shares):.0%}" if r.tenant_shares else "n/a",
            f"{r.hit_rate:.0%}",
        ]
        for t in tiers:
            p50, p99 = r.ttft_ms.get(t, (float("nan"), float("nan")))
            cells.append(f"{p50:,.0f} / {p99:,.0f}")
        cells.append(f"{r.output_tok_s:,.0f}")
        cells.append(" / ".join(f"{s:.0%}" for s in r.engine_share))
        exact = "n/a" if r.index_exact is None else f"{r.index_exact:.1%} of {r.index_compared}"
        cells.append(exact)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_lost(runs: list[RunFigures]) -> str:
    """Where each run's prefill went, as shares of all its prompt tokens (kvbreakdown)."""
    head = "| policy | round | floor (new text, flood) | moved | evicted | new conversations |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in runs:
        cells = [f"{100 * r.lost.get(k, 0.0):.1f} %" for k in ("floor", "moved", "evicted")]
        cells.append(f"{100 * r.lost.get('new_conversation', 0.0):.1f} %")
        lines.append(f"| `{r.policy}` | {r.round} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
