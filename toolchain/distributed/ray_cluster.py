"""Joining Ray: a local Ray started for this process, or a cluster at an address (dstc build --ray, dstc serve
--replicas)."""

from __future__ import annotations

import logging
import socket

from toolchain.errors import InputError

# Ray's driver retries an address that does not answer for minutes, silently: a CI job would hang on a typo
CONNECT_TIMEOUT_S = 10.0
RAY_CLIENT_PORT = 10001
# Ray's own retries of a task whose worker died (a build, a part of one); a task that raised is not retried (its
# error is the outcome)
MAX_RETRIES = 3


def check_reachable(address: str) -> None:
    """A one-line InputError when nothing listens at a HOST:PORT or ray://HOST[:PORT] address ("auto" and a
    local Ray are Ray's own to find)."""
    if address == "auto":
        return
    client = address.startswith("ray://")
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon:  # ray://HOST: the Ray client's port
        host, port = address.removeprefix("ray://"), str(RAY_CLIENT_PORT) if client else ""
    if not port.isdigit():
        raise InputError(f"--ray: {address!r} is not auto, HOST:PORT or ray://HOST[:PORT]")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise InputError(f"--ray: no Ray cluster at {address} ({e.strerror or e})") from None


def connect_ray(address: str | None, **options) -> bool:
    """Ray for this process: the cluster at ``address`` ("auto", "ray://HOST:PORT", "HOST:PORT") or, with None, a
    local Ray started with this machine's CPUs (``options`` go to ray.init). A Ray already initialised in this
    process is used as it is. True when this call started it (the caller shuts it down: ray.shutdown())."""
    import ray  # loaded when used: dstc starts without it

    if address:
        check_reachable(address)
    if ray.is_initialized():
        return False
    try:
        # "local": a new Ray of this machine's CPUs, never one found running here (ray.init(None) joins that)
        ray.init(address=address or "local", logging_level=logging.WARNING, **options)
    except (ConnectionError, ValueError) as e:
        where = f"at {address}" if address else "started on this machine"
        raise InputError(f"--ray: no Ray cluster {where} ({e})") from None
    return True
