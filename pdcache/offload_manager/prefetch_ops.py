"""The records of a storage prefetch (`prefetch.Prefetcher`): one `PrefetchOp` per queued
request, made of `ReadBatch`es (or one `LayerStream`), and the `PrefetchResult` admission takes.

Ops are created, read and mutated on the engine thread; the prefetch IO thread only fills a
batch's `ok` / `origins` and then sets its `done` event (so readers check `done` first), or
reports to the op's `LayerStream` (its own condition variable). No lock of their own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pdcache.offload_manager.page_pull import PullTicket
from pdcache.offload_manager.storage.layer_reads import LayerStream


@dataclass
class ReadBatch:
    """One storage read of an op: its pages `first .. first + count`; `done` is set (by the
    prefetch IO thread) once `ok` and `origins` hold the result."""

    first: int  # index into the op's pages
    count: int
    done: threading.Event = field(default_factory=threading.Event)
    ok: list[bool] = field(default_factory=list)
    origins: list[str | None] = field(default_factory=list)

    @classmethod
    def finished(cls, first: int, ok: list[bool], origins: list[str | None]) -> ReadBatch:
        """A batch whose result is known already (pulled pages, pages given up on)."""
        batch = cls(first, len(ok), ok=ok, origins=origins)
        batch.done.set()
        return batch


@dataclass
class PrefetchOp:
    """Storage reads for one queued request: pages `first_page ..` of its prompt."""

    rid: str
    first_page: int
    keys: list[bytes]
    host_page_ids: list[int]
    batches: list[ReadBatch]
    deadline: float
    reason: str = ""
    started: float = field(default_factory=time.monotonic)
    # pages [awaited_first, awaited_first + awaited) were pending at lookup; reads are
    # submitted up to `submitted` (the rest wait for their keys to land)
    awaited_first: int = 0
    awaited: int = 0
    submitted: int = -1  # -1: every page
    stream: LayerStream | None = None  # a layer-streamed read (then `batches` is empty)
    pull: PullTicket | None = None  # pulling pages `submitted ..` from decode's staging
    pulled: int = 0  # pages taken from pulls
    # hybrid models: the state read into host state slot `state_slot` (None: given away or
    # none); candidates' page counts deepest first, `state_ok` the one read (-1: none); the
    # read has ended once `state_done` is set (None: no state read)
    state_slot: int | None = None
    state_pages: list[int] = field(default_factory=list)
    state_ok: int = -1
    state_done: threading.Event | None = None

    def __post_init__(self) -> None:
        if self.submitted < 0:
            self.submitted = len(self.keys)

    @property
    def complete(self) -> bool:
        if self.state_done is not None and not self.state_done.is_set():
            return False
        if self.stream is not None:
            return self.stream.done
        return self.submitted == len(self.keys) and all(b.done.is_set() for b in self.batches)

    @property
    def ready(self) -> bool:
        """Admission may take it now: every read finished, or a streamed read's header pass."""
        return self.complete or (self.stream is not None and self.stream.headers_done)

    def ready_prefix(self) -> tuple[int, list[str | None]]:
        """Pages readable now: consecutive successes from the start over finished batches (a
        streamed read: the pages whose headers are valid; their layers may still arrive)."""
        if self.stream is not None:
            pages, origins = self.stream.header_prefix()
            if self.stream.done:  # verified already: only the pages that passed
                ok = self.stream.wait_done()
                pages = next((i for i, good in enumerate(ok[:pages]) if not good), pages)
            return pages, origins[:pages]
        pages, origins = 0, []
        for batch in self.batches:
            if not batch.done.is_set():
                break
            for ok, origin in zip(batch.ok, batch.origins):
                if not ok:
                    return pages, origins
                pages += 1
                origins.append(origin)
        return pages, origins


@dataclass
class PrefetchResult:
    """Host pages holding storage hits that continue the device + host match."""

    host_page_ids: list[int]
    from_decode_pages: int
    origins: list[str | None] = field(default_factory=list)
    stream: LayerStream | None = None  # still being read into (layer-streamed prefetch)
    stream_offset: int = 0  # index of host_page_ids[0] among the stream's pages
    # hybrid models: the host state slot holding the state after the last page (the
    # caller's: restored then released through `HiCache.release_prefetched_state`)
    state_slot: int | None = None
