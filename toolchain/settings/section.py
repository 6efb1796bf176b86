"""A configuration section: a pydantic model with no unknown keys, read the same way from a recipe, a command's
options (toolchain/cli_options.py) or a function's arguments, so that each setting is spelled once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

from pydantic import BaseModel, ConfigDict, ValidationError

from toolchain.errors import InputError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
