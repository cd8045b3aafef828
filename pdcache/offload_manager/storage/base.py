"""The storage tier's batched, prefix-aware interface (docs/design.md §4.4).

A page is the payload of one host page in page-first order (`host_kv[p]` flattened to bytes);
backends wrap it in the stored page object of §4.3 (header + checksum) and verify it on read.
Host pages are passed as 1-D contiguous uint8 CPU tensors (views into the host pool), so
zero-copy backends can use their `data_ptr()` with memory registered once. A host page may
also be a tuple of such tensors, its runs (scatter/gather, e.g. the K and V runs of a page in
an SGLang host pool): the payload is their concatenation, in order, and the stored object is
byte-identical to that of the concatenated page (`page_format.HostPage`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pdcache.offload_manager.storage.page_format import HostPage


class StorageBackend(ABC):
    """Shared KV page storage. Thread-safe: the HiCache workers call it from several threads.

    Every method is batched and never raises for a per-page failure: a failed read or write is
    reported as False (and counted in `stats()`); only misconfiguration raises.
    """

    @abstractmethod
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of consecutive keys, from the first, that are stored and committed."""

    @abstractmethod
    def get_into(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        origins: list[str | None] | None = None,
    ) -> list[bool]:
        """Read each page into its host buffer; False for a miss, a corrupt or foreign page.

        When `origins` is given it is filled (one entry per key) with the origin recorded in
        each verified page header ("prefill" | "decode"), or None for a failed read.
        """

    @abstractmethod
    def put_from(
        self, keys: Sequence[bytes], host_pages: Sequence[HostPage], origin: str = "prefill",
        namespace: str = "", session: str = "",
    ) -> list[bool]:
        """Store each page (skipping keys already present, which count as True).

        A key whose stored page this backend read and refused (failed MAC, checksum, header)
        is not skipped: its stored page is replaced (counter `replaced_rejected_pages`), so a
        forged or stale-secret page never blocks the genuine one (docs/security.md).

        `origin` ("prefill" | "decode") is recorded in the page header. `namespace`: the
        tenant namespace the pages belong to (`config.tenant_namespace` of the request's
        cache_salt; "" for none), which a backend with tenant quotas accounts them to.
        `session`: the conversation (`session_id`) whose turn wrote them ("" for none), which
        a backend with `eviction = "session"` protects while it is active
        (`storage.lifecycle`); a key already present is refreshed for it.
        """

    def end_session(self, session: str) -> None:  # noqa: B027 - optional, no-op by default
        """The conversation `session` is over: with `eviction = "session"` its pages are the
        first to go from now on (they would be after `session_idle_s` without a write)."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove these pages if present."""

    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """Counters: pages read/written/skipped, misses, corrupt pages, errors, bytes."""

    @abstractmethod
    def close(self) -> None:
        """Release files, connections and registered memory. Idempotent."""
