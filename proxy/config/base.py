"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Every config section: unknown fields are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
