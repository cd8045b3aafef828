"""Authenticated ZMQ messages: a keyed BLAKE3 MAC per message with a replay window.

Used by the transfer control plane (`pdcache.transfer`, key purpose "zmq-control") and the
metadata service (purpose "metadata"); the key is `pdcache.utils.secret.derive_key(secret,
purpose)`. A sealed message is the message followed by a 56-byte trailer:

    message || timestamp (u64 ns, little-endian) || nonce (16 random bytes) || MAC (32 bytes)

MAC = keyed BLAKE3 over `label || timestamp || nonce || message`, where `label` names the
sending side (e.g. b"prefill", b"decode"), so a message cannot be reflected back at its
sender. A `context` given to `seal`/`open_` (e.g. the nonce of the request a reply answers,
`nonce_of`) is MAC'd too, length-prefixed after the label, and is not sent: the receiver
must expect the same context, so a reply cannot be fed to another request. `open_` accepts a message only if its MAC verifies, its timestamp is within
`window_s` of this host's clock (hosts must keep their clocks within that, e.g. with NTP) and
its nonce was not seen in the window (a replay). Chosen over CurveZMQ by measured cost
(docs/security.md): the per-message cost is a few microseconds, and it needs no handshake,
no ZAP thread and no per-socket key setup.

Thread-safe: the nonce set has a lock. Not a secrecy mechanism: messages stay readable on the
wire (they carry page ids and addresses, not KV or prompts).
"""

from __future__ import annotations

import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

_STAMP = struct.Struct("<Q")
NONCE_BYTES = 16
MAC_BYTES = 32
TRAILER_BYTES = _STAMP.size + NONCE_BYTES + MAC_BYTES
DEFAULT_WINDOW_S = 60.0
MAX_NONCES = 1 << 20  # nonces remembered at once; beyond it new messages are refused


class AuthError(ValueError):
    """A message that is not authentic. `kind` is "unauthenticated" (no or a bad MAC: another
    secret, a forgery, a truncated trailer), "stale" (outside the window) or "replayed"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


AUTH_REJECT_KINDS = ("unauthenticated", "stale", "replayed")


def nonce_of(sealed: bytes | memoryview) -> bytes:
    """The nonce in the trailer of a sealed message (b"" if it has no trailer): the context a
    reply to it is sealed with."""
    if len(sealed) < TRAILER_BYTES:
        return b""
    return bytes(memoryview(sealed)[-TRAILER_BYTES + _STAMP.size : -MAC_BYTES])


class MessageAuth:
    """Seals messages this side sends (as `label`) and opens those `peer_label` sent."""

    def __init__(
        self,
        key: bytes,
        label: bytes,
        peer_label: bytes,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if len(key) != 32:
            raise ValueError(f"message auth keys are 32 bytes, got {len(key)}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        import blake3  # a dependency of pdcache; loaded only with a secret

        self._blake3 = blake3.blake3
        self._key = key
        self._label = label
        self._peer_label = peer_label
        self._window_ns = int(window_s * 1e9)
        self._clock = clock
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> timestamp, oldest first
        self._lock = threading.Lock()

    def _mac(
        self, label: bytes, stamp_nonce: bytes, message: bytes | memoryview, context: bytes
    ) -> bytes:
        state = self._blake3(label, key=self._key)
        if context:  # length-prefixed, so label/context/stamp boundaries cannot shift
            state.update(_STAMP.pack(len(context)) + context)
        state.update(stamp_nonce)
        state.update(message)
        return state.digest()

    def seal(self, message: bytes, context: bytes = b"") -> bytes:
        stamp_nonce = _STAMP.pack(self._clock()) + os.urandom(NONCE_BYTES)
        return message + stamp_nonce + self._mac(self._label, stamp_nonce, message, context)

    def open_(self, sealed: bytes | memoryview, context: bytes = b"") -> bytes:
        """The message inside `sealed` (sealed with this `context`), or AuthError (see the
        class docstring)."""
        if len(sealed) < TRAILER_BYTES:
            raise AuthError("unauthenticated", f"{len(sealed)} bytes: no authentication trailer")
        view = memoryview(sealed)
        body = view[:-TRAILER_BYTES]
        stamp_nonce = bytes(view[-TRAILER_BYTES:-MAC_BYTES])
        if not hmac.compare_digest(
            self._mac(self._peer_label, stamp_nonce, body, context), bytes(view[-MAC_BYTES:])
        ):
            raise AuthError("unauthenticated", "MAC does not verify (another secret?)")
        (stamp,) = _STAMP.unpack_from(stamp_nonce)
        now = self._clock()
        if abs(now - stamp) > self._window_ns:
            raise AuthError("stale", f"timestamp {(now - stamp) / 1e9:+.1f}s off, outside window")
        self._remember(stamp_nonce[_STAMP.size :], stamp, now)
        return bytes(body)

    def _remember(self, nonce: bytes, stamp: int, now: int) -> None:
        with self._lock:
            # forget nonces whose messages are now outside the window (they would be stale)
            while self._seen:
                oldest, seen_stamp = next(iter(self._seen.items()))
                if now - seen_stamp <= self._window_ns:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                raise AuthError("replayed", "nonce seen before inside the window")
            if len(self._seen) >= MAX_NONCES:
                raise AuthError("replayed", "replay cache full; refusing until it drains")
            self._seen[nonce] = stamp

    @property
    def remembered(self) -> int:
        with self._lock:
            return len(self._seen)
