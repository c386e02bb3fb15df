"""`tierproxy serve`, `check`, `hash-key`, `tiny-model` and `tiny-adapters`: run the proxy, check
its config, make the test model and its adapters."""

from __future__ import annotations

import argparse
import sys

from proxy.cli.parsing import REFERENCE_POINTER, Subparsers


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from proxy.tools.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir))
    return 0


def _cmd_tiny_adapters(args: argparse.Namespace) -> int:
    from proxy.tools.tiny_adapters import make_tiny_adapters

    for name, path in make_tiny_adapters(args.dir, args.model).items():
        print(f"{name}={path}")
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
    from proxy.tools.keys import expiry_warnings, utc_now

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


def add_parsers(sub: Subparsers) -> None:
    """Adds serve and check."""
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


def add_tool_parsers(sub: Subparsers) -> None:
    """Adds hash-key and tiny-model (after keys and config-reference in --help, as before)."""
    p = sub.add_parser("hash-key", help="print the sha256 form of a key read from stdin")
    p.set_defaults(func=_cmd_hash_key)

    p = sub.add_parser("tiny-model", help="write a tiny random Llama model for CPU vLLM")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_tiny_model)

    p = sub.add_parser(
        "tiny-adapters", help="write random rank-8 LoRA adapters for the tiny model (no download)"
    )
    p.add_argument("dir", help="one adapter per name is written to DIR/NAME")
    p.add_argument("--model", default=".tierproxy/tiny-model", help="the base model's directory")
    p.set_defaults(func=_cmd_tiny_adapters)
