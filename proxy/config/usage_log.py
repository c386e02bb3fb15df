"""The ``usage_log:`` section (the writer is ``proxy.ops.usage_log``)."""

from __future__ import annotations

from pydantic import Field

from proxy.config.base import TUNING, Strict


class UsageLogSettings(Strict):
    """``usage_log:`` — off unless a path is given."""

    path: str = Field(
        min_length=1,
        description="The usage log file (JSON lines); rotated files sit beside it.",
    )
    max_bytes: int = Field(
        100 * 1024 * 1024,
        gt=0,
        description="The live file rotates once the next line would take it past this size.",
    )
    backups: int = Field(
        5,
        ge=0,
        description="Rotated files kept (LOG.1 .. LOG.<backups>); 0: the file is emptied instead.",
    )
    queue_size: int = Field(
        10_000,
        gt=0,
        description="Lines waiting for the writer thread; beyond it lines are dropped and counted.",
        json_schema_extra=TUNING,
    )
