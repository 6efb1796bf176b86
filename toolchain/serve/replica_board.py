"""The running replicas of ``dstc serve --replicas``, as the request router (replica_router.py) in this process last
saw them: Ray Serve tells a router which replicas run, with each one's routing stats (replica.py's
``record_routing_stats``), and nothing else in the process; ``/health`` and ``/metrics`` read them here.

A module of its own, which the router imports when it runs: Ray Serve hands the router class over by value
(cloudpickle), which gives its methods a copy of their module's globals, and sets the class's attributes again
each time it is handed over, so neither could hold this."""

from __future__ import annotations

from typing import Any

RUNNING: dict[str, list[Any]] = {}  # application name -> its RunningReplica objects
SEEN: dict[str, set[str]] = {}  # application name -> the ids of every replica of it that ran


def replaced(app_name: str, target: int) -> int:
    """Replicas that were replaced: more replicas ran than were asked for."""
    return max(0, len(SEEN.get(app_name, ())) - target)


def running_replicas(app_name: str) -> list[dict]:
    """The routing stats of the application's running replicas (``{}`` for one that has not reported yet)."""
    return [{"replica_id": r.replica_id.unique_id, **(r.routing_stats or {})} for r in RUNNING.get(app_name, [])]
