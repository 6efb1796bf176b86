"""Every command's --help ends with examples, and each example parses as the command's own options and arguments
(an option renamed or removed breaks it here, not in a user's shell)."""

from __future__ import annotations

import shlex

import click
import pytest

from cli_helpers import leaf_commands

from toolchain.cli import EXAMPLES, SUMMARIES, cli


COMMANDS = leaf_commands(cli)


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


def test_every_command_and_group_has_a_whole_one_line_summary_in_workflow_order(monkeypatch, capsys):
    from conftest import run_cli

    groups = {f"{name}" for name, c in cli.commands.items() if isinstance(c, click.Group)}
    assert sorted(SUMMARIES) == sorted([*COMMANDS, *groups])
    assert all(len(text) <= 90 and text.endswith(".") and "..." not in text for text in SUMMARIES.values())
    code, out, _ = run_cli(monkeypatch, capsys, "--help")
    assert code == 0
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.startswith("  ") and
              not line.startswith("   ")]
    assert listed[:4] == ["build", "recipe", "eval", "compare"] and listed.index("serve") < listed.index("export")
    assert "..." not in out.split("Commands:")[1]


def test_every_option_has_help():
    missing = [f"{name} {p.opts[0]}" for name, command in COMMANDS.items() for p in command.params
               if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert missing == []


def test_recipe_init_writes_a_recipe_dstc_build_reads_and_never_overwrites(monkeypatch, capsys, tmp_path):
    from conftest import run_cli

    from toolchain.recipe import load_recipe

    out = tmp_path / "mine.yaml"
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "init", "deepseek-v3-tiny", "--backend", "openvino",
                           "-o", out)
    assert code == 0, err
    recipe = load_recipe(out)
    assert (recipe.name, recipe.compile.backend, recipe.compress.scheme) == (
        "deepseek-v3-tiny-openvino-int4", "openvino", "int4-grouped")
    assert recipe.gates is not None and recipe.gates.max_weight_error == 0.5
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "init", "deepseek-v3-tiny", "--backend", "openvino",
                           "-o", out)
    assert code == 2 and "does not overwrite" in err
    code, printed, _ = run_cli(monkeypatch, capsys, "recipe", "init", "org/Some_Model", "--backend", "onnxruntime",
                               "--scheme", "fp32")
    assert code == 0 and "name: some_model-onnxruntime-fp32" in printed and "compress" not in printed
