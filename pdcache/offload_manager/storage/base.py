"""The storage tier's batched, prefix-aware interface (docs/design.md §4.4).

A page is the payload of one host page in page-first order (`host_kv[p]` flattened to bytes);
backends wrap it in the stored page object of §4.3 (header + checksum) and verify it on read.
Host pages are passed as 1-D contiguous uint8 CPU tensors (views into the host pool), so
zero-copy backends can use their `data_ptr()` with memory registered once. A host page may
also be a tuple of such tensors, its runs (scatter/gather, e.g. the K and V runs of a page in
an SGLang host pool): the payload is their concatenation, in order, and the stored object is
byte-identical to that of the concatenated page (`page_format.HostPage`).

State objects (state_format.py): one request's recurrent state at one token, stored whole
under its state key (`engine.page_keys.state_key`), one object per call: a state is one
variable-size object (one per store geometry, 73.7 MiB on the real Qwen3-Next) where pages are
batches of fixed-size host pages, so it has calls of its own instead of a generic
`put_object` (its header, geometry and position checks, and its counters, are the state's).
Backends that store them set `supports_states`; the others refuse the calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from pdcache.offload_manager.storage.page_format import HostPage
from pdcache.offload_manager.storage.state_format import StateBuffer, StateSpec


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

    # ---- state objects (optional: `supports_states`) ------------------------------------
    state_spec: StateSpec | None = None  # set by backends that store states

    @property
    def supports_states(self) -> bool:
        """Whether `put_state` / `get_state_into` / `exists_state` / `delete_states` work:
        a backend that implements them, configured with a state geometry."""
        return False

    def put_state(self, key: bytes, state: StateBuffer, tokens: int, origin: str = "prefill",
                  namespace: str = "", session: str = "") -> bool:
        """Store `state` (one state of `state_spec`, the one after `tokens` tokens) under
        `key`; True when stored or already present (skipped, counted `states_skipped`). A
        present key whose object a read here refused is replaced. `namespace` as `put_from`
        (a tenant quota counts the object's bytes); `session` is accepted for symmetry (the
        session lifecycle orders pages only). ValueError for a state of the wrong size."""
        raise NotImplementedError(f"{type(self).__name__} stores no state objects")

    def get_state_into(self, key: bytes, out: torch.Tensor, tokens: int | None = None
                       ) -> str | None:
        """Read the state of `key` into `out` (1-D contiguous uint8 CPU, `state_bytes`): the
        origin its writer recorded ("prefill" | "decode"), or None for a miss. A refused object
        (another geometry, length, fingerprint, position than `tokens`, a failed MAC...) is a
        counted miss, never an exception; `out` may then hold its bytes (never served)."""
        raise NotImplementedError(f"{type(self).__name__} stores no state objects")

    def get_state(self, key: bytes, tokens: int | None = None) -> bytes | None:
        """The state of `key` as bytes, or None (a copy: `get_state_into` reads in place)."""
        spec = self._state_spec()
        out = torch.empty(spec.state_bytes, dtype=torch.uint8)
        if self.get_state_into(key, out, tokens) is None:
            return None
        return out.numpy().tobytes()

    def exists_state(self, key: bytes) -> bool:
        """Whether a state object of `key` is stored (not verified: a read may still refuse)."""
        raise NotImplementedError(f"{type(self).__name__} stores no state objects")

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        """`exists_state` of each key. Backends with a remote index answer in one batched
        call per chunk (a hybrid prefetch probes every stored page's end on the engine
        thread); this default asks key by key."""
        return [self.exists_state(key) for key in keys]

    def delete_states(self, keys: Sequence[bytes]) -> None:
        """Remove these state objects if present."""
        raise NotImplementedError(f"{type(self).__name__} stores no state objects")

    def _state_spec(self) -> StateSpec:
        """This store's state spec; ValueError (misconfiguration) when it has none."""
        if self.state_spec is None:
            raise ValueError(f"{type(self).__name__}: no state objects configured "
                             "(StorageConfig.state_geometry / state_bytes)")
        return self.state_spec

    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """Counters: pages read/written/skipped, misses, corrupt pages, errors, bytes."""

    @abstractmethod
    def close(self) -> None:
        """Release files, connections and registered memory. Idempotent."""
