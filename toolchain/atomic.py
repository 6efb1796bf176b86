"""Output directories that appear whole or not at all.

A stage writes into a hidden temporary directory beside the target and renames it into place at the end; on any
error (or Ctrl-C) the temporary directory is removed and the target is left as it was. A process killed outright
cannot clean up: its temporary directory carries its pid and is removed by the next writer of the same target.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from toolchain.errors import InputError

# A directory holding one of these was written by dstc and may be replaced by a new build.
MARKERS = ("export.json", "manifest.json", "passes.json", "compression.json", "compile.json", "stage.json")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: Path) -> None:
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        pid = leftover.name[len(f".{target.name}.tmp-"):].split("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def atomic_output_dir(target: Path) -> Iterator[Path]:
    target = Path(target)
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and
                                                    not any((target / m).exists() for m in MARKERS))):
        raise InputError(f"{target} exists and is not a dstc output; choose another directory or remove it")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    except OSError as e:
        raise InputError(f"cannot write to {target}: {e.strerror}") from None
    try:
        yield tmp
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            target.rename(old)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
