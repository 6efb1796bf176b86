"""Every command's --help ends with examples, and each example parses as the command's own options and arguments
(an option renamed or removed breaks it here, not in a user's shell)."""

from __future__ import annotations

import shlex

import click
import pytest

from toolchain.cli import EXAMPLES, cli


def _leaves(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(_leaves(command, f"{prefix}{name} "))
        else:
            found[f"{prefix}{name}"] = command
    return found


COMMANDS = _leaves(cli)


def test_every_command_has_examples_and_no_example_names_a_missing_command():
    assert sorted(COMMANDS) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_parses_and_is_in_the_help(name):
    command = COMMANDS[name]
    help_text = command.get_help(click.Context(command, info_name=name))
    for example in EXAMPLES[name]:
        words = shlex.split(example.split(" > ")[0])
        assert words[:1 + name.count(" ") + 1] == ["dstc", *name.split()], example
        args = words[2 + name.count(" "):]
        command.make_context(name, args)  # a UsageError / BadParameter fails the test
        assert example in help_text, f"{example!r} is not shown whole in dstc {name} --help"


def test_an_example_with_a_removed_option_would_fail():
    with pytest.raises(click.UsageError):
        COMMANDS["gate"].make_context("gate", ["REPORT", "--max-klm", "1"])
