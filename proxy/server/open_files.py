"""The process's open-files limit, raised at start: every client connection holds a file."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("tierproxy")


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to the hard limit; returns (soft, hard) now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    log.info("open files limit: %d (hard %d)", soft, hard)
    return soft, hard
