"""read_config_bytes: only a regular file, and only up to MAX_CONFIG_BYTES, is read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.config import config_file
from proxy.config.config_file import read_config_bytes


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"tiers: {}\n")
    assert read_config_bytes(path) == b"tiers: {}\n"


def test_a_named_pipe_without_writer_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    os.mkfifo(path)
    with pytest.raises(OSError) as caught:
        read_config_bytes(path)
    assert caught.value.strerror == "not a regular file"


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        read_config_bytes(tmp_path)


def test_a_file_past_the_bound_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_file, "MAX_CONFIG_BYTES", 16)
    path = tmp_path / "c.yaml"
    path.write_bytes(b"x" * 16)
    assert read_config_bytes(path) == b"x" * 16
    path.write_bytes(b"x" * 17)
    with pytest.raises(OSError) as caught:
        read_config_bytes(path)
    assert "MiB a config may be" in str(caught.value.strerror)
