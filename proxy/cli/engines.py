"""`tierproxy engine` and `up`: local vLLM engines (with the plugin), alone or under the proxy."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.cli.parsing import Subparsers

if TYPE_CHECKING:
    from proxy.tools.engine import EngineSpec

EXAMPLE_CONFIG = "configs/example.yaml"
DEMO_KEYS = {"high": "demo-high-key", "normal": "demo-normal-key", "low": "demo-low-key"}


def _install_stop_handlers() -> None:
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """`tierproxy engine`'s vLLM: a CPU build confined to its own cores like `up`'s."""
    from proxy.tools.engine import POOLING_ARGS, cpu_confinement, free_port, local_engine

    extra = [a for a in args.vllm_args if a != "--"]
    block_size, kv_port = args.block_size, args.kv_events_port
    if args.config is not None:  # the config's kv_cache decides, unless the port is given
        from proxy.config.loader import load_config
        from proxy.tools.engine import kv_events_wanted

        wanted = kv_events_wanted(load_config(args.config).config)
        if wanted is not None:
            block_size, kv_port = wanted, kv_port if kv_port is not None else free_port()
    replay_port = free_port() if kv_port is not None else None
    return local_engine(
        model=args.model,
        port=args.port,
        host=args.host,
        max_num_seqs=args.max_num_seqs,
        plugin=not args.no_plugin,
        extra_args=[*POOLING_ARGS, *extra] if args.pooling else extra,
        cpus=cpu_confinement(),
        kv_events_port=kv_port,
        kv_replay_port=replay_port,
        block_size=block_size,
    )


def _cmd_engine(args: argparse.Namespace) -> int:
    from proxy.tools.engine import EngineProcess, confinement_note

    spec = engine_spec(args)
    engine = EngineProcess(spec)
    _install_stop_handlers()
    print(confinement_note(spec.cpus), flush=True)
    print("starting:", " ".join(spec.command()), flush=True)
    try:
        engine.start().wait_ready(args.ready_timeout)
        print(f"vLLM ready on {spec.url} (pid {engine.pid}); Ctrl-C stops it", flush=True)
        while engine.alive():
            time.sleep(0.5)
        print("vLLM exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        engine.stop()


def _cmd_up(args: argparse.Namespace) -> int:
    """The embedded default: local CPU engine(s) plus the proxy on configs/example.yaml."""
    from proxy.config.loader import load_config
    from proxy.server.app import serve
    from proxy.tools.engine import (
        EngineProcess,
        ensure_model,
        free_port,
        kv_events_wanted,
        local_engine,
    )
    from proxy.tools.tiny_adapters import ensure_tiny_adapters, lora_engine_settings

    os.environ.setdefault("TIERPROXY_TICKET_SECRET", secrets.token_urlsafe(32))
    loaded = load_config(args.config)
    model, served = ensure_model(args.model)
    log_dir = Path(".tierproxy/logs")
    engines = []
    block_size = kv_events_wanted(loaded.config)  # one KV-event port per engine when wanted
    adapters = loaded.config.adapters
    ensure_tiny_adapters([a.path for a in adapters.values()], model)
    for index, backend in enumerate(loaded.config.backends[: args.engines]):
        port = int(backend.url.rsplit(":", 1)[1])
        lora_args, lora_env = lora_engine_settings(
            backend.max_loras, backend.load_adapters, bool(adapters)
        )
        spec = local_engine(
            model=model,
            served_name=served,
            port=port,
            max_num_seqs=args.max_num_seqs,
            index=index if args.engines > 1 else None,  # the last core stays for the proxy
            # Requests that reach vLLM without the proxy's ticket run as the lowest tier.
            env={"TIERPROXY_UNTICKETED_PRIORITY": str(loaded.config.lowest_priority), **lora_env},
            extra_args=lora_args,  # LoRA on for `adapters:` (docs/adapters.md)
            kv_events_port=free_port() if block_size is not None else None,
            kv_replay_port=free_port() if block_size is not None else None,
            block_size=block_size or 32,
        )
        engines.append(EngineProcess(spec, log_dir / f"vllm-{port}.log"))
    _install_stop_handlers()
    try:
        for engine in engines:
            print(f"starting vLLM on {engine.spec.url} (log: {engine.log_path})", flush=True)
            engine.start()
        for engine in engines:
            engine.wait_ready(args.ready_timeout)
        cfg = loaded.config
        base = f"http://{cfg.listen.host}:{cfg.listen.port}"
        admin = cfg.admin_listen
        metrics = f"http://{admin.host}:{admin.port}" if admin is not None else base
        name = served or model
        print(_snippet(base, name, metrics), flush=True)
        serve(args.config)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for engine in engines:
            engine.stop()


def _snippet(base: str, model: str, metrics: str) -> str:
    return f"""
tierproxy is up on {base}  (Ctrl-C stops the proxy and the engines)

  curl -s {base}/v1/chat/completions \\
    -H 'Authorization: Bearer {DEMO_KEYS["high"]}' -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "max_tokens": 16,
         "messages": [{{"role": "user", "content": "hello"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{DEMO_KEYS["high"]}")
  print(client.chat.completions.create(model="{model}", max_tokens=16,
        messages=[{{"role": "user", "content": "hello"}}]).choices[0].message.content)

Demo keys by tier: {", ".join(f"{t}={k}" for t, k in DEMO_KEYS.items())}
Metrics: {metrics}/metrics
"""


def add_parsers(sub: Subparsers) -> None:
    """Adds engine and up."""
    p = sub.add_parser("engine", help="run a stock vLLM OpenAI server with the plugin wired in")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", help="model path or name (default: the tiny local model)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--no-plugin", action="store_true", help="stock vLLM without the plugin")
    p.add_argument(
        "--pooling",
        action="store_true",
        help="serve the model for embeddings, pooling, score and rerank (vLLM --runner pooling)",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument(
        "-c", "--config", help="a proxy config: KV events on when its kv_cache is (kv_aware)"
    )
    p.add_argument("--kv-events-port", type=int, help="publish KV events on this ZMQ port")
    p.add_argument("--block-size", type=int, default=32, help="with KV events: vLLM's block size")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then extra vLLM arguments")
    p.set_defaults(func=_cmd_engine)

    p = sub.add_parser("up", help="local engine(s) plus the proxy on the example config")
    p.add_argument("-c", "--config", default=EXAMPLE_CONFIG)
    p.add_argument(
        "--engines", type=int, default=1, help="how many of the config's backends to start"
    )
    p.add_argument("--model", help="model path or name (default: the tiny local model)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.set_defaults(func=_cmd_up)
