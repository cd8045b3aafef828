"""`MarksDelivery`: whether decode's pending marks reached the prefill peers they went to.

The durable next turn (docs/design.md §4.10, "Delivery") needs a prefill to have recorded
decode's `pages_pending` before the client can send the turn that looks those pages up: the
mark travels decode control thread → ZMQ → prefill control thread while the answer travels
engine → HTTP → client → prefill's HTTP side, and nothing orders the two (on a loaded host the
next turn's lookup was measured to win). So `KVReceiver.announce_pending` sends a `Ping`
right behind the marks on each link; the prefill's control thread handles one link's frames
in order, so its `Pong` says the marks are recorded. The decode engine holds the request's
last output until the delivery is done.

A `Pong` says the prefill handled the frames before the ping: a registered decode's marks are
recorded then; a prefill that no longer knows the decode (it restarted without a cluster
secret) drops them but still answers, and waiting longer would not bring them back.

A delivery is done once every peer it waits for answered, was dropped or declared lost, at
the receiver's `pending_ack_timeout_s` (seen at its next control tick, <= 0.25 s later), or
when the receiver closes. One-shot;
callbacks run once, on the thread that completes it (the decode control thread, or the
caller of `add_done_callback` when it is already done), and must not block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class MarksDelivery:
    """The acknowledgement of one announcement; see the module docstring. Its peers are
    registered (`expect`) and answered (`answered`, `drop`) on the receiver's control thread;
    `finish` and `add_done_callback` on any thread. `_lock` guards every field."""

    def __init__(self) -> None:
        self.created = time.monotonic()
        self._lock = threading.Lock()
        self._waiting: dict[bytes, int] = {}  # link id -> seq of the ping that answers for it
        self._sealed = False  # every peer it waits for is registered
        self._expected = False  # some peer was waited for (else nobody was there to answer)
        self._done = False
        self._callbacks: list[Callable[[], None]] = []
        self.answered_s: float | None = None  # creation to the last answer (None: not so)
        self.timed_out = False

    @classmethod
    def completed(cls) -> MarksDelivery:
        """A delivery with nobody to wait for (no peer, or the receiver is closing)."""
        delivery = cls()
        delivery.seal()
        return delivery

    @property
    def done(self) -> bool:
        with self._lock:
            return self._done

    def expect(self, link_id: bytes, seq: int) -> None:
        """Wait for the peer on `link_id` to answer ping `seq` (before `seal`)."""
        with self._lock:
            self._waiting[link_id] = seq
            self._expected = True

    def seal(self) -> None:
        """Every peer is registered: done now if none is waited for."""
        with self._lock:
            self._sealed = True
            ready, answered = not self._waiting, self._expected
        if ready:
            self._finish(answered=answered)

    def answered(self, link_id: bytes, seq: int) -> bool:
        """The peer on `link_id` answered ping `seq`: a pong answers every ping sent before it
        on that link. True when this completed the delivery."""
        with self._lock:
            expected = self._waiting.get(link_id)
            if expected is None or seq < expected:
                return False
            del self._waiting[link_id]
            ready = self._sealed and not self._waiting
        return ready and self._finish(answered=True)

    def drop(self, link_id: bytes) -> bool:
        """The peer on `link_id` is gone: stop waiting for it. True when this completed it."""
        with self._lock:
            if self._waiting.pop(link_id, None) is None:
                return False
            ready = self._sealed and not self._waiting
        return ready and self._finish(answered=False)

    def finish(self, timed_out: bool = False) -> bool:
        """Stop waiting (the deadline, the receiver closing). True when this completed it."""
        return self._finish(answered=False, timed_out=timed_out)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the delivery is done (at once, here, if it is)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout_s: float) -> bool:
        """Block until done or `timeout_s` passed; whether it is done."""
        event = threading.Event()
        self.add_done_callback(event.set)
        return event.wait(timeout_s)

    def _finish(self, answered: bool, timed_out: bool = False) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done, self.timed_out = True, timed_out
            if answered:
                self.answered_s = time.monotonic() - self.created
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # one caller's failure must not keep the others waiting
                logger.exception("a marks delivery callback raised")
        return True
