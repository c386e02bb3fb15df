"""The append-only usage log: one JSON line per finished request, rotated by size.

One thread owns the file: the event loop only puts finished lines into a bounded queue (a
full queue drops the line and counts it, it never blocks the loop). ``stop`` writes every
line queued before it, so a clean stop loses none. Rotation is ``RotatingFileHandler``'s
scheme: ``LOG`` → ``LOG.1`` → … → ``LOG.<backups>``, the oldest dropped.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from proxy.config.usage_log import UsageLogSettings

log = logging.getLogger("tierproxy")


def rotated_paths(path: Path, backups: int | None = None) -> list[Path]:
    """The log and its rotated files that exist, oldest first."""
    numbered: list[tuple[int, Path]] = []
    for candidate in path.parent.glob(path.name + ".*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit() and (backups is None or int(suffix) <= backups):
            numbered.append((int(suffix), candidate))
    ordered = [p for _, p in sorted(numbered, reverse=True)]
    return ordered + ([path] if path.exists() else [])


_STOP = object()


class UsageLogWriter:
    def __init__(self, settings: UsageLogSettings, on_drop: Callable[[], None] | None = None):
        self.settings = settings
        self.path = Path(settings.path)
        self.on_drop = on_drop
        self._queue: queue.Queue[object] = queue.Queue(settings.queue_size)
        self._thread: threading.Thread | None = None
        self._file: BinaryIO | None = None
        self._size = 0
        self.dropped = 0
        self.written = 0

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()
        self._thread = threading.Thread(target=self._run, name="tierproxy-usage-log", daemon=True)
        self._thread.start()

    def write(self, line: bytes) -> bool:
        """Queue one line (without its newline); False when it was dropped."""
        if self._thread is None:
            return self._drop()
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            return self._drop()
        return True

    def stop(self) -> None:
        """Write what is queued, then close (blocks: call it off the event loop)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(_STOP)  # the thread keeps taking lines, so this waits at most a drain
        thread.join()

    def _drop(self) -> bool:
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop()
        return False

    def _open(self) -> None:
        self._file = open(self.path, "ab")  # noqa: SIM115 - the writer thread owns and closes it
        self._size = self._file.tell()

    def _run(self) -> None:
        assert self._file is not None
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                assert isinstance(item, bytes)
                self._append(item + b"\n")
                if self._queue.empty():
                    self._file.flush()  # a burst is written in one go, a lone line at once
        finally:
            self._file.close()

    def _append(self, line: bytes) -> None:
        try:
            if self._size and self._size + len(line) > self.settings.max_bytes:
                self._rotate()
            assert self._file is not None
            self._file.write(line)
            self._size += len(line)
            self.written += 1
        except OSError as exc:
            log.error("usage log %s: %s; line dropped", self.path, exc)
            self._drop()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        backups = self.settings.backups
        for index in range(backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        if backups:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._open()
