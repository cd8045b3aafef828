"""The MAC pass over stored pages beside their I/O: a group of pages is verified (after a read)
or sealed (before a write) on one helper thread while the calling thread does the I/O of the
next group (docs/security.md "Verified beside the read").

Why: with a page MAC, verifying a page read from the page cache costs about as much CPU as
reading it (GMAC ~24 us per 512 KiB page against a ~45 us `preadv` here), and OpenSSL releases
the GIL while it MACs, so a second core verifies group g while the first copies group g+1 and
the MAC leaves the critical path. Whether that pays depends on the page size, since each page
also costs Python work that holds the GIL on both threads: reads of pages of 1 MiB and more
(a 16-token page of an 8B-class bf16 model is 2 MiB) went from 0.77-0.79 to 0.95-1.07 of the
read without the MAC (storage alone) and 17.0 -> 13.7 ms for 128 MiB in the HiCache read path;
reads of 128 KiB pages gained nothing there (36.5 vs 32.6 ms), and sealed writes pipelined
measured slower at every size (0.63-0.85 against 0.86-0.93 page by page). So
`StorageConfig.pipeline_pages` None (the default, "auto") pipelines sealed reads of pages of at
least `AUTO_READ_MIN_PAGE_BYTES` (posix I/O: `Hf3fsBackend` leaves unmeasured usrbio page by
page) and writes page by page; 0 never pipelines; N > 0 pipelines reads and writes in groups of
at least N pages (docs/security.md). Only sealed stores use it:
the xxh3 checksum of an unsealed store is cheap, hot in cache right after the read, and holds
the GIL (python-xxhash). Groups, not pages: a hand-off costs a few us of Python, so a group
holds at least `MIN_GROUP_BYTES`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import TypeVar

T = TypeVar("T")  # one item (a page's index, its key and slot, ...)
S = TypeVar("S")  # what the first step of a group hands the second
R = TypeVar("R")  # one item's result

THREAD_NAME = "pdcache-page-cpu"
MIN_GROUP_BYTES = 2 << 20  # 4 pages of 512 KiB: amortises a hand-off, keeps the tail short
AUTO_READ_MIN_PAGE_BYTES = 1 << 20  # "auto": sealed reads of pages this large go in groups


def group_pages_for(pipeline_pages: int | None, page_bytes: int,
                    sealed: bool) -> tuple[int, int]:
    """(read, write) pages per group for a store (`StorageConfig.pipeline_pages`; 0: inline).
    Unsealed stores and `pipeline_pages` 0: both inline. None ("auto"): reads of pages of at
    least `AUTO_READ_MIN_PAGE_BYTES` in groups, writes inline. N: both in groups of at least N
    pages. A group also holds at least `MIN_GROUP_BYTES`."""
    if not sealed or pipeline_pages == 0:
        return 0, 0
    if pipeline_pages is None:
        if page_bytes < AUTO_READ_MIN_PAGE_BYTES:
            return 0, 0
        return _group_of(1, page_bytes), 0
    group = _group_of(pipeline_pages, page_bytes)
    return group, group


def _group_of(pages: int, page_bytes: int) -> int:
    return max(pages, -(-MIN_GROUP_BYTES // max(page_bytes, 1)))


class PagePipeline:
    """Overlaps a per-group CPU step with a per-group I/O step, in item order.

    Owns one helper thread (`pdcache-page-cpu`, a one-worker ThreadPoolExecutor: spawned on
    the first overlapped call, joined by `close()`). One call at a time uses the helper: a call
    that finds it busy with another caller's groups runs inline, as does a call from the helper
    thread itself, so concurrent callers never queue behind each other (they verify in
    parallel on their own threads, as before). Every group handed to the helper has ended
    before a call returns or raises, so the caller's pages are never touched after it.

    Inline (a group size of 0, a call with at most one group, a busy helper, after `close()`):
    both steps run on the caller, `inline_group` items at a time (an engine's own batch, e.g.
    one page: verified while it is hot in cache). `group_pages` sizes the read groups,
    `write_group_pages` the write groups (None: the same).
    """

    def __init__(self, group_pages: int, inline_group: int = 1,
                 write_group_pages: int | None = None) -> None:
        write_group = group_pages if write_group_pages is None else write_group_pages
        if min(group_pages, write_group) < 0 or inline_group < 1:
            raise ValueError(f"group_pages must be >= 0 and inline_group >= 1, got "
                             f"{group_pages}, {write_group}, {inline_group}")
        self.group_pages = group_pages
        self.write_group_pages = write_group
        self.inline_group = inline_group
        self._helper: ThreadPoolExecutor | None = None
        self._helper_thread: threading.Thread | None = None
        self._busy = False  # a call is using the helper
        self._closed = False
        self._lock = threading.Lock()  # guards the fields above, never a step

    def read_then_verify(self, items: Sequence[T], read: Callable[[list[T]], S],
                         verify: Callable[[S], list[R]]) -> list[R]:
        """`read(group)` here, then `verify(its result)` on the helper while the next group is
        read; one result per item, in order."""
        groups = self._groups(items, self.group_pages)
        if not self._acquire(len(groups)):
            return [r for g in _split(items, self.inline_group) for r in verify(read(g))]
        pending: list[Future[list[R]]] = []
        try:
            for group in groups:
                pending.append(self._helper_submit(verify, read(group)))
        except BaseException:
            _wait_quietly(pending)  # the read's error is the one to report
            raise
        finally:
            self._release_after(pending)
        return _gather(pending)

    def seal_then_write(self, items: Sequence[T], seal: Callable[[list[T]], S],
                        write: Callable[[S], list[R]]) -> list[R]:
        """`seal(group)` on the helper, one group ahead of `write(its result)` here; one result
        per item, in order."""
        groups = self._groups(items, self.write_group_pages)
        if not self._acquire(len(groups)):
            return [r for g in _split(items, self.inline_group) for r in write(seal(g))]
        results: list[R] = []
        ahead = self._helper_submit(seal, groups[0])
        try:
            for nxt in [*groups[1:], None]:
                sealed = ahead.result()
                if nxt is not None:
                    ahead = self._helper_submit(seal, nxt)
                results.extend(write(sealed))
        except BaseException:
            _wait_quietly([ahead])  # a write that raised leaves one seal running
            raise
        finally:
            self._release_after([ahead])
        return results

    def close(self) -> None:
        """Join the helper thread. Idempotent; later calls run inline."""
        with self._lock:
            self._closed = True
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)

    @staticmethod
    def _groups(items: Sequence[T], size: int) -> list[list[T]]:
        """`items` in groups of `size`; one group (run inline) when `size` is 0."""
        return _split(items, size) if size else [list(items)]

    def _acquire(self, groups: int) -> bool:
        """Take the helper for this call: False (run inline) when there is nothing to overlap
        (one group), it is closed or busy, or this is the helper thread itself."""
        if groups <= 1:
            return False
        with self._lock:
            if self._closed or self._busy or threading.current_thread() is self._helper_thread:
                return False
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME,
                                                  initializer=self._record_thread)
            self._busy = True
            return True

    def _record_thread(self) -> None:
        self._helper_thread = threading.current_thread()

    def _release_after(self, pending: list[Future]) -> None:
        _wait_quietly(pending)
        with self._lock:
            self._busy = False

    def _helper_submit(self, fn: Callable[[S], R], arg: S) -> Future[R]:
        """`fn(arg)` on the helper; inline if the helper cannot take it (interpreter exit)."""
        helper = self._helper
        if helper is not None:
            try:
                return helper.submit(fn, arg)
            except RuntimeError:  # shut down meanwhile, or the interpreter is exiting
                pass
        done: Future[R] = Future()
        try:
            done.set_result(fn(arg))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            done.set_exception(exc)
        return done


def _split(items: Sequence[T], size: int) -> list[list[T]]:
    return [list(items[i : i + size]) for i in range(0, len(items), max(size, 1))]


def _wait_quietly(pending: list[Future]) -> None:
    """Wait until every future has ended, even through an interrupt (re-raised after)."""
    try:
        wait_all(pending)
    except BaseException:
        wait_all(pending)
        raise


def _gather(pending: list[Future[list[R]]]) -> list[R]:
    """The concatenated results of ended futures; the first error is raised."""
    results: list[R] = []
    for future in pending:
        results.extend(future.result())
    return results
