"""Compiled artifacts: an export (model.onnx + export.json) turned into a directory that a runtime's own loader
opens as it opens its own exports. One module per backend; the stage is toolchain/stages/compile.py."""

from __future__ import annotations

import shutil
from pathlib import Path

# The checkpoint files that runtimes read beside the graph: the config (architecture, eos/bos ids), generation
# defaults, and the Hugging Face tokenizer with its chat template (transformers 5 keeps the template in
# chat_template.jinja, older checkpoints in tokenizer_config.json).
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def copy_checkpoint_files(source: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in CHECKPOINT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
            copied.append(name)
    return copied
