"""The cluster secret: one file of random bytes shared by every process of a deployment.

Each use derives its own key with BLAKE3's key-derivation mode (`derive_key(secret, purpose)`),
so a key leaked from one use (say, the pages' MAC key) does not reveal another (the node HTTP
credential), and rotating the secret file rotates them all. Pure functions, no state.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
_CONTEXT_PREFIX = "pdcache 2026-12 "  # BLAKE3 wants a hard-coded, globally unique context


class SecretError(ValueError):
    """A secret file that is missing, too short or readable by other users."""


def create_secret(path: str | Path) -> Path:
    """Write a new random secret to `path` (mode 0600, created exclusively: an existing file
    is never overwritten). Returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(SECRET_BYTES).hex().encode() + b"\n")
    return target


def load_secret(path: str | Path) -> bytes:
    """The secret in `path`: its bytes with surrounding whitespace stripped. Refuses a file that
    other users may read (like ssh does for private keys) and one shorter than 16 bytes."""
    source = Path(path)
    try:
        info = source.stat()
        data = source.read_bytes().strip()
    except OSError as exc:
        raise SecretError(f"cannot read the cluster secret {source}: {exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"cluster secret {source} is accessible by other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}); run: chmod 600 {source}"
        )
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(
            f"cluster secret {source} holds {len(data)} bytes; it needs at least "
            f"{MIN_SECRET_BYTES} (create one with: pdcache secret create PATH)"
        )
    return data


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one `purpose` (e.g. "page-mac", "node-http", "zmq-control")."""
    import blake3  # light, but only deployments with a secret need it

    return blake3.blake3(secret, derive_key_context=_CONTEXT_PREFIX + purpose).digest()
