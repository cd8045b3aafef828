"""The CPU pass over stored pages beside their I/O: a group of pages is verified (after a read)
or sealed (before a write) on one helper thread while the calling thread does the I/O of the
next group (docs/security.md "Verified beside the read").

Why: with a page MAC, verifying a page read from the page cache costs about as much CPU as
reading it (GMAC ~24 us per 512 KiB page against a ~45 us `preadv` here), and OpenSSL releases
the GIL while it MACs, so a second core verifies group g while the first copies group g+1 and
the MAC's cost leaves the critical path. Groups, not single pages: a hand-off costs a few us of
Python (a future, a queue, a wake-up), so 4 pages of 512 KiB amortise it while the tail (the
last group's pass, not overlapped) stays short. Measured with `pdcache bench storage --mac
both` (README "Storage"). python-xxhash holds the GIL, so a checksum-only store gains less: the
overlap is then only with the `preadv` itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")  # one item (a page's index, its key and slot, ...)
S = TypeVar("S")  # what the first step of a group hands the second
R = TypeVar("R")  # one item's result

THREAD_NAME = "pdcache-page-cpu"


class PagePipeline:
    """Overlaps a per-group CPU step with a per-group I/O step, in item order.

    Owns one helper thread (`pdcache-page-cpu`, a one-worker ThreadPoolExecutor: spawned on
    the first overlapped call, joined by `close()`). Holds no state between calls; calls from
    several threads are safe (their groups queue on the one helper). Every group handed to the
    helper has ended before a call returns or raises, so the caller's pages are never touched
    after it: the caller may reuse or free them at once.

    `group_pages` 0, or a call with at most one group, runs both steps inline on the caller.
    """

    def __init__(self, group_pages: int) -> None:
        if group_pages < 0:
            raise ValueError(f"group_pages must be >= 0, got {group_pages}")
        self.group_pages = group_pages
        self._helper: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()  # guards _helper and _closed, never a step

    def read_then_verify(self, items: Sequence[T], read: Callable[[list[T]], S],
                         verify: Callable[[S], list[R]]) -> list[R]:
        """`read(group)` here, then `verify(its result)` on the helper while the next group is
        read; one result per item, in order."""
        groups = self._groups(items)
        if len(groups) <= 1:
            return [r for group in groups for r in verify(read(group))]
        pending: list[Future[list[R]]] = []
        try:
            for group in groups:
                pending.append(self._submit(verify, read(group)))
        except BaseException:
            _gather(pending, raise_first=False)  # the read's error is the one to report
            raise
        return _gather(pending)

    def seal_then_write(self, items: Sequence[T], seal: Callable[[list[T]], S],
                        write: Callable[[S], list[R]]) -> list[R]:
        """`seal(group)` on the helper, one group ahead of `write(its result)` here; one result
        per item, in order."""
        groups = self._groups(items)
        if len(groups) <= 1:
            return [r for group in groups for r in write(seal(group))]
        results: list[R] = []
        ahead = self._submit(seal, groups[0])
        try:
            for nxt in [*groups[1:], None]:
                sealed = ahead.result()
                if nxt is not None:
                    ahead = self._submit(seal, nxt)
                results.extend(write(sealed))
        except BaseException:
            _gather([ahead], raise_first=False)  # a write that raised leaves one seal running
            raise
        return results

    def close(self) -> None:
        """Join the helper thread. Idempotent; later calls run inline."""
        with self._lock:
            self._closed = True
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)

    def _groups(self, items: Sequence[T]) -> list[list[T]]:
        size = self.group_pages if self.group_pages and not self._closed else len(items)
        size = max(size, 1)
        return [list(items[i : i + size]) for i in range(0, len(items), size)]

    def _submit(self, fn: Callable[[S], R], arg: S) -> Future[R]:
        with self._lock:
            if not self._closed:
                if self._helper is None:
                    self._helper = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
                return self._helper.submit(fn, arg)
        done: Future[R] = Future()  # closed meanwhile: run the step here
        try:
            done.set_result(fn(arg))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            done.set_exception(exc)
        return done


def _gather(pending: list[Future[list[R]]], raise_first: bool = True) -> list[R]:
    """Wait for every future; then raise the first error (if `raise_first`) or return the
    concatenated results."""
    results: list[R] = []
    error: BaseException | None = None
    for future in pending:
        try:
            results.extend(future.result())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after all have ended
            error = error or exc
    if error is not None and raise_first:
        raise error
    return results
