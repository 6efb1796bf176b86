"""API keys: which keys the server takes, whether a request carries one, and whether an address may be served
without any.

Clients send a key as OpenAI's do, ``Authorization: Bearer KEY`` (what vLLM's and llama.cpp's servers take too). A key
is compared in constant time with every accepted key. An address other than the loopback's (127.0.0.0/8, ::1,
``localhost``) is reachable from other machines: serving it without a key is refused unless asked for.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from toolchain.errors import InputError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without a key (no request data; for probes and scrapers)


def _checked(key: str, where: str) -> str:
    # RFC 6750's bearer token characters are a subset of visible ASCII; a key with others could not be sent as is
    if not key or not all("!" <= c <= "~" for c in key):
        raise InputError(f"{where}: an API key must be visible ASCII characters, without spaces")
    return key


def load_api_keys(key: str | None, key_file: Path | None) -> list[str]:
    """The accepted keys: ``key`` and each non-empty line of ``key_file`` (one per line, so that a key can be rotated
    without a moment where neither works); InputError for an unreadable file, a file without keys or a bad key."""
    keys = [] if key is None else [_checked(key.strip(), "--api-key")]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise InputError(f"cannot read the API key file {key_file}: {reason}") from None
        from_file = [_checked(line.strip(), f"{key_file}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
        if not from_file:
            raise InputError(f"the API key file {key_file} holds no key")
        keys += from_file
    return keys


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_exposure(host: str, keys: Sequence[str], allow_unauthenticated: bool) -> None:
    """InputError when ``host`` is reachable from other machines, no key is set and that was not asked for."""
    if keys or allow_unauthenticated or is_loopback(host):
        return
    raise InputError(f"--host {host} is reachable from other machines and no API key is set: give --api-key or "
                     f"--api-key-file (clients send it as Authorization: Bearer KEY), or --allow-unauthenticated")


def authorized(header: bytes | None, keys: Sequence[str]) -> bool:
    """Whether an ``Authorization`` header value carries one of ``keys`` as a bearer token."""
    scheme, _, token = (header or b"").strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    given = token.strip()
    match = False
    for key in keys:  # every key compared, each in constant time: the time taken tells nothing of which or how close
        match |= hmac.compare_digest(given, key.encode("ascii"))
    return match
