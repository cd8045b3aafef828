"""The control thread: one thread that owns a set of ZeroMQ sockets.

ZeroMQ sockets are not thread-safe, so every socket of the control plane (the prefill's
bootstrap ROUTER, decode's DEALERs) is created, read, written and closed on this thread only.
Other threads hand it work with `call_soon(fn)` (a queue plus a wake-up pipe polled next to
the sockets), so sending a message from the scheduler or a transfer worker never touches a
socket directly. `on_tick` runs at least every `tick_s` for heartbeats and deadlines.
Exceptions in handlers are logged and counted; the thread keeps running.

Authentication (docs/security.md): with a cluster secret, every control frame is sealed with
`pdcache.utils.message_auth.MessageAuth` (a keyed BLAKE3 MAC, a timestamp and a nonce);
`parse` opens it before decoding and counts a frame that is unauthenticated, stale or
replayed as a rejection of that kind, like a malformed one: dropped, and the node serves on.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdcache.transfer.messages import Message, MessageError, Register, decode, encode
from pdcache.utils.message_auth import TRAILER_BYTES, AuthError, MessageAuth

logger = logging.getLogger(__name__)

Handler = Callable[[zmq.Socket], None]


class ControlLoop:
    """Owns sockets and runs their handlers on one thread; see the module docstring."""

    def __init__(self, name: str, tick_s: float, on_tick: Callable[[], None]) -> None:
        self.name = name
        self.ctx = zmq.Context.instance()
        self._tick_s = tick_s
        self._on_tick = on_tick
        self._handlers: dict[zmq.Socket, Handler] = {}
        self._poller = zmq.Poller()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._stop = threading.Event()
        self._wake_lock = threading.Lock()  # the pipe is closed once, never written after
        self._thread = threading.Thread(target=self._run, name=f"pdcache-{name}", daemon=True)
        self.errors = 0

    # ---- any thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the control thread (FIFO order)."""
        self._calls.put(fn)
        with self._wake_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass  # pipe full: the thread is awake anyway

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; sockets are closed with linger 0. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.call_soon(lambda: None)
        if self._thread.is_alive() and not self.on_thread():
            self._thread.join(timeout_s)
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1

    # ---- control thread only ---------------------------------------------------------------
    def add_socket(self, sock: zmq.Socket, handler: Handler) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket, linger_ms: int = 0) -> None:
        if sock in self._handlers:
            del self._handlers[sock]
            self._poller.unregister(sock)
        sock.close(linger=linger_ms)

    def _run(self) -> None:
        timeout_ms = max(1, int(self._tick_s * 1000))
        while not self._stop.is_set():
            self._guard(self._poll_once, timeout_ms)
            self._guard(self._on_tick)
        self._run_calls()  # flush messages queued before stop (e.g. aborts at shutdown)
        for sock in list(self._handlers):
            self._poller.unregister(sock)
            sock.close(linger=200)
        self._handlers.clear()

    def _poll_once(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            self._drain_wake()
        self._run_calls()
        for sock, handler in list(self._handlers.items()):
            if sock in events:
                self._drain_socket(sock, handler)

    def _drain_socket(self, sock: zmq.Socket, handler: Handler) -> None:
        # Bounded so one chatty peer cannot starve the others or the tick.
        for _ in range(256):
            if sock not in self._handlers or not sock.poll(0, zmq.POLLIN):
                return
            self._guard(handler, sock)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            self._guard(fn)

    def _guard(self, fn: Callable, *args: object) -> None:
        try:
            fn(*args)
        except zmq.ContextTerminated:
            self._stop.set()
        except Exception:
            self.errors += 1
            logger.exception("%s: control handler failed (thread keeps running)", self.name)


class RejectCounter:
    """Counts rejected control messages per kind and logs them, rate-limited. `record` may run
    on any thread (control thread, workers); `snapshot` copies under the same lock."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, err: MessageError, origin: str) -> None:
        with self._lock:
            total = sum(self.counts.values())
            self.counts[err.kind] = self.counts.get(err.kind, 0) + 1
        if total < 20 or total % 1000 == 0:
            logger.warning("%s: rejected control message from %s: %s", self.side, origin, err)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


CONTROL_KEY_PURPOSE = "zmq-control"  # derive_key(secret, CONTROL_KEY_PURPOSE) -> control_key


def control_auth(control_key: bytes | None, side: str) -> MessageAuth | None:
    """The sealer of the side ("prefill" | "decode") that sends, or None without a key."""
    if control_key is None:
        return None
    peer = {"prefill": "decode", "decode": "prefill"}[side]
    return MessageAuth(control_key, side.encode(), peer.encode())


LINK_ID_BYTES = 16  # a decode's per-boot random ZMQ routing id, one per prefill peer


def seal(msg: Message, auth: MessageAuth | None, link_id: bytes = b"") -> bytes:
    """`msg` encoded, and sealed when the control plane is authenticated, with MAC context
    `link_id` (docs/security.md), which binds the frame to one link in one direction:
    - prefill → decode: the receiving decode socket's routing id (a random per-boot id the
      decode chose, `LINK_ID_BYTES`);
    - decode → prefill: that same routing id followed by the prefill's per-boot id (from its
      RegisterAck). Only `Register`, sent before the decode knows the boot id, is sealed with
      the routing id alone.
    So a frame sealed for one node, or for a node before its restart, opens on no other."""
    frame = encode(msg)
    return frame if auth is None else auth.seal(frame, context=link_id)


def parse(
    frame: bytes,
    max_bytes: int,
    rejects: RejectCounter,
    origin: str,
    auth: MessageAuth | None = None,
    link_id: bytes = b"",
) -> Message | None:
    """Open (when authenticated, expecting MAC context `link_id`: see `seal`) and decode a
    frame; on failure count it and return None (the caller keeps serving)."""
    try:
        if auth is not None:
            if len(frame) > max_bytes + TRAILER_BYTES:  # never hash an oversized frame
                raise MessageError("oversized", f"{len(frame)} bytes > limit {max_bytes}")
            try:
                frame = auth.open_(frame, context=link_id)
            except AuthError as err:
                raise MessageError(err.kind, str(err)) from None
        return decode(frame, max_bytes)
    except MessageError as err:
        rejects.record(err, origin)
        return None


@dataclass(frozen=True)
class StaleBoot:
    """A genuine decode frame (its MAC verifies) bound to another boot of a prefill than this
    one: the decode still believes in a prefill process that is gone (a fast restart on the
    same address) or captured for another prefill. The prefill answers only as to an
    unregistered peer (docs/security.md "Transfer: prefill binding")."""

    msg: Message
    claimed_boot: bytes


def parse_from_decode(
    frame: bytes,
    max_bytes: int,
    rejects: RejectCounter,
    auth: MessageAuth | None,
    identity: bytes,
    boot_id: bytes,
    claimed_boot: bytes | None = None,
) -> Message | StaleBoot | None:
    """`parse` for the prefill side: a frame must open under this link and boot (`seal`);
    one that opens under the link alone is accepted only if it is a `Register`.

    `claimed_boot` is the boot id the decode sent in clear next to the sealed frame (the
    boot it sealed for, `claimed_boot_frame`). Another boot than `boot_id`: the frame is
    opened under link + claimed boot; if it verifies it is counted `stale_boot` and returned
    as `StaleBoot` (the caller answers "unregistered"), else `unauthenticated` as any forgery."""
    if auth is None:
        return parse(frame, max_bytes, rejects, "decode")
    if len(frame) > max_bytes + TRAILER_BYTES:  # never hash an oversized frame
        rejects.record(MessageError("oversized", f"{len(frame)} bytes > limit {max_bytes}"),
                       "decode")
        return None
    if claimed_boot is not None and claimed_boot != boot_id:
        return _parse_stale_boot(frame, max_bytes, rejects, auth, identity, claimed_boot)
    for context in (identity + boot_id, identity):
        try:
            opened = auth.open_(frame, context=context)
        except AuthError as err:
            if err.kind == "unauthenticated" and context != identity:
                continue  # not bound to this boot: perhaps a Register
            rejects.record(MessageError(err.kind, str(err)), "decode")
            return None
        msg = parse(opened, max_bytes, rejects, "decode")
        if msg is None or context != identity or isinstance(msg, Register):
            return msg
        rejects.record(MessageError("unauthenticated", f"{msg.TYPE} not bound to this boot"),
                       "decode")
        return None
    return None


def _parse_stale_boot(frame: bytes, max_bytes: int, rejects: RejectCounter,
                      auth: MessageAuth, identity: bytes, claimed_boot: bytes,
                      ) -> StaleBoot | None:
    if len(claimed_boot) != LINK_ID_BYTES:
        rejects.record(MessageError("malformed", f"boot id of {len(claimed_boot)} bytes"),
                       "decode")
        return None
    try:
        opened = auth.open_(frame, context=identity + claimed_boot)
    except AuthError as err:
        rejects.record(MessageError(err.kind, str(err)), "decode")
        return None
    msg = parse(opened, max_bytes, rejects, "decode")
    if msg is None:
        return None
    rejects.record(MessageError("stale_boot", f"{msg.TYPE} sealed for another prefill boot"),
                   "decode")
    return StaleBoot(msg, claimed_boot)


__all__ = ["ControlLoop", "RejectCounter", "StaleBoot", "control_auth", "encode", "parse",
           "parse_from_decode", "seal"]
