"""`tierproxy drain`, `top` and `usage`: a running proxy's admin API and its usage log."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from proxy.cli.parsing import Subparsers

# proxy.tools.usage_report.GROUPS, not imported: that would load pydantic for every command (a
# test keeps the two equal).
GROUPS = ("tenant", "tier", "model", "backend", "outcome", "key_id")


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
    from proxy.tools.usage_report import parse_since, render, summarize

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


def add_parsers(sub: Subparsers) -> None:
    """Adds drain, top and usage."""
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
