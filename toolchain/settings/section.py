"""A configuration section: a pydantic model with no unknown keys, read the same way from a recipe, a command's
options (toolchain/cli_options.py) or a function's arguments, so that each setting is spelled once."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Self

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from toolchain.errors import InputError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_booleans(cls, value, info: ValidationInfo):
        """A yes/no setting takes true or false only: pydantic would read "no", "off", "0" or 0 as false where a
        string for a number is refused (``group_size: "128"``), so that a quoted value means what it says nowhere."""
        if info.field_name is not None and not isinstance(value, bool) and value is not None \
                and _is_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{value!r} is not a boolean: write true or false, unquoted")
        return value

    @classmethod
    def check(cls, fields: dict, where: Callable[[tuple], str] = lambda loc: ".".join(map(str, loc))) -> Self:
        """The section from a command's or a function's options, as a recipe would hold it; an InputError with the
        recipe's message for the first bad one (``where``: how to name a field's location there, e.g. as its
        command-line option)."""
        try:
            return cls(**fields)
        except ValidationError as e:
            first = e.errors()[0]
            problem = first["msg"].removeprefix("Value error, ")
            raise InputError(f"{where(first['loc'])}: {problem}" if first["loc"] else problem) from None


def _is_bool(annotation) -> bool:
    """``bool`` or ``bool | None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation)) == {bool, type(None)}
    return annotation is bool
