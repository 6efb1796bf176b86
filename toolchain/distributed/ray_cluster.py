"""Joining Ray: a local Ray started for this process, or a cluster at an address (dstc build --ray, dstc serve
--replicas)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator

import psutil

from toolchain.errors import InputError

# Ray's driver retries an address that does not answer for minutes, silently: a CI job would hang on a typo
CONNECT_TIMEOUT_S = 10.0
RAY_CLIENT_PORT = 10001
# after ray.shutdown(), how long the local Ray's processes get to exit before they are killed
EXIT_GRACE_S = 3.0
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
    process is used as it is. True when this call started it (the caller shuts it down: shutdown_ray())."""
    import ray  # loaded when used: dstc starts without it

    if address:
        check_reachable(address)
    if ray.is_initialized():
        return False
    # Ray's driver otherwise installs Abseil's failure-signal handler, SIGTERM among its signals: the server's
    # SIGTERM printed a C++ stack dump ("SIGTERM received ... epoll_wait") and aborted the process (exit -6) before
    # it drained and shut Ray down. Read by ray.init; Ray's other processes keep theirs.
    ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        # "local": a new Ray of this machine's CPUs, never one found running here (ray.init(None) joins that)
        ray.init(address=address or "local", logging_level=logging.WARNING, **options)
    except (ConnectionError, ValueError) as e:
        where = f"at {address}" if address else "started on this machine"
        raise InputError(f"--ray: no Ray cluster {where} ({e})") from None
    return True


def shutdown_ray() -> None:
    """ray.shutdown() of the local Ray connect_ray started, then an end to every process of it still running.

    ray.shutdown() stops the processes the driver started (GCS, raylet, log monitor), and the raylet its workers
    and agents; a worker's own children are not Ray's to stop (a replica's engine process ignores SIGTERM), and
    nothing of Ray's may outlive dstc: its dashboard and runtime-env agents did, under PID 1 (~235 MB a run), when
    the server aborted. So this process's Ray processes and all their descendants are listed first, and those still
    running after a grace period are killed."""
    import ray

    started = _local_ray_processes(os.path.dirname(ray.__file__))
    ray.shutdown()
    _, left = psutil.wait_procs(started, timeout=EXIT_GRACE_S)
    for process in left:
        with contextlib.suppress(psutil.Error):  # gone meanwhile (psutil checks the pid was not reused)
            process.kill()
    psutil.wait_procs(left, timeout=EXIT_GRACE_S)


def _local_ray_processes(ray_dir: str) -> list[psutil.Process]:
    """This process's children that run a program of the ray package (gcs_server, raylet, the log monitor), with
    all their descendants (the raylet's agents and workers, a worker's own children)."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any(part.startswith(ray_dir) for part in child.cmdline()):
                found += [child, *child.children(recursive=True)]
    return found


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within it, SIGTERM to this process (on its main thread) is a SystemExit with the shell's code for it (143),
    so that the caller's ``finally`` shuts its local Ray down: by default SIGTERM ends Python at once, and Ray's
    processes could outlive it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def terminated(signum: int, frame) -> None:
        received.append(signum)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except SystemExit:
        if received:  # ray.get turns the exception raised in its wait into a SystemExit(1) of its own
            raise SystemExit(128 + received[0]) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
