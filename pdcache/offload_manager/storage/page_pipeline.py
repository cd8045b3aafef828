"""The MAC pass over stored pages beside their I/O: a group of pages is verified (after a read)
or sealed (before a write) on one helper thread while the calling thread does the I/O of the
next group (docs/security.md "Verified beside the read").

Why: with a page MAC, verifying a page read from the page cache costs about as much CPU as
reading it (GMAC ~24 us per 512 KiB page against a ~45 us `preadv` here), and OpenSSL releases
the GIL while it MACs, so a second core verifies group g while the first copies group g+1 and
the MAC leaves the critical path. Whether that pays depends on whether a second core is free
and on the page size (each page also costs Python work that holds the GIL on both threads).
Measured storage alone on 2 cores (2026-12-05, read and write GB/s with the MAC over without):
on a quiet machine pipelined reads 0.73-0.90 / 0.91-0.93 / 0.85-1.01 / 1.00-1.13 at 128 KiB /
256 KiB / 512 KiB / 1 MiB pages against 0.76-0.81 page by page, and writes 0.63-0.83 /
0.98-1.04 / 0.81-1.16 / 1.01-1.16 against 0.88-0.95 (runs of one day: the shared machine
varies that much); beside one busy core pipelined lost at every size measured
(reads 0.73 against 0.78 at 512 KiB, 0.73 against 0.78 at 1 MiB; writes 0.83-0.87 against
0.91-0.94). No fixed rule wins both, so `StorageConfig.pipeline_pages` None (the default,
"auto") measures: each call that could pipeline runs one way or the other as
`AdaptiveChoice` says, from the seconds per page both ways have taken lately (posix I/O:
`Hf3fsBackend` leaves unmeasured usrbio page by page; `FileBackend` uses it too, where the
pipeline lost by most at small pages: 0.44 of the unsealed read at 128 KiB). 0 never
pipelines; N > 0 always pipelines reads and writes in groups of at least N pages
(docs/security.md). Only sealed
stores use it: the xxh3 checksum of an unsealed store is cheap, hot in cache right after the
read, and holds the GIL (python-xxhash). Groups, not pages: a hand-off costs a few us of Python,
so a group holds at least `MIN_GROUP_BYTES`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import NamedTuple, TypeVar

T = TypeVar("T")  # one item (a page's index, its key and slot, ...)
S = TypeVar("S")  # what the first step of a group hands the second
R = TypeVar("R")  # one item's result

THREAD_NAME = "pdcache-page-cpu"
MIN_GROUP_BYTES = 2 << 20  # 4 pages of 512 KiB: amortises a hand-off, keeps the tail short


class Grouping(NamedTuple):
    """How a store moves its pages (`group_pages_for`): pages per read group and per write
    group (0: page by page), and whether each call chooses by measurement (`AdaptiveChoice`)."""

    read: int
    write: int
    adaptive: bool


def group_pages_for(pipeline_pages: int | None, page_bytes: int, sealed: bool) -> Grouping:
    """How a store moves its pages (`StorageConfig.pipeline_pages`). Unsealed stores and
    `pipeline_pages` 0: page by page. N > 0: reads and writes in groups of at least N pages.
    None ("auto"): groups of at least one page, each call pipelined or page by page as
    measured. A group also holds at least `MIN_GROUP_BYTES`."""
    if not sealed or pipeline_pages == 0:
        return Grouping(0, 0, adaptive=False)
    group = _group_of(pipeline_pages or 1, page_bytes)
    return Grouping(group, group, adaptive=pipeline_pages is None)


def _group_of(pages: int, page_bytes: int) -> int:
    return max(pages, -(-MIN_GROUP_BYTES // max(page_bytes, 1)))


class AdaptiveChoice:
    """Whether the next call of one operation (reads, or writes) of a store runs pipelined or
    page by page, from the seconds per page each way has taken lately.

    Each way is tried `WARMUP` times first, in turn (pipelined first), so both are measured
    under the same load; then the faster one runs, the pipeline only when it is at least
    `MARGIN` faster (it takes a second core), and every `EXPLORE_EVERY`-th call runs the other
    way once, so a change of load (another job taking the second core, or leaving it) turns
    the choice within a few dozen calls. A way's cost is the median seconds per page of its
    calls among the last `EXPLORE_EVERY` choices, or of its latest call when it has none there
    (the way not chosen, once its older calls left the window: its latest exploration). So a
    burst of slow calls of the way that runs (a page-cache writeback, another job's moment) is
    outvoted by its other recent calls instead of turning the choice, and a way's calls from
    before a change of load count for at most `EXPLORE_EVERY` choices. Each way's calls and
    cost are in `stats()`; a call that chose the pipeline but found the helper busy is counted
    apart and measures nothing (`_record`). Thread-safe (one lock around the numbers)."""

    WARMUP = 3
    EXPLORE_EVERY = 16
    MARGIN = 0.97

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0  # choices made
        self._runs = {True: 0, False: 0}  # calls recorded, by pipelined
        # (choices made when it was recorded, seconds per page) of the latest calls, by
        # pipelined; with concurrent callers a long call is tagged a little after its choice
        self._recent: dict[bool, deque[tuple[int, float]]] = {
            way: deque(maxlen=self.EXPLORE_EVERY) for way in (True, False)}
        self._forced = 0  # calls that chose the pipeline but found the helper busy

    def pipelined(self) -> bool:
        """The way the next call should run."""
        with self._lock:
            warming = min(self._runs.values()) < self.WARMUP
            # costs over the last EXPLORE_EVERY choices before this one (as stats() shows them)
            faster = warming or self._cost(True) <= self.MARGIN * self._cost(False)
            self._calls += 1
            if warming:
                return self._runs[True] <= self._runs[False]
            return faster if self._calls % self.EXPLORE_EVERY else not faster

    def record(self, pipelined: bool, seconds: float, pages: int) -> None:
        """A call that ran `pipelined` (or not) moved `pages` in `seconds`."""
        if pages <= 0:
            return
        with self._lock:
            self._recent[pipelined].append((self._calls, seconds / pages))
            self._runs[pipelined] += 1

    def _cost(self, pipelined: bool) -> float:
        """Seconds per page of the way lately (0.0 before its first call). Under the lock."""
        recent = self._recent[pipelined]
        if not recent:
            return 0.0
        since = self._calls - self.EXPLORE_EVERY
        window = [cost for call, cost in recent if call > since]
        return statistics.median(window) if window else recent[-1][1]

    def record_forced(self) -> None:
        """A call that chose the pipeline ran page by page: the helper was busy or closed."""
        with self._lock:
            self._forced += 1

    def stats(self, prefix: str) -> dict[str, int]:
        """Calls each way (`busy`: chose the pipeline, found the helper taken) and each way's
        recent cost in ns per page (integers: node stats are exported as ints)."""
        with self._lock:
            return {f"{prefix}_pipelined_calls": self._runs[True],
                    f"{prefix}_inline_calls": self._runs[False],
                    f"{prefix}_busy_calls": self._forced,
                    f"{prefix}_pipelined_ns_per_page": round(self._cost(True) * 1e9),
                    f"{prefix}_inline_ns_per_page": round(self._cost(False) * 1e9)}


class PagePipeline:
    """Overlaps a per-group CPU step with a per-group I/O step, in item order.

    Owns one helper thread (`pdcache-page-cpu`, a one-worker ThreadPoolExecutor: spawned on
    the first overlapped call, joined by `close()`). One call at a time uses the helper: a call
    that finds it busy with another caller's groups runs inline, as does a call from the helper
    thread itself, so concurrent callers never queue behind each other (they verify in
    parallel on their own threads, as before). Every group handed to the helper has ended
    before a call returns or raises, so the caller's pages are never touched after it.

    Inline (a group size of 0, a call with at most one group, a busy helper, after `close()`,
    or, `adaptive`, when its `AdaptiveChoice` says so): both steps run on the caller,
    `inline_group` items at a time (an engine's own batch, e.g. one page: verified while it is
    hot in cache). `group_pages` sizes the read groups, `write_group_pages` the write groups
    (None: the same).
    """

    def __init__(self, group_pages: int, inline_group: int = 1,
                 write_group_pages: int | None = None, adaptive: bool = False) -> None:
        write_group = group_pages if write_group_pages is None else write_group_pages
        if min(group_pages, write_group) < 0 or inline_group < 1:
            raise ValueError(f"group_pages must be >= 0 and inline_group >= 1, got "
                             f"{group_pages}, {write_group}, {inline_group}")
        self.group_pages = group_pages
        self.write_group_pages = write_group
        self.inline_group = inline_group
        # reads and writes choose apart: they measured differently (module docstring)
        self._reads = AdaptiveChoice() if adaptive else None
        self._writes = AdaptiveChoice() if adaptive else None
        self._helper: ThreadPoolExecutor | None = None
        self._helper_seen = _ThreadSeen()  # the helper thread, once it started
        self._busy = False  # a call is using the helper
        self._closed = False
        self._lock = threading.Lock()  # guards the fields above, never a step

    def read_then_verify(self, items: Sequence[T], read: Callable[[list[T]], S],
                         verify: Callable[[S], list[R]]) -> list[R]:
        """`read(group)` here, then `verify(its result)` on the helper while the next group is
        read; one result per item, in order."""
        groups = self._groups(items, self.group_pages)
        call = self._acquire(len(groups), self._reads)
        if not call.took:
            return self._inline(call, items, read, verify)
        pending: list[Future[list[R]]] = []
        try:
            for group in groups:
                pending.append(self._helper_submit(verify, read(group)))
        except BaseException:
            _wait_quietly(pending)  # the read's error is the one to report
            raise
        finally:
            self._release_after(pending)
        results = _gather(pending)
        _record(call, True, len(items))
        return results

    def seal_then_write(self, items: Sequence[T], seal: Callable[[list[T]], S],
                        write: Callable[[S], list[R]]) -> list[R]:
        """`seal(group)` on the helper, one group ahead of `write(its result)` here; one result
        per item, in order."""
        groups = self._groups(items, self.write_group_pages)
        call = self._acquire(len(groups), self._writes)
        if not call.took:
            return self._inline(call, items, seal, write)
        results = []
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
        _record(call, True, len(items))
        return results

    def stats(self) -> dict[str, int]:
        """Adaptive only: calls each way and their recent ns per page, reads and writes
        (`pipeline_read_*`, `pipeline_write_*`); empty otherwise."""
        if self._reads is None or self._writes is None:
            return {}
        return {**self._reads.stats("pipeline_read"), **self._writes.stats("pipeline_write")}

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

    def _acquire(self, groups: int, choice: AdaptiveChoice | None) -> _Call:
        """Start a call of `groups` groups: whether it should use the helper (there is
        something to overlap, more than one group, and `choice`, if any, says so) and whether it
        took it (it cannot when the helper is closed or busy, or this is the helper thread)."""
        choice = choice if groups > 1 else None  # one group overlaps nothing: no sample
        wanted = groups > 1 and (choice is None or choice.pipelined())
        start = time.perf_counter()
        if not wanted:
            return _Call(choice, start, wanted=False, took=False)
        with self._lock:
            if self._closed or self._busy or threading.current_thread() is self._helper_thread:
                return _Call(choice, start, wanted=True, took=False)
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME,
                                                  initializer=self._helper_seen.record)
            self._busy = True
            return _Call(choice, start, wanted=True, took=True)

    def _inline(self, call: _Call, items: Sequence[T], first: Callable[[list[T]], S],
                second: Callable[[S], list[R]]) -> list[R]:
        """Both steps of a call on the caller, `inline_group` items at a time (read then
        verify, or seal then write); recorded as page by page."""
        results = [r for g in _split(items, self.inline_group) for r in second(first(g))]
        _record(call, False, len(items))
        return results

    @property
    def _helper_thread(self) -> threading.Thread | None:
        return self._helper_seen.thread

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


class _ThreadSeen:
    """Which thread ran `record` (the helper's initializer). Apart from `PagePipeline` so the
    helper thread holds no reference to its pipeline: a store dropped without `close()` lets
    its executor go, and the executor's own cleanup then ends the thread."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def record(self) -> None:
        self.thread = threading.current_thread()


class _Call(NamedTuple):
    """One call of a `PagePipeline` (`_acquire`): its `AdaptiveChoice` (None: nothing to
    choose), when it began, whether it wanted the helper and whether it took it."""

    choice: AdaptiveChoice | None
    start: float
    wanted: bool
    took: bool


def _record(call: _Call, pipelined: bool, pages: int) -> None:
    """Tell the call's choice (if any) how it went. A call that wanted the helper but found it
    busy (another caller's groups: e.g. HiCache's write-back beside a prefetch) or closed ran
    page by page against its choice, beside a second core already at work: counted apart,
    never a sample of either way."""
    if call.choice is None:
        return
    if call.wanted != pipelined:
        call.choice.record_forced()
        return
    call.choice.record(pipelined, time.perf_counter() - call.start, pages)


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
