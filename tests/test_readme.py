"""The README is a user's guide kept in step with the CLI: every command in its table exists and every command
exists in its table, the options its examples use are the commands' own, its links resolve, its two quick-start
commands are the ones CI runs, and it stays short (the measurements live in docs/)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from cli_helpers import leaf_commands

from toolchain.cli import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


COMMANDS = leaf_commands(cli, "dstc")


def _table_commands() -> set[str]:
    rows = re.findall(r"^\| `(dstc [a-z-]+(?: [a-z-]+)?)", README, re.M)
    return {row if row in COMMANDS else row.rsplit(" ", 1)[0] for row in rows}


def test_the_command_table_lists_every_command_and_no_other():
    assert _table_commands() == set(COMMANDS)


def _example_invocations() -> list[list[str]]:
    """Each `dstc ...` line of the README's bash blocks, continuation lines joined, as argv."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    calls = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("#"):
                continue
            for part in re.split(r"&&|\|", line):
                words = shlex.split(part.replace(">", " > "))
                if words and words[0].endswith("/dstc"):
                    calls.append(words[:words.index(">")] if ">" in words else words)
    return calls


def test_the_examples_use_existing_commands_and_options():
    calls = _example_invocations()
    assert len(calls) >= 5
    for argv in calls:
        name = next(n for n in sorted(COMMANDS, key=len, reverse=True) if argv[1:1 + n.count(" ")] == n.split()[1:])
        options = {opt for param in COMMANDS[name].params for opt in (*param.opts, *param.secondary_opts)}
        used = {word.split("=")[0] for word in argv if word.startswith("--")}
        assert used <= options, f"{' '.join(argv)}: {sorted(used - options)} are not options of {name}"


def test_links_resolve_and_the_readme_stays_short():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        assert (REPO / target).exists(), target
    assert len(README.splitlines()) <= 250


def test_the_two_quick_start_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("./install.sh && .venv/bin/dstc build recipes/deepseek-v3-tiny-openvino-int4.yaml",
                    "./install.sh test && .venv/bin/python -m pytest"):
        assert command in README and command in ci
