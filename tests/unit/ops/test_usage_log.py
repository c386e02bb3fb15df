"""The usage log's writer (rotation, bounded queue, nothing lost on a clean stop) and the
``tierproxy usage`` report over it and its rotated files."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson
import pytest

from proxy.cli import main
from proxy.config.usage_log import UsageLogSettings
from proxy.ops.usage_log import UsageLogWriter, rotated_paths
from proxy.tools.usage_report import parse_since, summarize


def _line(i: int, tenant: str = "a", ts: float = 1000.0, **extra: object) -> bytes:
    rec = {
        "ts": ts + i,
        "tenant": tenant,
        "tier": "high",
        "model": "tiny",
        "outcome": "ok",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "queue_s": 0.5,
        "engine_s": 1.0,
        "seq": i,
        **extra,
    }
    return orjson.dumps(rec)


def test_rotates_by_size_and_keeps_every_line_on_stop(tmp_path: Path) -> None:
    log = tmp_path / "usage" / "usage.jsonl"  # the directory is made at start
    writer = UsageLogWriter(UsageLogSettings(path=str(log), max_bytes=2000, backups=3))
    writer.start()
    lines = [_line(i) for i in range(60)]  # ~9 KB: more than the live file and 3 backups hold
    for line in lines:
        assert writer.write(line)
    writer.stop()
    files = rotated_paths(log)
    assert [p.name for p in files] == [f"usage.jsonl.{i}" for i in (3, 2, 1)] + ["usage.jsonl"]
    kept = [orjson.loads(x)["seq"] for p in files for x in p.read_bytes().splitlines()]
    # The newest lines, in order, none torn; the oldest rotated away.
    assert kept == list(range(60 - len(kept), 60)) and len(kept) > 30
    assert all(p.stat().st_size <= 2000 for p in files)
    assert writer.written == 60 and writer.dropped == 0


def test_without_backups_the_file_starts_over(tmp_path: Path) -> None:
    log = tmp_path / "u.jsonl"
    writer = UsageLogWriter(UsageLogSettings(path=str(log), max_bytes=500, backups=0))
    writer.start()
    for i in range(20):
        writer.write(_line(i))
    writer.stop()
    assert rotated_paths(log) == [log]
    assert orjson.loads(log.read_bytes().splitlines()[-1])["seq"] == 19


def test_a_full_queue_drops_and_counts_instead_of_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropped: list[int] = []
    writer = UsageLogWriter(
        UsageLogSettings(path=str(tmp_path / "u.jsonl"), queue_size=2),
        on_drop=lambda: dropped.append(1),
    )
    disk_free = threading.Event()  # a stalled disk: the writer thread waits on its first line
    original = writer._append

    def slow_append(line: bytes) -> None:
        disk_free.wait(10)
        original(line)

    monkeypatch.setattr(writer, "_append", slow_append)
    assert not writer.write(_line(0))  # not started: dropped
    writer.start()
    results = [writer.write(_line(i)) for i in range(1, 10)]
    # One line in the thread's hands at most, two queued; the rest refused at once.
    assert results.count(True) <= 3 and results[:2] == [True, True]
    disk_free.set()
    writer.stop()
    assert len(dropped) == writer.dropped == 1 + results.count(False)
    assert writer.written == results.count(True)


def test_usage_report_reads_rotated_files_and_filters_by_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "u.jsonl"
    (tmp_path / "u.jsonl.2").write_bytes(_line(0, "a", ts=100) + b"\n")
    (tmp_path / "u.jsonl.1").write_bytes(_line(0, "b", ts=200) + b"\n" + _line(1, "a", ts=200))
    log.write_bytes(_line(0, "b", ts=300) + b'\n{"torn')
    (tmp_path / "u.jsonl.old").write_bytes(_line(0, "zzz"))  # not one of the log's files

    report = summarize(log, "tenant")
    assert {k: t.requests for k, t in report.totals.items()} == {"a": 2, "b": 2}
    assert report.totals["a"].prompt_tokens == 20 and report.totals["b"].engine_s == 2.0
    assert report.unreadable == 1
    since = summarize(log, "tenant", since=250)
    assert {k: t.requests for k, t in since.totals.items()} == {"b": 1}

    assert main(["usage", str(log), "--by", "tier"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["tier", "requests", "ok"]
    assert out[1].split()[:5] == ["high", "4", "4", "40", "20"]
    assert out[-2].split()[0] == "total" and "1 unreadable" in out[-1]
    assert main(["usage", str(tmp_path / "missing.jsonl")]) == 1
    assert main(["usage", str(log), "--since", "yesterday"]) == 2


def test_parse_since() -> None:
    assert parse_since("30m", 10_000.0) == 10_000 - 1800
    assert parse_since("2d", 1e6) == 1e6 - 2 * 86400
    assert parse_since("2026-01-01T00:00:00+00:00", 0) == 1767225600
    with pytest.raises(ValueError):
        parse_since("soon", 0)
