"""A set of recipes built as Ray tasks, one task a recipe, on a local Ray started for the run or on a cluster.

Every task runs the same `run_one` as a build on one machine, so its artifact is the same bytes. The tasks share
the stage cache: the driver's DSTC_CACHE_DIR, which must be the same path on storage every node sees (and so must
the recipes, their files and the output directory). A worker that dies mid-task (killed, out of memory, its node
lost) has its task run again by Ray (max_retries); the stage cache never reuses an entry its dead writer left
without its stage.json and file hashes (toolchain/stages/runner.py), and an artifact is renamed into place only
once complete (toolchain/atomic.py), so the retried build writes what an uninterrupted one would have.
"""

from __future__ import annotations

import os

from toolchain.build_set import Job, LineEvents, Outcome, run_one, spread
from toolchain.cache import cache_dir
from toolchain.distributed.ray_cluster import MAX_RETRIES, connect_ray, shutdown_ray, sigterm_exits
from toolchain.distributed.ray_parts import RayParts

# the exit code of a recipe whose worker died on every try: a crashed process, as a crashed runtime's
CRASHED = 5
def _build_task(job: Job, model: str | None, use_cache: bool, env: dict[str, str], parts: int) -> Outcome:
    """Runs in a Ray worker: the driver's environment for dstc (the shared stage cache), then the build, its
    streamed compression in ``parts`` Ray tasks (1: in this one)."""
    os.environ.update(env)
    return run_one(job, model, use_cache, LineEvents(job.name), RayParts(parts) if parts > 1 else None)


def run_on_ray(jobs: list[Job], address: str | None, model: str | None, use_cache: bool,
               parts: int | None = None) -> list[Outcome]:
    """Build ``jobs`` as Ray tasks of one CPU each, on the cluster at ``address`` ("auto", "ray://HOST:PORT",
    "HOST:PORT") or, with None, on a local Ray started for the run with this machine's CPUs. A Ray already
    initialised in this process is used as it is and left running. A build whose compression is streamed writes
    its weights in ``parts`` Ray tasks, by layer range (None: as many as the cluster has CPUs; 1: unsplit)."""
    import ray  # loaded when used: dstc starts without it

    started = connect_ray(address)
    env = {"DSTC_CACHE_DIR": str(cache_dir().resolve()), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(_build_task)
    try:
        with sigterm_exits():
            if parts is None:
                parts = max(1, int(ray.cluster_resources().get("CPU", 1)))
            refs = {job: task.options(name=job.name).remote(job, model, use_cache, env, parts)
                    for job in spread(jobs)}
            return [_outcome(ray, job, refs[job]) for job in jobs]
    finally:
        if started:
            shutdown_ray()


def _outcome(ray, job: Job, ref) -> Outcome:
    try:
        return ray.get(ref)
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Outcome(job.name, job.out_dir, CRASHED,
                       f"its Ray worker died on each of {MAX_RETRIES + 1} tries ({first})")
    except ray.exceptions.RayTaskError as e:
        # a bug in the build (a DstcError is an outcome, not an exception): its traceback, as a local build shows it
        return Outcome(job.name, job.out_dir, 1, f"internal error in the build:\n{e}")

