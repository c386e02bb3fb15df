"""The `tierproxy` command: one module per group of commands (as ``proxy.bench`` is), each
adding its own subparsers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy.cli import admin, engines, serving
from proxy.signals import defer_reloads


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierproxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serving.add_parsers(sub)

    from proxy.tools.keys_cli import add_parser as add_keys_parser

    add_keys_parser(sub)

    # Listed for --help; `main` hands the rest to proxy.config.reference's own parser.
    sub.add_parser(
        "config-reference",
        help="print the configuration reference (-o docs/configuration.md; --check: up to date?)",
    )
    serving.add_tool_parsers(sub)
    engines.add_parsers(sub)
    admin.add_parsers(sub)

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
    if argv[:1] == ["serve"]:
        defer_reloads()  # before the seconds of imports and loading that precede the watcher
    args = build_parser().parse_args(argv)
    return int(args.func(args))
