"""A `dstc serve` child process for tests that talk to it over HTTP: started, waited for until /health answers,
and stopped (killed if it has not exited) when the test is done with it."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Server:
    process: subprocess.Popen
    url: str = ""
    log: list[str] = field(default_factory=list)  # its stderr, line by line


@contextlib.contextmanager
def running_server(argv, *, env: dict, cwd: Path, ready_timeout: float = 120) -> Iterator[Server]:
    """``argv`` (a `dstc serve ... --port 0` command line) started; yields once /health answers 200."""
    process = subprocess.Popen([str(a) for a in argv], cwd=cwd, env=env, text=True, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = Server(process)
    address = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            server.log.append(line)
            match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                server.url = f"http://127.0.0.1:{match.group(1)}"
                address.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not address.wait(0.2):
            assert process.poll() is None and time.monotonic() < deadline, "no address:\n" + "".join(server.log)
        while True:
            assert process.poll() is None, "the server exited:\n" + "".join(server.log)
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready:\n" + "".join(server.log)
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
        reader.join(10)
