"""Red team of issue 34's promises (tenants' own LoRA adapters) against `tierproxy serve` (a
subprocess on its default loop) in front of a real CPU vLLM (``--enable-lora --max-lora-rank 8
--max-loras 2``, runtime loading on). Clients behave like remote ones; what is checked is
counted (statuses, the proxy's ``tierproxy_adapter_*`` metrics, the usage log, the log's
lines), never timed.

Findings (each test fails on main as of 714a979):

- R1: a request that passed the model check and waits for its tenant's limit
  (``on_limit: queue``) is outside the dispatcher's queue when a reload revokes the tenant's
  access to its adapter, or removes the adapter: once its allowance comes it is served and
  billed, a removed adapter by the engine's stray copy, uncounted in the adapter slots.
- R2: the adapter checks that span the file (an unknown tenant or tier, a bad name) are
  refused at "(top level) (line 1)", not at the entry's line.
- R3: each broken adapter of one tenant gives up an idle adapter of another tenant (within
  its share, used a second ago) before its load fails; three broken adapters, three reloads
  of the other tenant's adapter in seconds (the 30 s hold is per adapter, not per tenant).
- R4: `max_loras: yes` (a YAML boolean) is taken as 1 slot, not refused.
- R5: an unpriced adapter matches a `"*": 0` glob before its base model's price: free.
- E1 (vLLM, no test: it needs a fresh engine): a base-model request before any LoRA request
  on a fresh --enable-lora CPU engine kills its worker (SIGILL); R5 sends the adapter first.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from safetensors.numpy import load_file, save

from proxy.bench.hostile.served import ADMIN_KEY, ServedProxy, admin_sections
from proxy.bench.inproc import KEYS, make_config
from proxy.config.tenants import hash_key
from proxy.tools.engine import EngineProcess
from proxy.tools.tiny_adapters import make_tiny_adapters
from tests.helpers.enginefarm import EngineFarm
from tests.helpers.engines import LORA
from tests.helpers.served_logs import sighup_reload

# `long`: the LoRA engine's start, as tests/integration/test_adapters_vllm.py.
pytestmark = [pytest.mark.integration, pytest.mark.engines(LORA), pytest.mark.long]
TIMEOUT = aiohttp.ClientTimeout(total=300)
PEER_KEY = "key-peer-of-the-low-tier"
BROKEN = ("bad-garbage", "bad-rank", "bad-shape")


@pytest.fixture(scope="module")
def engine(engines: EngineFarm) -> EngineProcess:
    return engines.get(LORA)


@pytest.fixture(scope="module")
def adapter_dirs(
    engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Three good adapters, and three that vLLM refuses to load (HTTP 500 from its worker):
    bytes that are no safetensors, a rank past --max-lora-rank, tensors of the wrong shape."""
    out = tmp_path_factory.mktemp("adapters")
    dirs = make_tiny_adapters(out, engine.spec.model, names=("good-a", "good-b", "good-c"))
    source = dirs["good-a"]
    config = (source / "adapter_config.json").read_text()
    weights = source / "adapter_model.safetensors"
    broken = {"bad-garbage": (config, b"\x7f" * 5000),
              "bad-rank": (config.replace('"r": 8', '"r": 16'), weights.read_bytes()),
              "bad-shape": (config, _wrong_shapes(weights))}  # fmt: skip
    for name, (text, data) in broken.items():
        dirs[name] = out / name
        dirs[name].mkdir()
        (dirs[name] / "adapter_config.json").write_text(text)
        (dirs[name] / "adapter_model.safetensors").write_bytes(data)
    return dirs


def _wrong_shapes(weights: Path) -> bytes:
    tensors = load_file(str(weights))
    return save({k: v.repeat(2, axis=0).repeat(3, axis=1) for k, v in tensors.items()})


@pytest.fixture
def clean_engine(engine: EngineProcess) -> Iterator[EngineProcess]:
    """The engine with no adapter loaded, before and after (other modules share it)."""
    asyncio.run(_unload_all(engine))
    yield engine
    asyncio.run(_unload_all(engine))


async def _unload_all(engine: EngineProcess) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{engine.spec.url}/v1/models") as resp:
            cards = (await resp.json())["data"]
        for card in cards:
            if card.get("parent"):
                url = f"{engine.spec.url}/v1/unload_lora_adapter"
                async with session.post(url, json={"lora_name": card["id"]}) as resp:
                    assert resp.status in (200, 404), await resp.text()


def _config(
    engine: EngineProcess, dirs: dict[str, Path], tmp: Path, **extra: Any
) -> dict[str, Any]:
    """The demo tenants plus tenant-peer (low tier, its own adapter); good-a is tenant-high's,
    good-b tenant-normal's, good-c tenant-peer's, the broken ones tenant-low's."""
    owners = {"good-a": "tenant-high", "good-b": "tenant-normal", "good-c": "tenant-peer"}
    owners |= {name: "tenant-low" for name in BROKEN}
    adapters = {
        name: {"path": str(dirs[name]), "base_model": "tiny", "tenants": [owner]}
        for name, owner in owners.items()
    }
    tenants = [
        {"name": f"tenant-{tier}", "tier": tier, "keys": [{"sha256": hash_key(key)}]}
        for tier, key in KEYS.items()
    ]
    peer = {"name": "tenant-peer", "tier": "low", "keys": [{"sha256": hash_key(PEER_KEY)}]}
    tenants.append(peer)
    backend = {"url": engine.spec.url, "max_inflight": 8, "max_loras": 2, "load_adapters": True}
    return make_config(
        [backend],
        tenants=tenants,
        adapters=adapters,
        usage_log={"path": str(tmp / "usage.jsonl")},
        **admin_sections(),
        **extra,
    )


@asynccontextmanager
async def served(config: dict[str, Any], tmp: Path) -> AsyncIterator[tuple[ServedProxy, Client]]:
    proxy = ServedProxy(config, tmp)
    await asyncio.to_thread(proxy.start)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            client = Client(session, proxy)
            await client.until_listed("good-a", "high")
            yield proxy, client
    finally:
        await asyncio.to_thread(proxy.stop)


class Client:
    def __init__(self, session: aiohttp.ClientSession, proxy: ServedProxy) -> None:
        self.session, self.proxy = session, proxy

    @staticmethod
    def headers(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {PEER_KEY if who == 'peer' else KEYS[who]}"}

    async def complete(self, who: str, model: str, max_tokens: int = 2) -> tuple[int, bytes]:
        body = {"model": model, "prompt": "hello there", "max_tokens": max_tokens}
        url = f"{self.proxy.url}/v1/completions"
        async with self.session.post(url, json=body, headers=self.headers(who)) as resp:
            return resp.status, await resp.read()

    async def until_listed(self, model: str, who: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            url = f"{self.proxy.url}/v1/models"
            async with self.session.get(url, headers=self.headers(who)) as resp:
                if model in {c["id"] for c in (await resp.json())["data"]}:
                    return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{model} never listed")

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of a counter's children with these labels (0 when none)."""
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with self.session.get(f"{self.proxy.admin_url}/metrics", headers=headers) as resp:
            text = await resp.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.mark.parametrize("change", ["revoked", "removed"])
async def test_r1_a_request_waiting_for_its_tenants_limit_meets_the_reload(
    clean_engine: EngineProcess, adapter_dirs: dict[str, Path], tmp_path: Path, change: str
) -> None:
    """Promises 6 and 1. tenant-normal may run one request at once and waits for its
    allowance (``on_limit: queue``). Its first request for good-b runs (a stream, held open);
    its second waits for the allowance; a reload then takes good-b from it (``revoked``) or
    out of the catalogue (``removed``). docs/adapters.md: "a request already queued is never
    served, nor billed, after the reload that revoked it", and a removed adapter is nobody's.
    Found: the waiting request was in no queue at the reload, and is served (200) once the
    first ends, billed; a removed adapter by the engine's copy still loaded, as a base model
    would be (no adapter slot counted)."""
    config = _config(clean_engine, adapter_dirs, tmp_path)
    normal = next(t for t in config["tenants"] if t["name"] == "tenant-normal")
    normal.update(max_concurrent=1, on_limit="queue")
    async with served(config, tmp_path) as (proxy, client):
        body = {"model": "good-b", "prompt": "hi", "max_tokens": 1900, "ignore_eos": True,
                "stream": True}  # fmt: skip
        url = f"{proxy.url}/v1/completions"
        first = await client.session.post(url, json=body, headers=client.headers("normal"))
        assert first.status == 200
        await first.content.readline()  # it runs: the tenant's one request in flight
        waits_before = await client.metric("tierproxy_rate_limited_total", tenant="tenant-normal")
        second = asyncio.create_task(client.complete("normal", "good-b"))
        while (
            await client.metric("tierproxy_rate_limited_total", tenant="tenant-normal")
            <= waits_before
        ):
            assert not second.done(), second.result()
            await asyncio.sleep(0.05)
        changed = _config(clean_engine, adapter_dirs, tmp_path)
        changed["tenants"] = config["tenants"]
        if change == "revoked":
            changed["adapters"]["good-b"]["tenants"] = ["tenant-high"]
        else:
            del changed["adapters"]["good-b"]
        await sighup_reload(proxy, changed, expect="config reloaded")
        first.close()  # its allowance comes back: the waiting request goes on
        status, answer = await second
        # As a new request for it gets at once after the reload:
        after = await client.complete("normal", "good-b")
        assert after[0] == 404, after
        assert status == 404 and b"model_not_found" in answer, (
            f"{status} {answer[:200]!r}: served after the reload that {change} good-b"
        )


async def test_r2_an_adapters_bad_tenant_is_refused_at_its_line(
    clean_engine: EngineProcess, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Promise 6: "a bad value is refused with its line". An adapter naming a tenant the file
    does not define (a typo) is refused, the old config kept; found: at "(top level) (line
    1)", whatever line the name is on (so are an unknown tier and a bad adapter name)."""
    config = _config(clean_engine, adapter_dirs, tmp_path)
    async with served(config, tmp_path) as (proxy, client):
        config["adapters"]["good-b"]["tenants"] = ["tenant-nromal"]
        text = yaml.safe_dump(config)
        line = next(i for i, t in enumerate(text.splitlines(), 1) if "tenant-nromal" in t)
        await sighup_reload(proxy, config, expect="tenant-nromal")  # the refusal names it
        found = [t for t in proxy.log_lines() if "tenant-nromal" in t]
        assert (await client.complete("normal", "good-b"))[0] == 200  # the old config kept
        lines = {int(n) for t in found for n in re.findall(r"\(line (\d+)\)", t)}
        # The entry's own lines: its `tenants:` key and the name under it.
        assert lines & {line - 1, line}, (
            f"refused at line(s) {lines}, the name is on {line}: {found}"
        )


async def test_r3_broken_adapters_do_not_make_another_tenants_adapter_reload(
    clean_engine: EngineProcess, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Promise 3. tenant-high uses good-a and tenant-peer (low tier) good-c, each within its
    share, a request a second or so apart; tenant-low (the peer's tier) asks for its three
    broken adapters in turn. docs/adapters.md (Limits): with the 30 s hold "a broken adapter
    costs other tenants at most one such unload per backend per 30 s". Found: each broken
    adapter's load first unloads good-c (a failed load leaves tenant-low claiming nothing,
    so it is never at its share), and tenant-peer's next request loads it again: three
    reloads in seconds, one per broken adapter."""
    config = _config(clean_engine, adapter_dirs, tmp_path)
    async with served(config, tmp_path) as (_proxy, client):
        assert (await client.complete("high", "good-a"))[0] == 200
        assert (await client.complete("peer", "good-c"))[0] == 200
        for name in BROKEN:
            assert (await client.complete("high", "good-a"))[0] == 200  # its claim kept fresh
            status, answer = await client.complete("low", name)
            assert status == 503 and b"adapter_load_failed" in answer, (status, answer[:200])
            assert (await client.complete("peer", "good-c"))[0] == 200
        failed = await client.metric("tierproxy_adapter_load_failures_total")
        # The first broken load is tried; the others, which would unload the peer's adapter,
        # are held back for the tenant's failed load (503 at once, no load tried).
        assert failed == 1
        loads = {
            name: await client.metric("tierproxy_adapter_loads_total", adapter=name)
            for name in ("good-a", "good-c")
        }
        reloads = sum(loads.values()) - len(loads)
        assert reloads <= 1, f"other tenants' adapters reloaded {reloads} times: {loads}"


async def test_r4_a_yes_for_max_loras_is_refused_at_its_line(
    clean_engine: EngineProcess, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Promise 6: "a bad value is refused with its line". `max_loras: yes` (YAML 1.1 reads a
    boolean; an operator's "yes, LoRA on") is no count of slots. Found: taken as 1, the
    reload applied (so is `true`, and `max_inflight: yes` is a room of 1)."""
    config = _config(clean_engine, adapter_dirs, tmp_path)
    async with served(config, tmp_path) as (proxy, _client):
        mark = proxy.mark()
        text = proxy.config_path.read_text().replace("max_loras: 2", "max_loras: yes")
        assert "max_loras: yes" in text
        staged = proxy.config_path.with_suffix(".new")
        staged.write_text(text)
        staged.replace(proxy.config_path)
        os.kill(proxy.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not any("reload" in t and ("failed" in t or "reloaded" in t)
                      for t in proxy.lines_since(mark)):  # fmt: skip
            assert time.monotonic() < deadline, proxy.lines_since(mark)
            await asyncio.sleep(0.1)
        said = "\n".join(proxy.lines_since(mark))
        assert "config reload failed" in said and "max_loras" in said, said[-1500:]


async def test_r5_an_adapter_costs_at_least_its_base_model_under_a_catch_all_price(
    clean_engine: EngineProcess, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Promise 5: billed at its adapter's price; docs/adapters.md: "an adapter is never free
    where its base model is priced". `pricing:` prices the base model and leaves every other
    name free (`"*": 0`, models the operator does not bill); good-b has no price of its own.
    Found: good-b matches the glob before its base model is looked at: cost 0 for a tenant
    running the priced base model's engine (a budget quota passed by using any unpriced
    adapter)."""
    free = {"input": 0.0, "output": 0.0}
    pricing = {"tiny": {"input": 1.0, "output": 2.0}, "*": free}
    config = _config(clean_engine, adapter_dirs, tmp_path, pricing=pricing)
    async with served(config, tmp_path) as (_proxy, client):
        # The adapter first, as the report had it (E1: a base-model batch first killed a fresh
        # bfloat16 LoRA engine; LoRA engines run float32 now, test_engine_first_batch).
        assert (await client.complete("normal", "good-b", max_tokens=4))[0] == 200
        assert (await client.complete("normal", "tiny", max_tokens=4))[0] == 200
        deadline = time.monotonic() + 20
        path = tmp_path / "usage.jsonl"
        records: dict[str, dict[str, Any]] = {}
        while len(records) < 2:
            assert time.monotonic() < deadline, records
            lines = path.read_text().splitlines() if path.exists() else []
            records = {r["model"]: r for r in map(json.loads, lines) if r["status"] == 200}
            await asyncio.sleep(0.1)
        base, adapter = records["tiny"], records["good-b"]
        assert base["cost"] and base["cost"] > 0, base
        assert adapter["cost"] and adapter["cost"] > 0, f"the adapter billed {adapter['cost']}"
