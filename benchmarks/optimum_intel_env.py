"""optimum-intel's own environment, where the benchmarks find optimum-cli: install.sh makes .venv-optimum-intel
(requirements-optimum-intel.txt), since optimum-intel requires transformers<5.6 and does not import beside dstc's
(README, "Quick start"). DSTC_OPTIMUM_INTEL_PYTHON names another interpreter."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

PYTHON = Path(os.environ.get("DSTC_OPTIMUM_INTEL_PYTHON")
              or Path(__file__).resolve().parent.parent / ".venv-optimum-intel" / "bin" / "python")
OPTIMUM_CLI = PYTHON.parent / "optimum-cli"


def version() -> str | None:
    """optimum-intel's version in that environment (None: not installed there)."""
    site = sorted(PYTHON.parent.parent.glob("lib/python*/site-packages"))
    found = [d.version for d in metadata.distributions(path=[str(p) for p in site]) if d.name == "optimum-intel"]
    return found[0] if found else None
