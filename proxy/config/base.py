"""The base of every config section, and the mark of a tuning field."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

# `Field(..., json_schema_extra=TUNING)`: a controller's or an implementation's internal that an
# operator should never need to set; docs/configuration.md lists it in the "Tuning" appendix.
TUNING: dict[str, Any] = {"tuning": True}


def is_tuning(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("tuning") is True


class Misplaced(ValueError):
    """A problem a check across sections finds, and where in the file it is (the loader names
    that line rather than the top of the file: red team R2)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class Strict(BaseModel):
    """Every config section: unknown fields are errors, values are frozen, numbers finite (YAML's
    ``.inf`` reads as "unlimited" but passes every ``gt=0``; no limit or price is infinite:
    leave it out)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's yes/no/true/false is not a number: pydantic would take it as 1 or 0
        (red team R4: `max_loras: yes` was one adapter slot, `max_inflight: yes` a room of 1)."""
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _kinds(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                raise ValueError("a number is needed here, not yes/no or true/false")
        return value


def _kinds(annotation: Any) -> set[Any]:
    """The types a field's annotation admits (the members of a union, else itself)."""
    if get_origin(annotation) in (Union, types.UnionType):
        return set(get_args(annotation))
    return {annotation}
