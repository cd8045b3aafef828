"""Decode side of the pull of pending pages (docs/design.md §4.10, control protocol v5).

A prefill node waiting for pages decode announced as being written (`PagesPending`) may pull
them from decode's host staging instead (`PullPages`). `PullServer` answers those pulls with the
staged page objects of a `StagedPageSource` (the node's `DecodeOffloadManager`), on a worker
thread of its own (`pdcache-decode-pull`): it copies and MACs pages, which must not hold up the
control thread. Answers (`PagesPulled`) leave through the owner's `send` (`KVReceiver`: queued
to its control thread with `call_soon`).

Lifecycle: `serve(source, authenticated)` once, before `start()` (it decides whether pulls are
offered at all: `offered`); `start()` starts the worker when they are; `submit()` (control
thread) queues a pull or refuses it (never blocks); `close()` drops queued pulls (their prefill
falls back to waiting for the write), stops the worker and joins it (5 s at most). `submit()`
refuses everything once `close()` began.

Owns the pull queue (bounded: `MAX_QUEUED_PULLS`) and the worker. Mutates only the
`pull_pages_served`, `pull_pages_unavailable` and `pull_pages_expired` keys of the owner's
`counters` (the worker is their only writer) and each link's `pull_credit` (a semaphore). No
lock of its own: the queue is thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pdcache.transfer.messages import (
    PAGE_KEY_BYTES,
    PULLED_OVERHEAD_BYTES,
    PagesPulled,
    PullPages,
    pack_keys,
)

logger = logging.getLogger(__name__)

PULL_FRAMES_PER_LINK = 4  # pull answer frames queued per link at most (`PullLink.pull_credit`)
MAX_QUEUED_PULLS = 64  # pulls waiting for the worker; more are refused


class StagedPageSource(Protocol):
    """Pages decode still holds in host staging while their storage write runs (the node's
    `DecodeOffloadManager`): `staged_objects(keys, until)` gives each key's stored page object
    (page_format: header + payload, MAC'd when the store has a page key) or None when it is not
    staged; a key scheduled but not copied yet is waited for until `until` (monotonic). It
    pins the pages it reads against free-on-write-end. `sealed`: the objects carry the page
    MAC. Thread-safe."""

    object_bytes: int
    sealed: bool

    def staged_objects(self, keys: list[bytes], until: float = 0.0) -> list[bytes | None]: ...


class PullLink(Protocol):
    """The link a pull came in on: `pull_credit` holds one permit per answer frame that may be
    queued for it and not sent yet (`PULL_FRAMES_PER_LINK`); the owner's `send` releases the
    permit once the frame left (or was dropped), so a pull backlog can never hold more than
    that many frames ahead of a heartbeat on the link."""

    pull_credit: threading.Semaphore


SendPulled = Callable[[PullLink, PagesPulled], None]  # any thread; releases the link's credit


def unavailable(pull_id: int, keys: list[bytes]) -> PagesPulled:
    """The answer "none of these is available" (one frame: 33 bytes a key)."""
    return PagesPulled(pull_id, pack_keys(keys), bytes(len(keys)), 0, b"")


class PullServer:
    """Answers queued `PullPages` from a `StagedPageSource` on its worker thread (module
    docstring). `counters`: the owner's counter dict (its pull worker keys are written here)."""

    def __init__(self, max_message_bytes: int, send: SendPulled,
                 counters: dict[str, int | float]) -> None:
        self.max_message_bytes = max_message_bytes
        self.offered = False  # pending marks offer the pull (`serve`)
        self._send = send
        self._counters = counters
        self._source: StagedPageSource | None = None
        self._queue: queue.Queue[tuple[PullLink, PullPages, float] | None] = queue.Queue(
            maxsize=MAX_QUEUED_PULLS)
        self._worker: threading.Thread | None = None
        self._started = False
        self._closing = threading.Event()

    def serve(self, source: StagedPageSource | None, authenticated: bool) -> None:
        """Answer pulls from `source` (before `start()`; RuntimeError after). Pulls are offered
        only when they can be served safely: the control plane is `authenticated` and
        `source`'s pages carry the page MAC (both keyed by the cluster secret; without them a
        forged answer could not be told from decode's), and one page object fits in an answer
        frame (`max_message_bytes`). Otherwise every pull is refused."""
        if self._started:
            raise RuntimeError("serve_pulls must be called before start()")
        self._source = source
        self.offered = False
        if source is None:
            return
        room = self.max_message_bytes - PULLED_OVERHEAD_BYTES
        if source.object_bytes + PAGE_KEY_BYTES + 1 > room:
            logger.warning("decode: pulls not offered: a page object (%d bytes) does not fit "
                           "in one control frame (max_message_bytes %d)", source.object_bytes,
                           self.max_message_bytes)
        elif not authenticated or not source.sealed:
            logger.info("decode: pulls not offered: they need the cluster secret (an "
                        "authenticated control plane and MAC'd pages)")
        else:
            self.offered = True

    def start(self) -> None:
        """Start the worker (only when pulls are offered); from here `serve` is refused."""
        self._started = True
        if self.offered:
            self._worker = threading.Thread(target=self._run, name="pdcache-decode-pull",
                                            daemon=True)
            self._worker.start()

    def submit(self, link: PullLink, msg: PullPages, deadline: float) -> bool:
        """Queue `msg` for the worker (control thread, never blocks). False: refused (no pull
        offered, closing, or the queue is full); the caller answers it `unavailable`."""
        if not self.offered or self._closing.is_set():
            return False
        try:
            self._queue.put_nowait((link, msg, deadline))
        except queue.Full:
            return False
        return True

    def close(self) -> None:
        """Refuse new pulls, drop queued ones (their prefill falls back to waiting), then stop
        the worker (join ≤ 5 s)."""
        self._closing.set()
        if self._worker is None:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put(None, timeout=5.0)
        except queue.Full:
            pass  # refilled meanwhile: the daemon worker ends with the process
        self._worker.join(5.0)
        if self._worker.is_alive():
            logger.warning("decode: the pull worker did not stop within 5 s")

    # ---- pull worker ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            link, msg, deadline = job
            try:
                self._serve_pull(link, msg, deadline)
            except Exception:  # never lose the worker: the prefill falls back to waiting
                logger.exception("decode: serving pull %d failed", msg.pull_id)

    def _serve_pull(self, link: PullLink, msg: PullPages, deadline: float) -> None:
        """Answer in frames of at most `max_message_bytes`, as many whole pages as fit in
        each; pages are read (pinned, encoded) one frame at a time, and each frame waits for
        a credit of its link (`PullLink.pull_credit`). What is left at the pull's deadline is
        dropped: the prefill has gone back to waiting for the write by then."""
        assert self._source is not None
        keys = list(dict.fromkeys(msg.key_list()))  # a repeated key is served once
        size = self._source.object_bytes
        per_frame = max(1, (self.max_message_bytes - PULLED_OVERHEAD_BYTES)
                        // (size + PAGE_KEY_BYTES + 1))
        for start in range(0, len(keys), per_frame):
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not link.pull_credit.acquire(timeout=left_s):
                self._counters["pull_pages_expired"] += len(keys) - start
                return
            chunk = keys[start : start + per_frame]
            objects = self._source.staged_objects(chunk, until=deadline)
            found = bytes(obj is not None for obj in objects)
            answer = PagesPulled(msg.pull_id, pack_keys(chunk), found, size,
                                 b"".join(obj for obj in objects if obj is not None))
            self._counters["pull_pages_served"] += sum(found)  # counted before it can arrive
            self._counters["pull_pages_unavailable"] += len(chunk) - sum(found)
            self._send(link, answer)
