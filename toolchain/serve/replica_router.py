"""Which replica of ``dstc serve --replicas N`` takes a request: Ray Serve's request router API (a ``RequestRouter``
subclass named in the deployment's ``request_router_config``), by prompt-prefix affinity within a bound on load.

``choose_replicas`` ranks the replicas; Ray Serve then sends the request to the one of the first rank with the
fewest requests in flight (its queue-length cache and probes, which also hold a request back while every replica
is at ``max_ongoing_requests``). The ranks:

1. the replica that served the longest prefix of this prompt (whole blocks of ``block_tokens`` token ids, as a
   prefix cache keeps them), if it has one and has at most ``max_imbalance`` requests more than the least loaded;
2. the replicas whose KV cache is below ``kv_full`` (each replica's own figure, from its ``record_routing_stats``);
3. every replica.

A replica that reports its engine dead (its ``state``) is left out while another is there.

Why not Ray's ``PrefixCacheAffinityRouter`` (ray.serve.llm): it matches prompt text, which this server has only
as token ids once tokenized (chat templates applied), keeps its prefix tree in a detached actor asked with a
blocking ``ray.get`` for every request, and weighs queue length but not KV-cache use. One router, in the
``dstc serve`` process, routes every request here, so its own table of each replica's recent prefixes is the whole
picture.

The router also leaves the running replicas it was last given in replica_board.py, where the server reads them for
``/health`` and ``/metrics``.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Mapping

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica


def block_hashes(prompt: list[int], block_tokens: int) -> list[Hashable]:
    """One hash per whole block of the prompt, each covering the prompt up to the block's end."""
    hashes: list[Hashable] = []
    previous: Hashable = None
    for end in range(block_tokens, len(prompt) + 1, block_tokens):
        previous = hash((previous, tuple(prompt[end - block_tokens:end])))
        hashes.append(previous)
    return hashes


class LoadPrefixRouter(FIFOMixin, RequestRouter):
    # Ray Serve passes request_router_kwargs as keywords (its own routers name them so too)
    def initialize_state(self, block_tokens: int = 16, max_blocks: int = 1 << 16,  # type: ignore[override]
                         max_imbalance: int = 4, kv_full: float = 0.9) -> None:
        self._block_tokens = block_tokens
        self._max_blocks = max_blocks  # per replica, least recently used dropped first
        self._max_imbalance = max_imbalance
        self._kv_full = kv_full
        self._prefixes: dict[ReplicaID, collections.OrderedDict[Hashable, None]] = {}

    def _prompt(self, pending_request: PendingRequest | None) -> list[int] | None:
        args = pending_request.args if pending_request is not None else None
        return args[0] if args and isinstance(args[0], list) else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # a replica whose engine died is left out until Ray Serve's health check replaces it
        candidate_replicas = [r for r in candidate_replicas if (r.routing_stats or {}).get("state", "ready") ==
                              "ready"] or candidate_replicas
        if not candidate_replicas:
            return []
        roomy = [r for r in candidate_replicas if (r.routing_stats or {}).get("kv_cache_usage", 0.0) < self._kv_full]
        roomy = roomy or candidate_replicas
        ranks = [roomy, candidate_replicas]
        prompt = self._prompt(pending_request)
        if prompt is None:
            return ranks
        hashes = block_hashes(prompt, self._block_tokens)
        loads = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in roomy}
        least = min(loads.values())
        best, longest = None, 0
        for replica in roomy:
            if loads[replica.replica_id] - least > self._max_imbalance:
                continue
            held: Mapping[Hashable, None] = self._prefixes.get(replica.replica_id, {})
            matched = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if matched > longest:
                best, longest = replica, matched
        return [[best], *ranks] if best is not None else ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        prompt = self._prompt(pending_request)
        if prompt is None:
            return
        held = self._prefixes.setdefault(replica_id, collections.OrderedDict())
        for h in block_hashes(prompt, self._block_tokens):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self._max_blocks:
            held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in set(self._prefixes) - live:
            del self._prefixes[gone]
        if self._deployment_id is not None:
            # the process's own module at call time, not the copy of its globals this method was handed with
            from toolchain.serve import replica_board

            app = self._deployment_id.app_name
            replica_board.RUNNING[app] = list(replicas)
            replica_board.SEEN.setdefault(app, set()).update(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._prefixes.pop(replica_id, None)
        if self._deployment_id is not None:
            # the process's own module at call time, not the copy of its globals this method was handed with
            from toolchain.serve import replica_board

            app, running = self._deployment_id.app_name, replica_board.RUNNING
            running[app] = [r for r in running.get(app, []) if r.replica_id != replica_id]
