"""Joining Ray: a local Ray started for this process, or a cluster at an address (dstc build --ray, dstc serve
--replicas)."""

from __future__ import annotations

import logging

from toolchain.errors import InputError


def connect_ray(address: str | None, **options) -> bool:
    """Ray for this process: the cluster at ``address`` ("auto", "ray://HOST:PORT", "HOST:PORT") or, with None, a
    local Ray started with this machine's CPUs (``options`` go to ray.init). A Ray already initialised in this
    process is used as it is. True when this call started it (the caller shuts it down: ray.shutdown())."""
    import ray  # loaded when used: dstc starts without it

    if ray.is_initialized():
        return False
    try:
        # "local": a new Ray of this machine's CPUs, never one found running here (ray.init(None) joins that)
        ray.init(address=address or "local", logging_level=logging.WARNING, **options)
    except (ConnectionError, ValueError) as e:
        where = f"at {address}" if address else "started on this machine"
        raise InputError(f"--ray: no Ray cluster {where} ({e})") from None
    return True
