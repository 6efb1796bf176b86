"""Loaded into every Ray worker of tests/distributed/test_ray_builds.py (Ray's worker_process_setup_hook): a worker that dies
mid-stage, once, when the test arms it."""

from __future__ import annotations

import os
from pathlib import Path

# the file whose presence arms the hook; the worker that removes it dies
ARM = "DSTC_TEST_RAY_KILL_ARM"


def install() -> None:
    # patched before the stage runner imports it: the runner's own name is this wrapper
    import toolchain.hashing

    file_hashes = toolchain.hashing.file_hashes

    def dying_file_hashes(directory, *args, **kwargs):
        # A stage has written its files into its cache entry and not yet its stage.json: the worst moment to die.
        arm = os.environ.get(ARM)
        if arm and Path(directory).parent.name == "stages":
            try:
                os.unlink(arm)
            except FileNotFoundError:
                pass
            else:
                Path(arm + ".killed").write_text(str(directory))
                os._exit(1)
        return file_hashes(directory, *args, **kwargs)

    toolchain.hashing.file_hashes = dying_file_hashes
