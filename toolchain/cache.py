"""Where dstc keeps what it reuses from one run to the next: finished stages (toolchain/stages/runner.py), the
checkpoints' file hashes (toolchain/source_hashes.py) and the fp32 reference's outputs
(toolchain/reference/cache.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """DSTC_CACHE_DIR, default ~/.cache/dstc."""
    return Path(os.environ.get("DSTC_CACHE_DIR") or Path.home() / ".cache" / "dstc")
