"""Command-line options generated from a stage's section (toolchain/recipe.py), so that a single-stage command
takes the recipe's keys and nothing else: ``group_size`` is ``--group-size``, with the field's choices, bounds and
default, and what was given is validated by the section itself, cross-field rules included, as a recipe is.

A bool is a ``--x/--no-x`` pair (or the spelling given), a list of choices or names one comma-separated value
('none' for an empty list), any other list a repeatable option, a mapping is left to recipes. Only the options
given on the command line reach the section: a field's default is the section's, and a field that depends on
whether it was given (export's parity) sees the difference.
"""

from __future__ import annotations

import math
import types
import typing

import annotated_types
import click
from click.core import ParameterSource

from toolchain.errors import InputError
from toolchain.settings.section import Section

NONE = "none"  # a comma-separated list's spelling of the empty list
ALIAS = "__alias"  # the parameter name suffix of an option's former spelling (section_options' ``aliases``)


def spelling(name: str, spellings: dict[str, str]) -> str:
    return spellings.get(name, f"--{name.replace('_', '-')}").split("/")[0]


def _unwrap(annotation):
    """``X | None`` -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


class FiniteFloatRange(click.FloatRange):
    """A float range without nan and infinity: a limit or setting that no value compares with (nan passes every
    bound check) or that every value passes is bad input, exit 2, as in a recipe."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _number_type(kind, metadata):
    bounds: dict[str, typing.Any] = {"min": None, "max": None, "min_open": False, "max_open": False}
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            bounds["min"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            bounds.update(min=item.gt, min_open=True)
        elif isinstance(item, annotated_types.Le):
            bounds["max"] = item.le
        elif isinstance(item, annotated_types.Lt):
            bounds.update(max=item.lt, max_open=True)
    if kind is int:
        return click.INT if bounds["min"] is None and bounds["max"] is None else click.IntRange(**bounds)
    return FiniteFloatRange(**bounds)


def _option(name: str, field, help_text: str, spellings: dict[str, str], defaults: dict, comma: tuple[str, ...],
            aliased: bool = False):
    kind = _unwrap(field.annotation)
    origin = typing.get_origin(kind)
    default = defaults.get(name, None if field.is_required() or field.default_factory else field.default)
    # a field with a former spelling too: either may give it, and the section says when neither did
    required = field.is_required() and name not in defaults and not aliased
    names = spellings.get(name, f"--{name.replace('_', '-')}")
    show = default is not None
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    metavar = extra.get("metavar")  # a field's own, e.g. SECONDS
    if kind is bool:
        if "/" not in names:
            names = f"{names}/--no-{name.replace('_', '-')}"
        return click.option(names, name, default=default, show_default=show, help=help_text)
    if origin is typing.Literal:
        return click.option(names, name, type=click.Choice(typing.get_args(kind)), default=default,
                            show_default=show, required=required, help=help_text)
    if origin is list:
        (item,) = typing.get_args(kind)
        if typing.get_origin(item) is typing.Literal or name in comma:
            literal = typing.get_origin(item) is typing.Literal
            choices = f" ({', '.join(map(str, typing.get_args(item)))})" if literal else ""
            listed = None  # the default list, shown unless the help says what the default is
            if field.default_factory and "(default:" not in help_text:
                listed = field.default_factory()
            return click.option(names, name, default=None, metavar="A,B,...",
                                show_default=",".join(map(str, listed)) if listed else False,
                                help=f"{help_text}  Comma-separated{choices}; '{NONE}' for none.")
        return click.option(names, name, multiple=True, metavar=metavar, help=f"{help_text}  Repeat for more.")
    if kind in (int, float):
        return click.option(names, name, type=_number_type(kind, field.metadata), default=default,
                            show_default=show, required=required, metavar=metavar, help=help_text)
    if kind is str:
        return click.option(names, name, default=default, show_default=show, required=required, metavar=metavar,
                            help=help_text)
    raise TypeError(f"{name}: no command-line form for {field.annotation}; exclude it")


def section_options(section: type[Section], help: dict[str, str] | None = None, *,
                    spellings: dict[str, str] | None = None, defaults: dict | None = None, comma: tuple[str, ...] = (),
                    exclude: tuple[str, ...] = (), aliases: dict[str, str | tuple[str, bool]] | None = None):
    """A decorator adding an option for every field of ``section`` but those in ``exclude``: its help is the
    field's description (or ``help``'s entry), ``spellings`` of names other than ``--field-name``
    (``"--sym/--asym"``), ``defaults`` where the command's differs from the section's, ``comma``: lists of names
    given comma-separated, ``aliases``: a former spelling still taken (a yes/no field's: the flag and the value
    it sets), hidden from --help, with a warning naming
    the current one (given_section). A field without help, or help, a spelling, a default or an alias for no field,
    is a TypeError when the command is defined: the options cannot drift from the section."""
    help = help or {}
    aliases = aliases or {}
    fields = {name: field for name, field in section.model_fields.items() if name not in exclude}
    stray = (set(help) | set(spellings or {}) | set(defaults or {}) | set(comma) | set(aliases)) - set(fields)
    undocumented = [name for name, field in fields.items() if not (help.get(name) or field.description)]
    if stray or undocumented:
        raise TypeError(f"{section.__name__}: options for no field {sorted(stray)}, fields without help "
                        f"{undocumented}")

    def decorate(command):
        for name, former in aliases.items():
            kind = _unwrap(fields[name].annotation)
            if isinstance(former, tuple):  # a yes/no field's former flag and the value it set
                command = click.option(former[0], name + ALIAS, hidden=True, flag_value=former[1],
                                       default=None)(command)
            else:
                command = click.option(former, name + ALIAS, hidden=True, default=None,
                                       type=_number_type(kind, fields[name].metadata) if kind in (int, float)
                                       else None)(command)
        for name, field in reversed(fields.items()):
            command = _option(name, field, help.get(name) or field.description or "", spellings or {}, defaults or {},
                              comma, name in aliases)(command)
        return command

    return decorate


def _given_spelling(ctx: click.Context, param_name: str) -> str:
    return next(p.opts[0] for p in ctx.command.params if p.name == param_name)


def former_name(name: str, former: str, kind=None):
    """A decorator adding ``former``, a hidden former spelling of option ``name`` (for an option not generated from a
    section: section_options' ``aliases`` does this for those); take_former_names moves its value over."""
    return click.option(former, name + ALIAS, hidden=True, default=None, type=kind)


def take_former_names(values: dict, spellings: dict[str, str] | None = None) -> None:
    """Move the value given by an option's former spelling to the option itself, with a warning naming the current
    spelling; both given is an InputError."""
    ctx = click.get_current_context()
    for key in [k for k in values if k.endswith(ALIAS)]:
        name, former = key.removesuffix(ALIAS), values.pop(key)
        if former is None:
            continue
        current = spelling(name, spellings or {})
        if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise InputError(f"{current} given twice (also by its former name)")
        click.echo(f"dstc: warning: {_given_spelling(ctx, name + ALIAS)} is now {current}", err=True)
        values[name] = former
        ctx.set_parameter_source(name, ParameterSource.COMMANDLINE)


def given_section(section: type[Section], values: dict, spellings: dict[str, str] | None = None):
    """The section from the values of its generated options that were given on the command line (the others keep
    the section's defaults, or the command's where it declares its own); an InputError naming the option."""
    ctx = click.get_current_context()
    take_former_names(values, spellings)
    fields = {}
    for name, field in section.model_fields.items():
        if name not in values:
            continue
        value = values[name]
        if ctx.get_parameter_source(name) is ParameterSource.DEFAULT and not field.is_required():
            continue
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, str) and typing.get_origin(_unwrap(field.annotation)) is list:
            value = [v.strip() for v in value.split(",") if v.strip() and v.strip() != NONE]
        fields[name] = value
    return section.check(fields, lambda loc: spelling(str(loc[0]), spellings or {}))
