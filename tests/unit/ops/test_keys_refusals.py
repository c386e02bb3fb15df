"""`tierproxy keys` refusals found by the attack's round 2: times out of range are a plain
error, not a traceback (finding 10); an edit by a user who cannot keep the file's owner keeps
its group, and is refused where someone who read the file could no longer read it (k03); a
file renamed in by someone else while the new one was written and fsynced is not overwritten
(k05)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
from tests.unit.ops.test_keys import BLOCK


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
