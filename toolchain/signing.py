"""Ed25519 signatures over an artifact's manifest.json, so that a CI can prove an artifact was built by it.

manifest.json holds the sha256 of every artifact file and a digest of itself, so one signature over its bytes
covers the whole artifact. The signature is written beside it as ``manifest.json.sig`` (base64 text), once every
file is checked against the manifest (toolchain/manifest.py sign_artifact). Keys are PEM files, as
`openssl genpkey -algorithm ed25519` writes them (or ``generate_keys``).
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from toolchain.errors import InputError
from toolchain.interface.files import MANIFEST, SIGNATURE


def _read_pem(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None


def load_private_key(path: Path):
    """The Ed25519 private key of a PEM file (InputError in one line for anything else)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(_read_pem(path, "private key"), password=None)
    except (ValueError, TypeError) as e:
        raise InputError(f"{path} is not an unencrypted PEM private key: {str(e).splitlines()[0]}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InputError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(path: Path):
    """The Ed25519 public key of a PEM file (InputError in one line for anything else)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(_read_pem(path, "public key"))
    except (ValueError, TypeError) as e:
        raise InputError(f"{path} is not a PEM public key: {str(e).splitlines()[0]}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InputError(f"{path} is not an Ed25519 public key")
    return key


def generate_keys(private_path: Path, public_path: Path) -> None:
    """A new Ed25519 key pair as PEM files (the private one readable by its owner only); existing files are
    refused rather than overwritten."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    for path in (private_path, public_path):
        if Path(path).exists():
            raise InputError(f"{path} exists; dstc does not overwrite keys")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private)
        Path(public_path).write_bytes(public)
    except OSError as e:
        raise InputError(f"cannot write the keys: {e.strerror} ({e.filename})") from None


def write_signature(manifest: Path, key) -> Path:
    """``manifest``'s signature by ``key`` (a loaded private key) written beside it, replacing any earlier one at
    once (a reader sees the old signature or the new one); returns its path."""
    signature = base64.b64encode(key.sign(Path(manifest).read_bytes())).decode() + "\n"
    target = Path(manifest).with_name(SIGNATURE)
    tmp = target.with_name(f".{SIGNATURE}.tmp-{os.getpid()}")
    try:
        tmp.write_text(signature)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write {target}: {e.strerror}") from None
    return target


def verify_signature(manifest: Path, signature: Path, public_key: Path) -> list[str]:
    """[] when ``signature`` is a valid signature of ``manifest`` by ``public_key``, else the problem."""
    from cryptography.exceptions import InvalidSignature

    key = load_public_key(public_key)
    if not Path(signature).is_file():
        return [f"unsigned: no {SIGNATURE} (run dstc sign)"]
    try:
        key.verify(base64.b64decode(Path(signature).read_text().strip(), validate=True), Path(manifest).read_bytes())
    except (InvalidSignature, ValueError):
        return [f"bad signature: {SIGNATURE} is not a signature of {MANIFEST} by {public_key}"]
    return []
