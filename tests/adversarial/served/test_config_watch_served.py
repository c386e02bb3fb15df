"""The promise "an edited config takes effect (or SIGHUP applies it)" against `tierproxy serve`
on its default loop.

Found by a red team (issue 31), each fixed since, the faults as they were:

F5: SIGHUP has its default action, killing the process, until the config watcher installs its
handler once the app has started: ~3.4 s after the spawn on this machine (imports, config load,
the tokenizer's preload where ``kv_cache`` names one). A reload asked for while the proxy
(re)starts (`systemctl reload` just after a restart, a deploy tool that writes the file and
signals) ends the proxy with no line in its log: every tenant refused until something restarts
it. SIGHUPs sent from 1.0, 1.6, 2.2 and 3.0 s after the spawn each killed it (exit -1); at 4.5 s
it reloaded.

F6: the watcher reads whatever the path holds, whole, with ``Path.read_bytes`` on a worker
thread. Renamed over by a named pipe (no writer), the read never returns: the watcher is stuck
for good, a later file revoking a key never applies (the key answered 200 for all 10 s of the
probe) and SIGTERM no longer stops the proxy (killed after the 5 s grace: ``asyncio.run`` waits
for the thread). Renamed over by a 200 MB file (a log moved to the wrong name), the proxy's
peak RSS went from 72 MB to 672 MB (read twice, then decoded) before YAML refused it: a file of
a few GB is the OOM killer's, with every tenant's requests.

F7: YAML's ``.inf`` (the usual way to write "unlimited") passes every ``gt=0`` limit (pydantic
allows infinities): a reload with a tenant's ``requests_per_minute: .inf`` or
``tokens_per_minute: .inf`` is applied ("config reloaded"), then each of that tenant's requests
is a ``500 internal_error`` ("this is a bug, not your input": OverflowError in
``ratelimit_headers``). So is ``tokens_per_minute: 1e300`` and ``quota.tokens_per_day: .inf`` for
requests without ``max_tokens``. Either the file is refused (and says why) or the tenant served.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from proxy.bench.hostile.kit import exchange, json_request
from proxy.bench.hostile.served import NullBackend, ServedProxy, served_config
from proxy.bench.inproc import KEYS
from proxy.ops.process import ManagedProcess, http_ok

BODY = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
START_S = 60.0  # bounds a failure only


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (bit 0 of SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & 1 << (signal.SIGHUP - 1))


async def test_a_sighup_while_the_proxy_starts_never_stops_it(
    backend: NullBackend, tmp_path: Path
) -> None:
    proxy = ServedProxy(served_config(backend.url), tmp_path)
    ManagedProcess.start(proxy.process)  # spawned, not waited for
    try:
        # A signal before the interpreter runs any of tierproxy is fatal whatever it does;
        # from `serve`'s first line on it must not be (it was, until the watcher was up).
        deadline = time.monotonic() + START_S
        while not _catches_sighup(proxy.pid) and proxy.alive():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        hups = 0
        while not await asyncio.to_thread(http_ok, f"{proxy.url}/healthz", timeout_s=0.5):
            if not proxy.alive() or time.monotonic() > deadline:
                break
            os.kill(proxy.pid, signal.SIGHUP)  # reload, please (the file is as it was)
            hups += 1
            await asyncio.sleep(0.2)
        # Before: dead at the first SIGHUP (exit -1, SIGHUP's default action), its log empty.
        assert proxy.alive(), (hups, proxy.process.proc and proxy.process.proc.returncode)
        assert hups >= 1  # it was signalled while starting
        req = json_request("/v1/chat/completions", BODY, KEYS["low"])
        assert (await exchange(proxy.host, proxy.port, req, timeout_s=20)).status == 200
        assert "SIGHUP: reloading" in proxy.log_text()  # the reload asked for is done
    finally:
        proxy.stop()


def _rename_in(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` makes the new file beside ``path``; then it is renamed over it."""
    tmp = path.with_name(path.name + ".new")
    write(tmp)
    os.replace(tmp, path)


def _sparse(size: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with path.open("wb") as f:
            f.truncate(size)

    return write


async def _status(proxy: ServedProxy) -> int:
    req = json_request("/v1/chat/completions", BODY, KEYS["low"])
    return (await exchange(proxy.host, proxy.port, req, timeout_s=20)).status


async def _until_refused(proxy: ServedProxy, wait_s: float = 10.0) -> int:
    deadline = time.monotonic() + wait_s
    while (status := await _status(proxy)) == 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return status


async def test_a_named_pipe_at_the_config_path_never_stops_later_reloads(
    backend: NullBackend, tmp_path: Path
) -> None:
    config = served_config(backend.url)
    proxy = ServedProxy(config, tmp_path).start()
    try:
        assert await _status(proxy) == 200
        _rename_in(proxy.config_path, os.mkfifo)  # no writer: opening it blocks
        await asyncio.sleep(2.5)  # two polls of the watcher (1 s) and a debounce
        revoked = copy.deepcopy(config)
        revoked["tenants"] = [t for t in revoked["tenants"] if t["name"] != "tenant-low"]
        _rename_in(proxy.config_path, lambda tmp: tmp.write_text(yaml.safe_dump(revoked)))
        # Now: 200 throughout, the watcher's thread blocked in open() of the pipe.
        assert await _until_refused(proxy) == 401
    finally:
        proxy.stop()


async def test_a_huge_file_at_the_config_path_is_refused_without_reading_it(
    backend: NullBackend, tmp_path: Path
) -> None:
    proxy = ServedProxy(served_config(backend.url), tmp_path).start()
    try:
        size = 200 * 2**20  # sparse: no disk, all of it read back as NUL bytes
        peak_before = proxy.rss_bytes("VmHWM")
        mark = proxy.mark()
        _rename_in(proxy.config_path, _sparse(size))
        deadline = time.monotonic() + 30
        while not proxy.count(r"config reload failed", mark) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert proxy.count(r"config reload failed", mark) == 1  # refused, and said why
        assert await _status(proxy) == 200  # the old config serves
        # Now: +600 MB of peak RSS for the 200 MB file. A config of 10,000 tenants is ~3 MB.
        grown = proxy.rss_bytes("VmHWM") - peak_before
        assert grown < size // 2, f"peak RSS +{grown >> 20} MB for a {size >> 20} MB file"
    finally:
        proxy.stop()


async def test_an_infinite_tenant_limit_is_refused_or_served(
    backend: NullBackend, tmp_path: Path
) -> None:
    config = served_config(backend.url)
    proxy = ServedProxy(config, tmp_path).start()
    try:
        infinite = copy.deepcopy(config)
        low = next(t for t in infinite["tenants"] if t["name"] == "tenant-low")
        low["requests_per_minute"] = float("inf")  # written `.inf` by yaml.safe_dump
        mark = proxy.mark()
        _rename_in(proxy.config_path, lambda tmp: tmp.write_text(yaml.safe_dump(infinite)))
        deadline = time.monotonic() + 15
        done = r"config reloaded|config reload failed"
        while not proxy.count(done, mark) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert proxy.count(done, mark) == 1
        # Before: reloaded, then 500 internal_error for each of the tenant's requests.
        assert proxy.count(r"config reload failed", mark) == 1  # refused: says why
        assert [await _status(proxy) for _ in range(3)] == [200] * 3
        assert proxy.count(r"unhandled", mark) == 0
    finally:
        proxy.stop()
