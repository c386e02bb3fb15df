"""The `tierproxy` command."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.ops.engine import EngineSpec

EXAMPLE_CONFIG = "configs/example.yaml"
# proxy.ops.usage_report.GROUPS, not imported: that would load pydantic for every command (a
# test keeps the two equal).
GROUPS = ("tenant", "tier", "model", "backend", "outcome", "key_id")
REFERENCE_POINTER = (
    "Every field, its type, default and meaning: docs/configuration.md"
    " (or `tierproxy config-reference`)"
)
DEMO_KEYS = {"high": "demo-high-key", "normal": "demo-normal-key", "low": "demo-low-key"}


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from proxy.ops.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir))
    return 0


def _cmd_hash_key(args: argparse.Namespace) -> int:
    from proxy.config.tenants import hash_key

    key = sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("tierproxy hash-key: read no key on standard input", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from proxy.config.loader import ConfigError, load_config, summarize

    try:
        loaded = load_config(args.config)
    except ConfigError as exc:
        print(f"{exc.source}: {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        print(REFERENCE_POINTER, file=sys.stderr)
        return 1
    from proxy.ops.keys import expiry_warnings, utc_now

    print(summarize(loaded))
    for warning in expiry_warnings(loaded.config, utc_now(), args.expiring_days):
        print(f"  warning: {warning}")
    print(REFERENCE_POINTER)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from proxy.config.loader import ConfigError
    from proxy.ops.worker_share import WorkerShare
    from proxy.server.app import serve

    if args.workers < 1:
        print(f"tierproxy serve: --workers must be at least 1, not {args.workers}", file=sys.stderr)
        return 2
    try:
        if args.workers > 1:
            from proxy.ops.workers import serve_workers

            return serve_workers(args.config, args.workers, args.host, args.port)
        share = WorkerShare.parse(args.worker_share) if args.worker_share else None
        serve(args.config, host=args.host, port=args.port, reuse_port=args.reuse_port, share=share)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{exc.source}: {problem}", file=sys.stderr)
        return 1
    return 0


def _install_stop_handlers() -> None:
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """`tierproxy engine`'s vLLM: a CPU build confined to its own cores like `up`'s."""
    from proxy.ops.engine import POOLING_ARGS, cpu_confinement, free_port, local_engine

    extra = [a for a in args.vllm_args if a != "--"]
    block_size, kv_port = args.block_size, args.kv_events_port
    if args.config is not None:  # the config's kv_cache decides, unless the port is given
        from proxy.config.loader import load_config
        from proxy.ops.engine import kv_events_wanted

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
    from proxy.ops.engine import EngineProcess, confinement_note

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
    from proxy.ops.engine import (
        EngineProcess,
        ensure_model,
        free_port,
        kv_events_wanted,
        local_engine,
    )
    from proxy.server.app import serve

    os.environ.setdefault("TIERPROXY_TICKET_SECRET", secrets.token_urlsafe(32))
    loaded = load_config(args.config)
    model, served = ensure_model(args.model)
    log_dir = Path(".tierproxy/logs")
    engines = []
    block_size = kv_events_wanted(loaded.config)  # one KV-event port per engine when wanted
    for index, backend in enumerate(loaded.config.backends[: args.engines]):
        port = int(backend.url.rsplit(":", 1)[1])
        spec = local_engine(
            model=model,
            served_name=served,
            port=port,
            max_num_seqs=args.max_num_seqs,
            index=index if args.engines > 1 else None,  # the last core stays for the proxy
            # Requests that reach vLLM without the proxy's ticket run as the lowest tier.
            env={"TIERPROXY_UNTICKETED_PRIORITY": str(loaded.config.lowest_priority)},
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


def _cmd_drain(args: argparse.Namespace) -> int:
    """Ask a running proxy to stop (or resume) new work to one backend."""
    import json
    import urllib.error
    import urllib.request

    key = os.environ.get("TIERPROXY_ADMIN_KEY", "")
    if not key:
        print(
            "tierproxy drain: set TIERPROXY_ADMIN_KEY to one of the config's admin_keys",
            file=sys.stderr,
        )
        return 1
    req = urllib.request.Request(
        args.proxy.rstrip("/") + "/admin/backends/drain",
        data=json.dumps({"url": args.backend, "drain": not args.undo}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            print(resp.read().decode())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"tierproxy drain: {exc.code} {exc.read().decode()}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"tierproxy drain: cannot reach {args.proxy}: {exc}", file=sys.stderr)
    return 1


def _cmd_top(args: argparse.Namespace) -> int:
    from proxy.ops.live.top import run_top

    if not args.admin_key:
        print("tierproxy top: give --admin-key or set TIERPROXY_ADMIN_KEY", file=sys.stderr)
        return 1
    return run_top(args.proxy, args.admin_key, args.interval)


def _cmd_usage(args: argparse.Namespace) -> int:
    from proxy.ops.usage_report import parse_since, render, summarize

    try:
        since = parse_since(args.since, time.time()) if args.since else None
    except ValueError as exc:
        print(f"tierproxy usage: {exc}", file=sys.stderr)
        return 2
    report = summarize(Path(args.log), args.by, since)
    if not report.files:
        print(f"tierproxy usage: no log at {args.log}", file=sys.stderr)
        return 1
    print(render(report, args.by, cost=args.cost))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierproxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the proxy")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--host", help="override listen.host")
    p.add_argument("--port", type=int, help="override listen.port")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes serving one port (SO_REUSEPORT); more than 1 needs shared_state;"
        " per-process bounds (max_connections, max_held_bytes, max_queue, max_cheap_inflight)"
        " are divided among them",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # a worker
    p.add_argument("--worker-share", help=argparse.SUPPRESS)  # SLOT/N: a worker's bounds
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("check", help="validate a config; print a summary or every error")
    p.add_argument("-c", "--config", required=True)
    p.add_argument(
        "--expiring-days", type=float, default=14.0, help="warn about keys expiring this soon"
    )
    p.set_defaults(func=_cmd_check)

    from proxy.ops.keys_cli import add_parser as add_keys_parser

    add_keys_parser(sub)

    # Listed for --help; `main` hands the rest to proxy.config.reference's own parser.
    sub.add_parser(
        "config-reference",
        help="print the configuration reference (-o docs/configuration.md; --check: up to date?)",
    )

    p = sub.add_parser("hash-key", help="print the sha256 form of a key read from stdin")
    p.set_defaults(func=_cmd_hash_key)

    p = sub.add_parser("tiny-model", help="write a tiny random Llama model for CPU vLLM")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_tiny_model)

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

    p = sub.add_parser("drain", help="stop (or with --undo resume) new work to a backend")
    p.add_argument(
        "--proxy",
        default="http://127.0.0.1:8001",
        help="the proxy's admin listener (admin_listen; without one, its listen address)",
    )
    p.add_argument("--backend", required=True, help="the backend's URL as in the config")
    p.add_argument("--undo", action="store_true", help="put the backend back in service")
    p.set_defaults(func=_cmd_drain)

    p = sub.add_parser("top", help="live view of tiers, tenants and backends (q quits)")
    p.add_argument(
        "--proxy",
        default="http://127.0.0.1:8001",
        help="the proxy's admin listener (admin_listen; without one, its listen address)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("TIERPROXY_ADMIN_KEY", ""),
        help="one of the config's admin_keys (default: $TIERPROXY_ADMIN_KEY)",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.set_defaults(func=_cmd_top)

    p = sub.add_parser("usage", help="totals of a usage log (and its rotated files)")
    p.add_argument("log", help="the usage_log.path of the config")
    p.add_argument("--by", choices=GROUPS, default="tenant")
    p.add_argument("--since", help="30m, 2h, 7d or an ISO time (default: everything)")
    p.add_argument("--cost", action="store_true", help="add cached tokens and cost (pricing:)")
    p.set_defaults(func=_cmd_usage)

    # Listed for --help; `main` hands every argument after "bench" to the bench's parser.
    sub.add_parser("bench", help="mixed-tenant load generator and report (tierproxy bench -h)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # Every option belongs to the bench's own parser (argparse's REMAINDER drops options).
        from proxy.bench.cli import main as bench_main

        return int(bench_main(argv[1:]))
    if argv[:1] == ["config-reference"]:
        from proxy.config.reference import main as reference_main

        return reference_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
