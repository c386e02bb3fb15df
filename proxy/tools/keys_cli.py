"""The `tierproxy keys` subcommands (proxy.tools.keys does the work)."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime

from proxy.tools.keys import KeysError, add_key, key_rows, revoke_key, rotate_key, stamp, utc_now

CONFIG_ENV = "TIERPROXY_CONFIG"
RELOAD_NOTE = (
    "A running proxy applies it within about a second (it watches the file; `kill -HUP` applies"
    " it at once). In a container, mount the config's folder, not the file alone: a file"
    " bind mount keeps showing the old file after a rename."
)


def _config(args: argparse.Namespace) -> str:
    if not args.config:
        raise KeysError(f"give the config file: -c PATH (or set {CONFIG_ENV})")
    return str(args.config)


def _notes(notes: list[str]) -> None:
    for note in notes:
        print(note, file=sys.stderr)


def _show_new(tenant: str, key: str, key_id: str, expires: str) -> None:
    # The key alone on stdout (KEY=$(tierproxy keys add t)); everything else on stderr.
    print(key)
    print(
        f"new key {key_id} for tenant {tenant!r}, expires {expires}. It is shown only"
        " this once: the config keeps its sha256.",
        file=sys.stderr,
    )


def _cmd(args: argparse.Namespace) -> int:
    try:
        if args.keys_command == "list":
            return _list(args)
        path = _config(args)
        if args.keys_command == "add":
            new, notes = add_key(path, args.tenant, args.expires)
            _show_new(args.tenant, new.key, new.key_id, _when(new.expires_at))
        elif args.keys_command == "rotate":
            new, old_id, until, notes = rotate_key(
                path, args.tenant, args.keep, args.overlap, args.expires
            )
            _show_new(args.tenant, new.key, new.key_id, _when(new.expires_at))
            print(f"old key {old_id} expires at {stamp(until)}", file=sys.stderr)
        else:
            notes = revoke_key(path, args.tenant, args.key_id)
            print(f"key {args.key_id} of tenant {args.tenant!r} removed", file=sys.stderr)
    except KeysError as exc:
        print(f"tierproxy keys {args.keys_command}: {exc}", file=sys.stderr)
        return 1
    _notes(notes)
    print(RELOAD_NOTE, file=sys.stderr)
    return 0


def _when(at: datetime | None) -> str:
    return stamp(at) if isinstance(at, datetime) else "never"


def _list(args: argparse.Namespace) -> int:
    from pathlib import Path

    from proxy.config.loader import ConfigError, parse_config
    from proxy.tools.keyfile import stand_in_environ

    path = _config(args)
    try:
        text = Path(path).read_text(encoding="utf-8")
        config = parse_config(text, path, stand_in_environ(text)[0]).config
    except OSError as exc:
        raise KeysError(f"cannot read {path}: {exc.strerror}") from exc
    except ConfigError as exc:
        raise KeysError("the config does not load:\n  " + "\n  ".join(exc.problems)) from exc
    rows: list[tuple[str, ...]] = [("TENANT", "ID", "CREATED", "EXPIRES", "STATE")]
    rows += key_rows(config, args.tenant, utc_now())
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="add, rotate, revoke and list tenants' API keys")
    keys.set_defaults(func=_cmd)
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument(
        "-c",
        "--config",
        default=os.environ.get(CONFIG_ENV),
        help=f"the proxy's config file (default: ${CONFIG_ENV})",
    )
    expires = argparse.ArgumentParser(add_help=False)
    expires.add_argument(
        "--expires", help="when the new key stops working: 90d, 12h, or a date/time (UTC)"
    )

    p = ksub.add_parser("add", parents=[config, expires], help="a new key, printed once")
    p.add_argument("tenant")
    p = ksub.add_parser(
        "rotate",
        parents=[config, expires],
        help="a new key (printed once); the old one keeps working for --overlap",
    )
    p.add_argument("tenant")
    p.add_argument("--keep", metavar="OLD_KEY_ID", help="the key to retire (default: the only one)")
    p.add_argument("--overlap", default="24h", help="how long the old key still works (24h)")
    p = ksub.add_parser("revoke", parents=[config], help="remove a key now")
    p.add_argument("tenant")
    p.add_argument("key_id")
    p = ksub.add_parser("list", parents=[config], help="id, created, expires: never the key")
    p.add_argument("tenant", nargs="?")
