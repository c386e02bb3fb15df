"""`tierproxy engine` places a CPU engine on its own cores like `tierproxy up`, and says so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from proxy.cli import build_parser
from proxy.cli.engines import engine_spec
from proxy.tools import engine
from tests.helpers.paths import REPO


def _spec(*argv: str) -> engine.EngineSpec:
    args = build_parser().parse_args(["engine", "--model", "some/model", *argv])
    return engine_spec(args)


def test_a_cpu_engine_is_confined_and_says_where(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_on_cpu", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    spec = _spec()
    assert spec.cpus == frozenset({0, 1, 2})  # the last core stays for the proxy
    assert spec.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    note = engine.confinement_note(spec.cpus)
    assert "cores 0,1,2" in note and "core(s) 3 stay free" in note


def test_a_gpu_engine_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_on_cpu", lambda: False)
    spec = _spec("--", "--tensor-parallel-size", "2")
    assert spec.cpus is None and "VLLM_CPU_OMP_THREADS_BIND" not in spec.environment()
    assert spec.command()[-2:] == ["--tensor-parallel-size", "2"]
    assert "not confined" in engine.confinement_note(None)


def test_pooling_flag_serves_the_pooling_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_on_cpu", lambda: False)
    command = _spec("--pooling").command()
    runner = command.index("--runner")
    assert command[runner : runner + 4] == list(engine.POOLING_ARGS)


def test_kv_events_follow_the_configs_kv_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With -c, the engine publishes KV events (and a replay socket) exactly when the config's
    kv_cache is on, in the config's block size; --kv-events-port turns them on by hand."""
    import json

    monkeypatch.setattr(engine, "_on_cpu", lambda: False)
    base = yaml.safe_load((REPO / "configs/example.yaml").read_text())
    off, on = tmp_path / "off.yaml", tmp_path / "on.yaml"
    off.write_text(yaml.safe_dump(base))
    on.write_text(yaml.safe_dump({**base, "kv_cache": {"enabled": True, "block_size": 64}}))
    assert "--kv-events-config" not in _spec("-c", str(off)).command()
    command = _spec("-c", str(on)).command()
    assert command[command.index("--block-size") + 1] == "64"
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert (
        events["endpoint"].startswith("tcp://*:")
        and events["replay_endpoint"] != events["endpoint"]
    )
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(command)
    by_hand = _spec("--kv-events-port", "5557").command()
    assert '"endpoint":"tcp://*:5557"' in by_hand[by_hand.index("--kv-events-config") + 1]


def test_a_restarted_engine_is_moved_onto_its_cores_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each start's process tree is confined once ready: a restart (the KV-index test stops
    and starts its engine) left the new processes on every core, the proxy's included."""
    moved: list[int] = []
    monkeypatch.setattr(engine, "confine_tree", lambda pid, cpus: moved.append(pid))
    spec = engine.EngineSpec(port=1, model="m", cpus=frozenset({0}))
    process = engine.EngineProcess(spec, tmp_path / "engine.log")
    process.command = ["sleep", "30"]  # a process to confine, not vLLM
    pids = []
    try:
        for _ in range(2):
            process.start()
            pids.append(process.pid)
            process.confine()
            process.confine()  # once per start
            process.stop(grace_s=1.0)
    finally:
        process.stop(grace_s=1.0)
    assert moved == pids and len(set(pids)) == 2
