"""Rewriting the config file safely for `tierproxy keys`: one editor at a time (a lock file
beside it), the new text validated by the proxy's own loader and checked to mean exactly the
intended change, written to a temporary file in the same folder, fsynced and renamed over (a
running proxy's watcher, and a crash, see the old file or the new one, never half of one)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import secrets
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from proxy.config.loader import ConfigError, parse_config
from proxy.config.schema import LoadedConfig
from proxy.config.yaml_load import safe_load


class KeyFileError(Exception):
    """The edit was refused; the file is as it was."""


def _env_names(data: Any) -> set[str]:
    """The variables the file's env keys name (tenants' and admin keys)."""
    specs: list[Any] = []
    if isinstance(data, dict):
        for tenant in data.get("tenants") or []:
            if isinstance(tenant, dict) and isinstance(tenant.get("keys"), list):
                specs += tenant["keys"]
        if isinstance(data.get("admin_keys"), list):
            specs += data["admin_keys"]
    return {s["env"] for s in specs if isinstance(s, dict) and isinstance(s.get("env"), str)}


def stand_in_environ(text: str) -> tuple[dict[str, str], list[str]]:
    """The environment to load ``text`` with, and the env keys it names that are unset here.
    Env keys live in the proxy's environment, not necessarily in this shell's: a random
    stand-in for each unset one lets the rest of the file be validated."""
    try:
        names = _env_names(safe_load(text))
    except Exception:  # the loader reports the YAML error, with its line
        names = set()
    unset = sorted(n for n in names if not os.environ.get(n))
    environ = dict(os.environ)
    for name in unset:
        environ[name] = "tp-stand-in-" + secrets.token_urlsafe(24)
    return environ, unset


def in_group(uid: int, gid: int) -> bool:
    """Whether the user ``uid`` is in group ``gid`` (the passwd and group databases; an
    unknown user is in none)."""
    try:
        user = pwd.getpwuid(uid)
        return gid in os.getgrouplist(user.pw_name, user.pw_gid)
    except (KeyError, OSError):
        return False


def readers_lost(
    old: os.stat_result, new: os.stat_result, member: Callable[[int, int], bool] = in_group
) -> list[str]:
    """Who could read the old file by its mode and could not read the new one (same mode; a
    non-root editor cannot give it the old owner, nor a group it is not in)."""
    mode = stat.S_IMODE(old.st_mode)
    if mode & stat.S_IROTH:
        return []  # anyone reads both
    lost = []
    moved = new.st_uid != old.st_uid
    if (
        moved
        and mode & stat.S_IRUSR
        and not (mode & stat.S_IRGRP and member(old.st_uid, new.st_gid))
    ):
        lost.append(f"its owner (uid {old.st_uid}, not in group {new.st_gid})")
    if mode & stat.S_IRGRP and new.st_gid != old.st_gid:
        lost.append(f"its group (gid {old.st_gid})")
    return lost


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when someone else renames a file in, writes it, or chmods it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ConfigEdit:
    """``with ConfigEdit(path) as edit:`` holds the lock and the file's current text and
    config; ``edit.commit(text, expected)`` writes ``text`` if it loads as ``expected``."""

    def __init__(self, path: str | Path) -> None:
        # Beside the real file where the path is a link: a rename over the link would replace
        # the link, not the file the proxy reads through it.
        self.path = Path(os.path.realpath(path))
        self.lock_path = self.path.with_name(f".{self.path.name}.lock")
        self._lock_fd: int | None = None
        self.raw = b""
        self._stat: os.stat_result | None = None  # the file read, as it was read
        self.text = ""
        self.unset_env: list[str] = []  # env keys not checkable here (a stand-in was used)
        self._environ: dict[str, str] = {}
        self.loaded: LoadedConfig | None = None

    def __enter__(self) -> Self:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise KeyFileError(f"cannot create the lock {self.lock_path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise KeyFileError(
                f"{self.path} is being edited by another `tierproxy keys` (it holds"
                f" {self.lock_path}); nothing changed: try again when it is done"
            ) from None
        self._lock_fd = fd
        try:
            self._read()
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; the (empty) lock file stays
            self._lock_fd = None

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                self._stat = os.fstat(f.fileno())
                self.raw = f.read()
            self.text = self.raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"cannot read {self.path}: {exc}") from exc
        self._environ, self.unset_env = stand_in_environ(self.text)
        self.loaded = self._load(self.text, "the config as it is")

    def _load(self, text: str, what: str) -> LoadedConfig:
        try:
            return parse_config(text, source=str(self.path), environ=self._environ)
        except ConfigError as exc:
            problems = "\n  ".join(exc.problems)
            raise KeyFileError(f"{what} does not load ({self.path}):\n  {problems}") from exc

    def commit(self, text: str, expected: dict[str, Any]) -> LoadedConfig:
        """Write ``text`` over the file if it loads and its config dumps as ``expected`` (the
        current config's ``model_dump()`` with the intended change); else KeyFileError."""
        new = self._load(text, "the edited config")
        if new.config.model_dump() != expected:
            raise KeyFileError(
                f"editing {self.path} would change more than the key (its layout is unusual);"
                " nothing written: edit it by hand"
            )
        self._unchanged()
        self._replace(text.encode("utf-8"))
        return new

    def _unchanged(self) -> None:
        """KeyFileError where the file is not the one read (renamed in, written, chmodded)."""
        assert self._stat is not None
        try:
            # The content, then the cheaper stat last: as close to the rename as it can be.
            same = self.path.read_bytes() == self.raw
            same = same and _identity(os.stat(self.path)) == _identity(self._stat)
        except OSError:
            same = False
        if not same:
            raise KeyFileError(f"{self.path} changed while it was being edited; nothing written")

    def _replace(self, data: bytes) -> None:
        folder = self.path.parent
        st = self._stat
        assert st is not None
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                self._keep_owner(out.fileno(), st)
                os.fchmod(out.fileno(), st.st_mode & 0o7777)
                os.fsync(out.fileno())
            # Again after the write and fsync (milliseconds): another writer's rename in that
            # time would be lost. What is left is the microseconds between this and the rename.
            self._unchanged()
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)

    def _keep_owner(self, fd: int, old: os.stat_result) -> None:
        """The old owner and group where allowed (root), else at least the group (a member of
        it can); KeyFileError where someone who read the old file could not read the new."""
        try:
            os.fchown(fd, old.st_uid, old.st_gid)
        except PermissionError:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, old.st_gid)
        new = os.fstat(fd)
        lost = readers_lost(old, new)
        if lost:
            raise KeyFileError(
                f"{self.path} belongs to {old.st_uid}:{old.st_gid}; written by this user the"
                f" new file would belong to {new.st_uid}:{new.st_gid} (only root can give a file"
                f" another owner, or a group its owner is not in), and {' and '.join(lost)}"
                " could no longer read it (a proxy reading it that way would stop reloading and"
                f" could not restart). Nothing written: run `tierproxy keys` as uid {old.st_uid}"
                " or as root"
            )
