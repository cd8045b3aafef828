"""Layer-major reads of stored pages, so a load can consume layer l while layer l+1 is read.

A stored page is `header || payload` with the payload in host-page order `[L, K, S, H, D]`
(page_format.py): layer l of a page is the byte range `[l * layer_bytes, (l+1) * layer_bytes)`
of its payload. `read_layer_major` reads every page's header first (a page whose header is not
a valid page of its key ends the usable prefix), then layer 0 of all those pages, then layer 1,
... reporting each step to a `LayerStream`, and verifies each full page (`verify_page`, the
checksum or MAC of the whole payload) once its last layer is in. The page format is unchanged:
a layer may be consumed before its page is verified, so the consumer must discard what it
computed from a page that then fails (HiCache requeues the request: docs/design.md
"Layer-streamed prefetch").

Thread model: the IO thread reads and reports; any number of threads wait on the stream.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdcache.offload_manager.storage.page_format import (
    HEADER_BYTES,
    PageSpec,
    Verdict,
    byte_view,
    parse_header,
    verify_page,
)
from pdcache.offload_manager.storage.stats import RejectedKeys, StorageCounters


class LayerStream:
    """Progress of one layer-major read: headers checked, layers read, pages verified.

    The IO thread calls `headers_read`, `layer_read` (in layer order) and `finish` (always,
    also after a failure: it wakes every waiter). Waiters block on a condition variable, at
    most until `deadline`; `done` means the IO thread finished (its host buffers are free
    to reuse), which a timed-out stream may reach only later.
    `layers_per_read`: layers read per page per step (fewer, larger reads; the first step
    carries the headers)."""

    def __init__(self, num_pages: int, num_layers: int, layers_per_read: int = 1,
                 deadline: float | None = None) -> None:
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.layers_per_read = layers_per_read
        # `time.monotonic()` past which a consumer stops waiting (None: never): the read is
        # then cancelled and every page counts as failed, so a hung read cannot stall the
        # consumer's thread (the engine's) for longer than its prefetch may take
        self.deadline = deadline
        self.timed_out = False
        self._cond = threading.Condition()
        self._headers_ok: int | None = None
        self._origins: list[str | None] = []
        self._layers_read = 0
        self._ok: list[bool] | None = None
        self.cancelled = threading.Event()  # set by the consumer: stop reading, fail the rest

    # ---- IO thread ---------------------------------------------------------------------
    def headers_read(self, ok_prefix: int, origins: list[str | None]) -> None:
        with self._cond:
            self._headers_ok, self._origins = ok_prefix, origins
            self._cond.notify_all()

    def layer_read(self, layer: int) -> None:
        with self._cond:
            self._layers_read = layer + 1
            self._cond.notify_all()

    def finish(self, ok: Sequence[bool]) -> None:
        with self._cond:
            self._ok = list(ok) + [False] * (self.num_pages - len(ok))
            if self._headers_ok is None:
                self._headers_ok = 0
            self._cond.notify_all()

    # ---- consumers ---------------------------------------------------------------------
    @property
    def headers_done(self) -> bool:
        return self._headers_ok is not None

    @property
    def done(self) -> bool:
        return self._ok is not None

    @property
    def layers_read(self) -> int:
        """Layers read so far (of every page in the header prefix)."""
        return self._layers_read

    def header_prefix(self) -> tuple[int, list[str | None]]:
        """Pages from the first with a valid header and their origins (0 before the header
        pass ended)."""
        with self._cond:
            count = self._headers_ok or 0
            return count, self._origins[:count]

    def wait_headers(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._headers_ok is not None, timeout_s)

    def wait_layer(self, layer: int) -> bool:
        """Until layer `layer` of every page in the header prefix is read (or the read ended);
        False when the deadline passed first (`timed_out`: the read is cancelled)."""
        with self._cond:
            return self._wait(lambda: self._layers_read > layer or self._ok is not None)

    def wait_done(self) -> list[bool]:
        """Per page: read and verified. Blocks until the read ended, or the deadline passed
        (`timed_out`: every page False, whatever the read reports later)."""
        with self._cond:
            if not self._wait(lambda: self._ok is not None):
                return [False] * self.num_pages
            assert self._ok is not None
            return list(self._ok)

    def _wait(self, predicate: Callable[[], bool]) -> bool:
        """Wait (holding `_cond`) for `predicate` until the deadline; past it, time the
        stream out (once) and return False."""
        if self.timed_out:
            return False
        remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        if self._cond.wait_for(predicate, remaining):
            return True
        self.timed_out = True
        self.cancelled.set()  # the IO thread stops at its next step; `done` waits for it
        return False


PageVerdict = tuple[Verdict, str | None] | None  # None: not read (past the first bad page)


@dataclass
class PageRead:
    """One page of a layer-major read: where its object starts and its host buffer."""

    key: bytes
    fd: int
    offset: int  # byte offset of the header in `fd`
    payload: memoryview


def page_reads(keys: Sequence[bytes], host_pages: Sequence[torch.Tensor],
               locate: Callable[[int], tuple[int, int] | None]) -> list[PageRead | None]:
    """`PageRead`s of the pages that `locate(i)` finds ((fd, offset) of page i, or None)."""
    out: list[PageRead | None] = []
    for i, (key, page) in enumerate(zip(keys, host_pages)):
        where = locate(i)
        out.append(None if where is None else PageRead(key, where[0], where[1], byte_view(page)))
    return out


def read_layer_major(spec: PageSpec, pages: Sequence[PageRead | None],
                     stream: LayerStream) -> list[PageVerdict]:
    """Read `pages` a group of `stream.layers_per_read` layers at a time (every page's first group
    with its header, then every page's second group, ...), reporting each finished group's
    last layer to `stream`; each page's verdict and origin. The first page that is missing
    (None) or whose header is not a valid page of its key ends the usable prefix (reported
    after the first group): it gets its verdict (EMPTY when missing), the pages after it None
    (not read further). Always ends with `stream.finish`."""
    verdicts: list[PageVerdict] = [None] * len(pages)
    layers = max(1, spec.num_layers)
    group = max(1, min(stream.layers_per_read, layers))
    try:
        headers, bad = _read_first_group(spec, pages, stream, group)
        if bad is not None:
            verdicts[len(headers)] = (bad, None)
        usable = [p for p in pages[: len(headers)] if p is not None]
        stream.layer_read(group - 1)
        for first in range(group, layers, group):
            if stream.cancelled.is_set():
                return verdicts
            _read_layers(spec, usable, first, min(layers, first + group))
            stream.layer_read(min(layers, first + group) - 1)
        for i, (page, header) in enumerate(zip(usable, headers)):
            if stream.cancelled.is_set():
                break
            verdicts[i] = verify_page(spec, page.key, header, page.payload, spec.object_bytes)
    finally:
        stream.finish([v is not None and v[0] is Verdict.OK for v in verdicts])
    return verdicts


def _layer_range(spec: PageSpec, first: int, end: int) -> tuple[int, int]:
    """Payload byte range of layers `[first, end)`."""
    layers = max(1, spec.num_layers)
    layer_bytes = spec.payload_bytes // layers
    return first * layer_bytes, spec.payload_bytes if end >= layers else end * layer_bytes


def _read_first_group(spec: PageSpec, pages: Sequence[PageRead | None], stream: LayerStream,
                      group: int) -> tuple[list[memoryview], Verdict | None]:
    """Header and layers `[0, group)` of the consecutive pages, from the first, that hold a
    valid page of their key (one read each: they are adjacent in the object); their headers
    and the verdict of the page that ended them (None: all usable). Reports the prefix and its
    origins to `stream`."""
    headers: list[memoryview] = []
    origins: list[str | None] = []
    bad: Verdict | None = None
    _, end = _layer_range(spec, 0, group)
    for page in pages:
        if page is None:
            bad = Verdict.EMPTY
            break
        header = memoryview(bytearray(HEADER_BYTES))
        try:
            nbytes = os.preadv(page.fd, [header, page.payload[:end]], page.offset)
        except OSError:
            bad = Verdict.TRUNCATED
            break
        verdict, info = parse_header(spec, header[: min(nbytes, HEADER_BYTES)])
        if info is None or verdict is not Verdict.OK:
            bad = verdict
            break
        if info.key != page.key:
            bad = Verdict.WRONG_KEY
            break
        headers.append(header)
        origins.append(info.origin)
    stream.headers_read(len(headers), origins)
    return headers, bad


def _read_layers(spec: PageSpec, pages: Sequence[PageRead], first: int, end: int) -> None:
    """Layers `[first, end)` of every page. A failed or short read leaves that range as it
    was: its page then fails verification."""
    start, stop = _layer_range(spec, first, end)
    for page in pages:
        try:
            os.preadv(page.fd, [page.payload[start:stop]], page.offset + HEADER_BYTES + start)
        except OSError:
            continue


def count_verdicts(counters: StorageCounters, rejected: RejectedKeys, payload_bytes: int,
                   keys: Sequence[bytes], verdicts: Sequence[PageVerdict],
                   origins: list[str | None] | None) -> list[bool]:
    """A backend's bookkeeping of a layer-major read, as its `get_into` does per page: reads
    counted, failed reads recorded by verdict and their keys marked rejected (the next put
    replaces them; not a `NEEDS_KEY` page, valid for keyed readers). Returns per page whether it was read and verified."""
    for key, verdict in zip(keys, verdicts):
        if verdict is None:
            continue
        if verdict[0] is Verdict.OK:
            counters.add_many(pages_read=1, bytes_read=payload_bytes)
            continue
        if verdict[0] is Verdict.EMPTY:  # no page stored there
            counters.add("misses")
            continue
        counters.record_failed_read(verdict[0])
        rejected.refuse(key, verdict[0])
    ok = [v is not None and v[0] is Verdict.OK for v in verdicts]
    if origins is not None:
        origins[:] = [v[1] if good and v is not None else None for v, good in zip(verdicts, ok)]
    return ok
