"""One build's streamed compression split over Ray workers: each part (a range of decoder layers,
toolchain/stages/compress_parts.py) a Ray task of one CPU that reads its weights from the checkpoint and writes its
part of the weights file into the stage's temporary directory in the shared stage cache; the build that started
them assembles the parts into the bytes one process writes.

A part's worker that dies (killed, out of memory, its node lost) has its part run again by Ray (``max_retries``),
perhaps on another node: a part is renamed into place only once complete, and the assembly checks each part's size
and BLAKE3 against what its finished task returned, so what a dead worker left is never read. A build blocked on
its parts holds no CPU (Ray lends it to the tasks it waits for), so the parts of a build that is itself a Ray task
(dstc build --ray) run beside it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from toolchain.distributed.ray_cluster import MAX_RETRIES
from toolchain.errors import RuntimeCrashError
from toolchain.stages.compress_parts import Log, PartFile, PartTask


def _part_task(work: Callable[[PartTask, Log], PartFile], task: PartTask) -> PartFile:
    """Runs in a Ray worker: its progress lines go to the driver, which relays them prefixed with the task."""
    return work(task, lambda line: print(line, file=sys.stderr, flush=True))


class RayParts:
    """A PartRunner of ``count`` parts, each a Ray task on the cluster this process has joined."""

    def __init__(self, count: int) -> None:
        self.count = count

    def run(self, work: Callable[[PartTask, Log], PartFile], tasks: list[PartTask], log: Log) -> list[PartFile]:
        import ray  # loaded when used: dstc starts without it

        remote = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(_part_task)
        refs = {remote.options(name=f"compress {task.part.title}").remote(work, task): task for task in tasks}
        files: dict[int, PartFile] = {}
        pending = list(refs)
        try:
            while pending:
                (ref,), pending = ray.wait(pending, num_returns=1)
                files[refs[ref].part.index] = file = _result(ray, ref, refs[ref])
                log(f"{refs[ref].part.title} written: {file.size / 1e6:.1f} MB in {file.seconds:.1f} s "
                    f"({len(files)} of {len(tasks)} parts)")
        except BaseException:
            for other in pending:  # nothing is to write into the stage's directory once it is removed
                ray.cancel(other, force=True)
            raise
        return [files[task.part.index] for task in tasks]


def _result(ray, ref, task: PartTask) -> PartFile:
    """The part's file; a DstcError its task raised is raised as it is (Ray's error is an instance of it)."""
    try:
        return ray.get(ref)
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeCrashError(f"{task.part.title} of the streamed compression: its Ray worker died on each of "
                                f"{MAX_RETRIES + 1} tries ({first})") from None
