"""Loaded into every Ray worker of tests/distributed/test_ray_builds.py (Ray's worker_process_setup_hook): a worker that
dies mid-stage, or mid-way through writing a part of a split compression, once, when the test arms it."""

from __future__ import annotations

import os
from pathlib import Path

# the file whose presence arms the hook; the worker that removes it dies
ARM = "DSTC_TEST_RAY_KILL_ARM"
# the same, for the worker writing a part of a split streamed compression: it dies after its part's first tensor
PART_ARM = "DSTC_TEST_RAY_KILL_PART_ARM"


def _disarm(variable: str, what: str) -> bool:
    """True for the one caller that removes the armed file (it records ``what`` beside it, then dies)."""
    arm = os.environ.get(variable)
    if not arm:
        return False
    try:
        os.unlink(arm)
    except FileNotFoundError:
        return False
    Path(arm + ".killed").write_text(what)
    return True


def install() -> None:
    # patched before the stage runner imports it: the runner's own name is this wrapper
    import toolchain.hashing

    file_hashes = toolchain.hashing.file_hashes

    def dying_file_hashes(directory, *args, **kwargs):
        # A stage has written its files into its cache entry and not yet its stage.json: the worst moment to die.
        if Path(directory).parent.name == "stages" and _disarm(ARM, str(directory)):
            os._exit(1)
        return file_hashes(directory, *args, **kwargs)

    toolchain.hashing.file_hashes = dying_file_hashes

    import onnx_ir.external_data as external_data

    write_tensor = external_data._write_tensor_with_budget_at

    def dying_write(tensor, file, offset, *args, **kwargs):
        # a part's file half-written (its first tensor in, under its temporary name): the worker dies
        write_tensor(tensor, file, offset, *args, **kwargs)
        if Path(file.name).name.startswith("part-") and offset == 0 and _disarm(PART_ARM, file.name):
            file.flush()
            os._exit(1)

    external_data._write_tensor_with_budget_at = dying_write
