"""Compiled artifacts: an export (model.onnx + export.json) turned into a directory that a runtime's own loader
opens as it opens its own exports. One module per backend; the stage is toolchain/stages/compile.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from toolchain.interface.files import CHECKPOINT_FILES


def copy_checkpoint_files(source: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in CHECKPOINT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
            copied.append(name)
    return copied
