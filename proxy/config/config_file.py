"""Reading the config file as it may be found: the path is whatever an operator or a deploy tool
last renamed there. A named pipe would block the reader for good, a log moved to the wrong name
would be read whole into memory: only a regular file up to ``MAX_CONFIG_BYTES`` is read."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# A config of 10,000 tenants with hashed keys is ~3 MB.
MAX_CONFIG_BYTES = 32 * 2**20


def read_config_bytes(path: str | Path) -> bytes:
    """The file's bytes; ``OSError`` (with a ``strerror`` that says why) for anything else."""
    # O_NONBLOCK: opening a FIFO with no writer returns at once rather than waiting for one.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        too_big = f"larger than the {MAX_CONFIG_BYTES >> 20} MiB a config may be"
        if info.st_size > MAX_CONFIG_BYTES:
            raise OSError(errno.EFBIG, too_big)
        data = file.read(MAX_CONFIG_BYTES + 1)  # it may have grown since fstat
        if len(data) > MAX_CONFIG_BYTES:
            raise OSError(errno.EFBIG, too_big)
        return data
