"""``tierproxy top``: ``/admin/status`` in a terminal, refreshed every second; q or Ctrl-C quits.
With LoRA adapters configured, an adapters panel from the proxy's ``/metrics``.

Drawn with rich's ``Live`` on the alternate screen. Keys are read in cbreak mode (Ctrl-C still
interrupts), and the wait for a key is the refresh interval.
"""

from __future__ import annotations

import contextlib
import select
import sys
import termios
import time
import tty
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import orjson
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from proxy.api.quota_counters import COUNTERS
from proxy.ops.live.adapters_panel import adapter_rows, adapter_table

FETCH_TIMEOUT_S = 2.0
_STATE_STYLE = {
    "healthy": "green",
    "ramping": "yellow",
    "draining": "cyan",
    "ejected": "red",
    "down": "bold red",
}


class StatusError(Exception):
    pass


def fetch_status(base_url: str, admin_key: str, timeout_s: float = FETCH_TIMEOUT_S) -> Any:
    body = _fetch(base_url, "/admin/status", admin_key, timeout_s)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise StatusError(f"cannot read {base_url}/admin/status: {exc}") from None


def fetch_metrics(base_url: str, admin_key: str, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """The proxy's /metrics text (the admin key is its bearer token where it asks for one)."""
    return _fetch(base_url, "/metrics", admin_key, timeout_s).decode(errors="replace")


def _fetch(base_url: str, path: str, admin_key: str, timeout_s: float) -> bytes:
    request = urllib.request.Request(
        base_url.rstrip("/") + path,
        headers={"Authorization": f"Bearer {admin_key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body: bytes = resp.read()
            return body
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise StatusError(f"{exc.code} from {base_url}{path}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StatusError(f"cannot read {base_url}{path}: {exc}") from None


def _num(value: float | None, fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value)


def render(
    status: dict[str, Any] | None,
    source: str,
    error: str | None = None,
    metrics_text: str | None = None,
) -> RenderableType:
    """The screen; ``metrics_text`` (the proxy's /metrics) adds the adapters panel when it
    names any adapter."""
    now = datetime.now().strftime("%H:%M:%S")
    window = f"window {status['window_s']:.0f}s" if status else "no data"
    head = Text.assemble(
        ("tierproxy top", "bold"), f"  {source}  {now}  {window}  ", ("q quits", "dim")
    )
    parts: list[RenderableType] = [head]
    if error:
        parts.append(Text(error, style="bold red"))
    if status:
        parts += [_tiers(status["tiers"]), _tenants(status), _backends(status["backends"])]
    rows = adapter_rows(metrics_text) if metrics_text else []
    if rows:
        parts.append(adapter_table(rows))
    return Group(*parts)


def _tiers(tiers: list[dict[str, Any]]) -> Table:
    t = Table(title="tiers", title_justify="left", expand=True)
    for col in ("tier", "prio", "depth", "limit wait", "running", "wait p99 s", "tok/s", "done"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    t.add_column("refused (last window)")
    for tier in tiers:
        refused = " ".join(f"{k}={v}" for k, v in tier["refused"].items()) or "-"
        t.add_row(
            tier["name"],
            str(tier["priority"]),
            f"{tier['depth']}/{tier['max_queue']}",
            str(tier["limit_waiting"]),
            str(tier["running"]),
            _num(tier["wait_p99_s"], "{:.3f}"),
            _num(tier["tokens_per_s"], "{:.1f}"),
            str(tier["finished"]),
            refused,
        )
    return t


def _tenants(status: dict[str, Any]) -> Table:
    rows, active = status["tenants"], status["tenants_active"]
    title = f"tenants ({active} active" + (f", {len(rows)} shown)" if active > len(rows) else ")")
    t = Table(title=title, title_justify="left", expand=True)
    for col in ("tenant", "tier", "queued", "running", "tok/s", "share", "fair share"):
        t.add_column(col, justify="left" if col in ("tenant", "tier") else "right")
    t.add_column("limits hit (last window)")
    t.add_column("quota used")
    for row in rows:
        hit = " ".join(f"{k}={v}" for k, v in row["limits_hit"].items()) or "-"
        t.add_row(
            row["name"],
            row["tier"],
            str(row["queued"]),
            str(row["running"]),
            f"{row['tokens_per_s']:.1f}",
            _num(row["share"], "{:.0%}"),
            _num(row["fair_share"], "{:.0%}"),
            hit,
            quota_text(row.get("quota") or {}),
        )
    return t


def quota_text(quota: dict[str, Any]) -> Text:
    """``tok/d 12% $/mo 97%``: each quota's share used this period, red from 90 %."""
    if not quota:
        return Text("-")
    out = Text()
    for counter, q in quota.items():
        share = q["used"] / q["limit"] if q["limit"] else 0.0
        style = "bold red" if share >= 0.9 else ("yellow" if share >= 0.75 else "")
        kind = COUNTERS.get(counter)  # a counter this version does not know: its name
        out.append(f"{kind.label if kind else counter} ")
        out.append(f"{share:.0%}", style=style)
        out.append(" ")
    out.rstrip()
    return out


def _backends(backends: list[dict[str, Any]]) -> Table:
    t = Table(title="backends", title_justify="left", expand=True)
    t.add_column("backend")
    t.add_column("state")
    for col in ("room", "in-flight", "vLLM running", "vLLM waiting", "KV used", "scraped s ago"):
        t.add_column(col, justify="right")
    for b in backends:
        t.add_row(
            b["name"],
            Text(b["state"], style=_STATE_STYLE.get(b["state"], "")),
            f"{b['room']:g}",
            f"{b['inflight']}/{b.get('capacity', b['max_inflight']) or 0:g}",
            _num(b["vllm_running"]),
            _num(b["vllm_waiting"]),
            _num(b["vllm_kv_usage"], "{:.1%}"),
            _num(b["metrics_age_s"], "{:.1f}"),
        )
    return t


class KeyReader:
    """Single keys from a terminal without Enter; on anything else, waiting only."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None

    @contextlib.contextmanager
    def cbreak(self) -> Iterator[KeyReader]:
        if self.fd is None:
            yield self
            return
        saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        try:
            yield self
        finally:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)

    def quit_within(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s``; True once q is pressed."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.fd is None:
                time.sleep(left)
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and sys.stdin.read(1).lower() == "q":
                return True
        return False


def run_top(base_url: str, admin_key: str, interval_s: float = 1.0) -> int:
    console = Console()
    keys = KeyReader()
    try:
        with (
            keys.cbreak(),
            Live(console=console, screen=True, auto_refresh=False) as live,
        ):
            while True:
                status, error, metrics = None, None, None
                try:
                    status = fetch_status(base_url, admin_key)
                    metrics = fetch_metrics(base_url, admin_key)
                except StatusError as exc:
                    error = str(exc)
                live.update(render(status, base_url, error, metrics), refresh=True)
                if keys.quit_within(interval_s):
                    return 0
    except KeyboardInterrupt:
        return 0
