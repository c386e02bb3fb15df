"""`tierproxy serve --workers 2`: two processes on one port behind one owner, which replaces
a worker killed with -9 and stops both on SIGTERM; without shared_state it refuses to start."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from proxy.bench.fake_vllm import FakeVLLM
from proxy.bench.hostile.kit import RawClient
from proxy.bench.redis_server import RedisServer
from proxy.ops.process import free_port, http_ok
from tests.helpers.replicas import owner, post, replica_config
from tests.helpers.timing import polls_until


def children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


async def test_two_workers_serve_one_port_and_a_killed_one_is_replaced(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    null = FakeVLLM(model="null", usage=(4, 4))
    async with null.serve() as url:
        port = free_port()
        proc = owner(replica_config(url, redis_server.url), tmp_path, port).start()
        base = f"http://127.0.0.1:{port}"
        try:
            await asyncio.to_thread(
                proc.wait_until, lambda: http_ok(f"{base}/healthz", 2.0), 60, "/healthz"
            )
            assert proc.pid is not None
            await asyncio.to_thread(
                proc.wait_until, lambda: len(children(proc.pid or 0)) == 2, 60, "two workers"
            )
            workers = children(proc.pid)
            async with aiohttp.ClientSession() as session:
                assert {(await post(session, base)).status for _ in range(10)} == {200}
                victim = min(workers)
                os.kill(victim, signal.SIGKILL)
                await asyncio.to_thread(
                    proc.wait_until,
                    lambda: len(children(proc.pid or 0) - {victim}) == 2,
                    30,
                    "a replacement worker",
                    0.05,
                )
                await asyncio.to_thread(
                    proc.wait_until, lambda: http_ok(f"{base}/healthz", 2.0), 30, "/healthz"
                )
                # Both serve again (new connections each: the kernel spreads them).
                for _ in range(20):
                    async with aiohttp.ClientSession() as fresh:
                        assert (await post(fresh, base)).status == 200
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.proc.wait, 30)
            assert code == 0
            assert children(proc.pid) == set()
        finally:
            proc.stop()


def test_more_than_one_worker_needs_shared_state(tmp_path: Path) -> None:
    proc = owner(replica_config("http://127.0.0.1:1", None), tmp_path, free_port()).start()
    try:
        assert proc.proc is not None
        assert proc.proc.wait(timeout=60) == 1
        assert "shared_state" in (tmp_path / "owner.log").read_text()
    finally:
        proc.stop()


async def test_workers_share_the_connection_cap_so_the_port_admits_the_configured_total(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """16 idle connections against `server.max_connections: 10` over 2 workers: the port keeps
    at most 10 open, however the kernel spreads them (each worker took all 10 before: 16 open).
    The owner logs the totals and each worker's share at start."""
    null = FakeVLLM(model="null", usage=(4, 4))
    async with null.serve() as url:
        port = free_port()
        config = replica_config(url, redis_server.url)
        config["server"] = {"max_connections": 10, "header_timeout_s": 30}
        proc = owner(config, tmp_path, port).start()
        clients: list[RawClient] = []
        try:
            await asyncio.to_thread(
                proc.wait_until, lambda: len(children(proc.pid or 0)) == 2, 60, "two workers"
            )
            log = tmp_path / "owner.log"
            await asyncio.to_thread(
                proc.wait_until,
                lambda: log.read_text().count("tierproxy listening on") == 2,
                60,
                "both workers listening",
            )
            await asyncio.sleep(0.5)  # the probe's connection closed
            for _ in range(16):
                clients.append(await RawClient.connect("127.0.0.1", port))
            # The 6 past the cap closed, however late a busy host's workers get to them: counted
            # (16 kept open fail the wait), not "closed within 2 s", which a stall could miss.
            closing = [asyncio.create_task(c.closed_by_peer(60.0)) for c in clients]
            try:
                await polls_until(
                    lambda: sum(t.done() and t.result() for t in closing) >= 6,
                    600,
                    "the 6 connections past the cap closed",
                )
            finally:
                for task in closing:
                    task.cancel()
                await asyncio.gather(*closing, return_exceptions=True)
            text = log.read_text()
            assert "server.max_connections: 10 in all, 5 per worker" in text
            assert text.count(": max_connections 5,") == 2  # each worker's own line
        finally:
            for client in clients:
                client.close()
            proc.stop()
