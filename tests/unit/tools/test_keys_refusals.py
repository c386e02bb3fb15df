"""`tierproxy keys` refusals found by the attack's round 2: times out of range are a plain
error, not a traceback (finding 10); an edit by a user who cannot keep the file's owner keeps
its group, and is refused where someone who read the file could no longer read it (k03); a
file renamed in by someone else while the new one was written and fsynced is not overwritten
(k05)."""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.tools.keyfile import ConfigEdit, KeyFileError, readers_lost
from proxy.tools.keys import KeysError, add_key
from tests.helpers.keyfile import BLOCK
from tests.helpers.keyfile import now as _now

_root_only = pytest.mark.skipif(os.geteuid() != 0, reason="gives files other owners (root)")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tierproxy.yaml"
    path.write_text(BLOCK)
    path.chmod(0o660)
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "--expires", "9999-12-31T23:59:59-12:00"], "out of range once converted to UTC"),
        (["add", "--expires", "99999999999d"], "too long a span"),
        (["add", "--expires", "2999999d"], "ends after the year 9999"),
        (["rotate", "--overlap", "99999999999d"], "too long a span"),
        (["rotate", "--overlap", "2999999d"], "ends after the year 9999"),
    ],
)
def test_times_out_of_range_are_a_plain_error(
    config: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    command, *options = args
    assert main(["keys", command, "chat", "-c", str(config), *options]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"tierproxy keys {command}: ") and message in err
    assert config.read_text() == BLOCK


def _stat(uid: int, gid: int, mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 1, 1, 1, uid, gid, 10, 0, 0, 0))


def test_readers_lost_by_mode_owner_and_group() -> None:
    nobody: Callable[[int, int], bool] = lambda uid, gid: False  # noqa: E731
    both: Callable[[int, int], bool] = lambda uid, gid: True  # noqa: E731
    old = _stat(0, 2001, 0o660)
    assert readers_lost(old, _stat(0, 2001, 0o660), nobody) == []  # root kept both
    lost = readers_lost(old, _stat(2003, 2001, 0o660), nobody)
    assert lost == ["its owner (uid 0, not in group 2001)"]  # the k03 layout
    assert readers_lost(old, _stat(2003, 2001, 0o660), both) == []  # it reads via the group
    assert readers_lost(old, _stat(2003, 2003, 0o660), both) == ["its group (gid 2001)"]
    assert readers_lost(old, _stat(2003, 2003, 0o660), nobody) == [
        "its owner (uid 0, not in group 2003)",
        "its group (gid 2001)",
    ]
    assert readers_lost(_stat(0, 2001, 0o600), _stat(0, 2003, 0o600), nobody) == []
    assert readers_lost(_stat(0, 2001, 0o644), _stat(2003, 2003, 0o644), nobody) == []


def _as_non_root(monkeypatch: pytest.MonkeyPatch, *, member_of: set[int]) -> list[tuple[int, int]]:
    """os.fchown as a non-root user in ``member_of`` sees it: no other owner, only its groups."""
    real = os.fchown
    calls: list[tuple[int, int]] = []

    def fchown(fd: int, uid: int, gid: int) -> None:
        calls.append((uid, gid))
        if uid not in (-1, os.geteuid()) or (gid != -1 and gid not in member_of):
            raise PermissionError(1, "Operation not permitted")
        real(fd, uid, gid)

    monkeypatch.setattr(os, "fchown", fchown)
    return calls


def _someone_with_a_group() -> pwd.struct_passwd:
    for user in pwd.getpwall():
        if user.pw_uid not in (0, os.geteuid()) and user.pw_gid != 0:
            return user
    pytest.skip("no user other than root in the passwd database")


@_root_only
def test_an_edit_keeps_the_group_when_it_cannot_keep_the_owner(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = _someone_with_a_group()  # the old owner: a member of its own group
    os.chown(config, user.pw_uid, user.pw_gid)
    calls = _as_non_root(monkeypatch, member_of={user.pw_gid})
    add_key(config, "chat", None, _now)
    after = config.stat()
    assert (after.st_uid, after.st_gid) == (os.geteuid(), user.pw_gid)
    assert stat.S_IMODE(after.st_mode) == 0o660
    assert calls == [(user.pw_uid, user.pw_gid), (-1, user.pw_gid)]


@_root_only
@pytest.mark.parametrize("member_of", [{2001}, set()])
def test_an_edit_that_would_lock_a_reader_out_is_refused(
    config: Path, monkeypatch: pytest.MonkeyPatch, member_of: set[int]
) -> None:
    os.chown(config, 4242, 2001)  # the proxy's user (in no group here), admins' group
    _as_non_root(monkeypatch, member_of=member_of)
    with pytest.raises(KeysError) as exc:
        add_key(config, "chat", None, _now)
    message = str(exc.value)
    assert "its owner (uid 4242" in message and "Nothing written" in message
    assert ("its group (gid 2001)" in message) == (not member_of)
    assert config.read_text() == BLOCK
    after = config.stat()
    assert (after.st_uid, after.st_gid) == (4242, 2001)
    assert [p.name for p in config.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_rename_in_while_the_new_file_is_written_is_not_overwritten(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other writer's rename lands after the first comparison, during the fsync."""
    theirs = BLOCK + "# renamed in by someone else\n"
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        if not config.read_text().endswith("else\n"):
            other = config.with_name("other.tmp")
            other.write_text(theirs)
            other.replace(config)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(KeysError, match="changed while it was being edited"):
        add_key(config, "chat", None, _now)
    assert config.read_text() == theirs
    assert sorted(p.name for p in config.parent.iterdir()) == [
        ".tierproxy.yaml.lock",
        "tierproxy.yaml",
    ]


def test_a_chmod_meanwhile_is_a_change_too(config: Path) -> None:
    with ConfigEdit(config) as edit:
        assert edit.loaded is not None
        config.chmod(0o640)  # the bytes are the same; the new file would undo the chmod
        with pytest.raises(KeyFileError, match="changed while"):
            edit.commit(edit.text, edit.loaded.config.model_dump())
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
