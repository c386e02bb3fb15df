"""`tierproxy keys` on the file: comments and layout kept (only the edited lines differ), the
new key shown once and stored as its sha256, a bad edit or a concurrent one leaves the file as
it was, rotation gives the old key its overlap, `check` warns of expiring keys."""

from __future__ import annotations

import difflib
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config.loader import load_config, parse_config
from proxy.config.tenants import hash_key
from proxy.tools.keyfile import ConfigEdit, KeyFileError
from proxy.tools.keys import (
    KeysError,
    add_key,
    expiry_warnings,
    key_rows,
    revoke_key,
    rotate_key,
)
from tests.helpers.keyfile import BLOCK, NOW, A, B
from tests.helpers.keyfile import now as _now
from tests.helpers.paths import REPO


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tierproxy.yaml"
    path.write_text(BLOCK)
    path.chmod(0o640)
    return path


def _diff(before: str, after: str) -> list[str]:
    """The changed lines, with +/-."""
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_add_writes_only_the_new_entry_and_shows_the_key_once(config: Path) -> None:
    new, notes = add_key(config, "chat", "90d", _now)
    after = config.read_text()
    digest = hash_key(new.key)
    assert new.key.startswith("tp-") and len(new.key) > 40 and new.key not in after
    assert _diff(BLOCK, after) == [
        f'+      - sha256: "{digest}"',
        f'+        id: "{digest[:12]}"',
        "+        created_at: 2026-03-01T09:30:15Z",
        "+        expires_at: 2026-05-30T09:30:15Z",
    ]
    loaded = load_config(config)
    assert loaded.tenant_for_key(new.key) is not None
    assert loaded.tenant_for_key(new.key).name == "chat"  # type: ignore[union-attr]
    assert (
        loaded.key_expires_at[digest]
        == (NOW + timedelta(days=90)).replace(microsecond=0).timestamp()
    )
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert notes == []
    assert not [p for p in config.parent.iterdir() if p.suffix == ".tmp"]


def test_add_to_flow_layouts_keeps_them(config: Path) -> None:
    new, _ = add_key(config, "batch", None, _now)
    changed = _diff(BLOCK, config.read_text())
    digest = hash_key(new.key)
    assert changed == [
        f'+    - {{sha256: "{digest}", id: "{digest[:12]}", created_at: 2026-03-01T09:30:15Z}}'
    ]
    example = (REPO / "configs/example.yaml").read_text()
    shipped = config.parent / "example.yaml"
    shipped.write_text(example)
    new, _ = add_key(shipped, "chat-app", None, _now)
    changed = _diff(example, shipped.read_text())
    assert len(changed) == 2 and changed[1].endswith("created_at: 2026-03-01T09:30:15Z}]")
    assert load_config(shipped).tenant_for_key(new.key) is not None


def test_rotate_gives_the_old_key_the_overlap_and_keeps_a_sooner_expiry(config: Path) -> None:
    with pytest.raises(KeysError, match="--keep"):  # two keys: which one?
        rotate_key(config, "chat", None, "24h", None, _now)
    assert config.read_text() == BLOCK
    new, old_id, until, _ = rotate_key(config, "chat", "aaaaaaaaaaaa", "24h", None, _now)
    assert old_id == "aaaaaaaaaaaa"
    assert until == datetime(2026, 3, 2, 9, 30, 16, tzinfo=UTC)  # a whole second, not less
    after = config.read_text()
    assert "        expires_at: 2026-03-02T09:30:16Z\n" in after
    assert '      - sha256: "' + A + '"   # laptop key, quoted\n' in after
    loaded = load_config(config)
    assert loaded.key_expires_at[A] == until.timestamp() and B not in loaded.key_expires_at
    assert loaded.tenant_for_key(new.key) is not None
    # Rotating again with a longer overlap never extends the old key's life.
    _, _, again, _ = rotate_key(config, "chat", "aaaaaaaaaaaa", "30d", None, _now)
    assert again == until
    # A tenant with one key needs no --keep; a flow mapping gets the field inline.
    _, old_id, _, _ = rotate_key(config, "batch", None, "1h", None, _now)
    assert old_id == "c" * 12
    assert f'- {{sha256: "{"c" * 64}", expires_at: 2026-03-01T10:30:16Z}}' in config.read_text()


def test_revoke_removes_the_entry_and_refuses_the_last_key(config: Path) -> None:
    revoke_key(config, "chat", "aaaaaaaaaaaa")
    after = config.read_text()
    assert _diff(BLOCK, after) == [
        f'-      - sha256: "{A}"   # laptop key, quoted',
        "-        id: aaaaaaaaaaaa",
    ]
    assert hash_key("x") not in after and "# the CI runner's key" in after
    mtime = config.stat().st_mtime_ns
    with pytest.raises(KeysError, match="does not load") as exc:  # the loader: min one key
        revoke_key(config, "chat", B[:12])
    assert "keys" in str(exc.value)
    assert config.read_text() == after and config.stat().st_mtime_ns == mtime
    with pytest.raises(KeysError, match="has no key"):
        revoke_key(config, "chat", "ffffffffffff")
    with pytest.raises(KeysError, match="no tenant"):
        revoke_key(config, "nobody", B[:12])
    assert config.read_text() == after


def test_an_edit_that_means_more_than_the_change_is_not_written(config: Path) -> None:
    with ConfigEdit(config) as edit:
        assert edit.loaded is not None
        expected = edit.loaded.config.model_dump()
        with pytest.raises(KeyFileError, match="more than the key"):
            edit.commit(edit.text.replace("weight: 2", "weight: 3"), expected)
        with pytest.raises(KeyFileError, match="does not load"):
            edit.commit(edit.text.replace("tier: high", "tier: gold", 1), expected)
    assert config.read_text() == BLOCK


def test_a_second_editor_is_refused_and_a_file_changed_meanwhile_is_not_overwritten(
    config: Path,
) -> None:
    with ConfigEdit(config) as edit:
        with pytest.raises(KeysError, match="being edited by another"):
            add_key(config, "chat", None, _now)
        assert edit.loaded is not None
        config.write_text(BLOCK + "# a person saved the file meanwhile\n")
        with pytest.raises(KeyFileError, match="changed while"):
            edit.commit(edit.text, edit.loaded.config.model_dump())
    assert config.read_text().endswith("meanwhile\n")
    add_key(config, "chat", None, _now)  # the lock is released


def test_a_config_that_does_not_load_is_not_edited(config: Path) -> None:
    config.write_text(BLOCK.replace("weight: 2", "weight: -2"))
    with pytest.raises(KeysError, match="the config as it is does not load"):
        add_key(config, "chat", None, _now)


def test_env_keys_unset_here_do_not_block_an_edit(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = BLOCK.replace(f"      - sha256: {B}\n", "      - env: TIERPROXY_TEST_UNSET_KEY\n")
    assert "TIERPROXY_TEST_UNSET_KEY" not in os.environ
    config.write_text(text)
    new, notes = add_key(config, "chat", None, _now)
    assert notes == [
        "note: TIERPROXY_TEST_UNSET_KEY is not set here; the key it holds was not checked"
    ]
    assert hash_key(new.key) in config.read_text()
    assert main(["keys", "list", "chat", "-c", str(config)]) == 0
    assert "env:TIERPROXY_TEST_UNSET_KEY" in capsys.readouterr().out


def test_list_and_check_show_ids_and_expiry_never_the_hash(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rotate_key(config, "chat", "aaaaaaaaaaaa", "2d", None, _now)
    config_ = load_config(config).config
    rows = key_rows(config_, "chat", NOW)
    assert rows[0] == ("chat", "aaaaaaaaaaaa", "-", "2026-03-03T09:30:16Z", "expires in 2.0d")
    assert rows[1][1:] == (B[:12], "-", "never", "active")
    assert all(A not in cell and B not in cell for row in rows for cell in row)
    assert expiry_warnings(config_, NOW, 14) == [
        "key aaaaaaaaaaaa of tenant 'chat' expires at 2026-03-03T09:30:16Z (in 2.0d):"
        " `tierproxy keys rotate chat`"
    ]
    assert expiry_warnings(config_, NOW, 1) == []
    later = NOW + timedelta(days=3)
    assert expiry_warnings(config_, later, 1) == [
        "key aaaaaaaaaaaa of tenant 'chat' expired at 2026-03-03T09:30:16Z"
    ]
    assert main(["keys", "list", "-c", str(config)]) == 0
    out = capsys.readouterr().out
    assert "aaaaaaaaaaaa" in out and A not in out and B not in out
    soon, _ = add_key(config, "chat", "5d")  # on the real clock, as `check` runs
    assert main(["check", "-c", str(config), "--expiring-days", "7"]) == 0
    out = capsys.readouterr().out
    assert "warning: key aaaaaaaaaaaa of tenant 'chat' expired at 2026-03-03T09:30:16Z" in out
    assert f"warning: key {soon.key_id} of tenant 'chat' expires at" in out
    assert main(["check", "-c", str(config), "--expiring-days", "3"]) == 0
    assert soon.key_id not in capsys.readouterr().out


def test_the_cli_prints_the_key_alone_on_stdout(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "add", "chat", "-c", str(config), "--expires", "2026-12-31"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert out.count("\n") == 1 and key.startswith("tp-")
    assert "expires 2026-12-31T00:00:00Z" in err and "shown only this once" in err
    assert parse_config(config.read_text()).tenant_for_key(key) is not None
    assert main(["keys", "add", "chat", "-c", str(config), "--expires", "2020-01-01"]) == 1
    assert "that time has passed" in capsys.readouterr().err
    assert main(["keys", "add", "chat", "-c", str(config), "--expires", "soon"]) == 1


def test_a_hash_of_decimal_digits_only_stays_a_string(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One id in ~290 is 12 decimal digits (and unquoted, YAML would read a number).
    digits = ("1234567890" * 7)[:64]
    monkeypatch.setattr("proxy.tools.keys.hash_key", lambda key: digits)
    new, _ = add_key(config, "chat", None, _now)
    assert new.key_id == digits[:12]
    keys = load_config(config).config.tenants[0].keys
    assert keys[-1].sha256 == digits and keys[-1].id == digits[:12]
