"""The command-line cases of issue #22: hostile or unlucky input to every command but `serve` gets one line and the
documented exit code, or the right result; nothing is lost and no traceback is printed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from toolchain.atomic import MARKER

REPO = Path(__file__).resolve().parent.parent

# -- 11. processes hammering one output ------------------------------------------------------------------------------

# A writer of the output: ``writes`` replacements of it, each outcome printed as one JSON line. A busy machine pauses
# a process anywhere: here every look at a file's metadata or a directory's entries waits up to 1 ms, and the rename
# that moves the old output aside is followed by 2 ms, the instant when the output does not exist, which another
# writer's checks must take in their stride.
_HAMMER = """
import json, os, random, sys, time
from pathlib import Path

import toolchain.atomic as atomic
from toolchain.errors import InputError

target, writes, wait, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "wait", sys.argv[4]
rename, stat, listdir = Path.rename, os.stat, os.listdir


def slow_rename(self, to):
    moved = rename(self, to)
    if ".old-" in str(to):
        time.sleep(0.002)
    return moved


def slow(call):
    def paused(*args, **kwargs):
        time.sleep(random.random() / 1000)
        return call(*args, **kwargs)
    return paused


Path.rename, os.stat, os.listdir = slow_rename, slow(stat), slow(listdir)
for i in range(writes):
    try:
        with atomic.atomic_output_dir(target, wait=wait) as tmp:
            (tmp / "data").write_text(f"{name} {i}")
        outcome = "written"
    except InputError as e:
        outcome = "busy" if "is being written by another dstc process" in str(e) else f"InputError: {e}"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(json.dumps(outcome), flush=True)
"""


def _hammer(tmp_path: Path, *, writers: int, writes: int, wait: bool) -> list[str]:
    target = tmp_path / "out"
    children = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HAMMER), str(target), str(writes),
                                  "wait" if wait else "fail", f"w{n}"], cwd=REPO, stdout=subprocess.PIPE, text=True)
                for n in range(writers)]
    outcomes = []
    for child in children:
        out, _ = child.communicate(timeout=240)
        assert child.returncode == 0
        outcomes += [json.loads(line) for line in out.splitlines()]
    assert len(outcomes) == writers * writes
    # the output is whole and dstc's, and nothing else is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == sorted(["data", MARKER])
    return outcomes


def test_writers_of_one_output_that_wait_all_succeed(tmp_path):
    outcomes = _hammer(tmp_path, writers=3, writes=150, wait=True)
    assert [o for o in outcomes if o != "written"] == []


def test_writers_of_one_output_that_do_not_wait_either_write_or_are_told_it_is_busy(tmp_path):
    outcomes = _hammer(tmp_path, writers=3, writes=300, wait=False)
    assert [o for o in outcomes if o not in ("written", "busy")] == []
    assert outcomes.count("written") >= 3
