"""The base of every config section, and the mark of a tuning field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

# `Field(..., json_schema_extra=TUNING)`: a controller's or an implementation's internal that an
# operator should never need to set; docs/configuration.md lists it in the "Tuning" appendix.
TUNING: dict[str, Any] = {"tuning": True}


def is_tuning(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("tuning") is True


class Strict(BaseModel):
    """Every config section: unknown fields are errors, values are frozen, numbers finite (YAML's
    ``.inf`` reads as "unlimited" but passes every ``gt=0``; no limit or price is infinite:
    leave it out)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
