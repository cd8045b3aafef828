"""`PdcacheStorageImpl`: SGLang's HiCacheStorage methods over a pdcache StorageBackend."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np
import torch

from pdcache.engine.page_keys import derive_storage_key, make_salt
from pdcache.integrations.sglang.geometry import PageGeometry, byte_array, dtype_name, flat_bytes
from pdcache.integrations.sglang.settings import PluginSettings, ShardIdentity
from pdcache.integrations.sglang.staging import Chunk, StagingBuffers, copy_bytes

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the backend


class PdcacheStorageImpl:
    """HiCacheStorage methods over a pdcache StorageBackend (the SGLang base class is mixed in
    by `PdcacheHiCacheStorage`, so this module imports without SGLang).

    Owns the pdcache backend (opened in `register_mem_pool_host`, when the page geometry is
    known) and the staging buffers. Thread-safe: SGLang's prefetch and backup threads call
    concurrently; the backend is thread-safe and each call holds its own staging buffer.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = PluginSettings.from_extra_config(storage_config.extra_config)
        self.identity = ShardIdentity.from_sglang(storage_config, self.settings.model_name)
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self.backend: Any = None
        self.geometry: PageGeometry | None = None
        self.mem_pool_host: Any = None
        self.salt = b""
        self.fingerprint = ""
        self.split = False

    # ---- setup ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page geometry from SGLang's host pool and open the pdcache backend."""
        geometry = PageGeometry.from_host_pool(mem_pool_host)
        with self._open_lock:
            if self.backend is not None and geometry != self.geometry:
                raise ValueError("pdcache plugin: a second host pool with another geometry")
            self.mem_pool_host = mem_pool_host
            if self.backend is None:
                self._open(geometry)

    def _open(self, geometry: PageGeometry) -> None:
        from pdcache.offload_manager.storage import create_backend
        from pdcache.offload_manager.storage.config import StorageConfig

        self.split = self.settings.payload == "split"
        if self.split and not geometry.split_pieces:
            raise ValueError(f"pdcache plugin: payload 'split' needs host layout page_first or "
                             f"page_first_direct, not {geometry.layout!r}")
        self.fingerprint = self.identity.fingerprint(geometry, self.settings.payload)
        table = {**self.settings.storage, "page_bytes": geometry.page_bytes,
                 "fingerprint": self.fingerprint, "num_layers": geometry.layer_num,
                 "page_size": geometry.page_size, "dtype": dtype_name(geometry.dtype)}
        config = self._private_files(StorageConfig.from_mapping(table))
        keys = self.settings.storage_keys()
        config = config.replace(page_mac_key=keys.page_mac_key, metadata_key=keys.metadata_key)
        self.salt = make_salt(self.fingerprint, self.settings.key_namespace)
        chunk = max(1, min(128, self.settings.chunk_bytes // geometry.page_bytes))
        threads = self.settings.threads
        self.staging = StagingBuffers(chunk, geometry.page_bytes, keep=2 * threads)
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="pdcache-sglang-io")
        self._threads = threads
        self.storage_config = config
        self.geometry = geometry
        self.backend = create_backend(config)
        log.info("pdcache plugin: %s backend at %s, fingerprint %s, page MAC %s",
                 config.backend, config.path, self.fingerprint,
                 "on" if config.page_mac_key else "off")

    def _private_files(self, config: Any) -> Any:
        """hf3fs with in-process metadata: one writer process per data file set.

        Each SGLang rank is its own process, and two processes allocating slots in the same
        files without the shared metadata service would overwrite each other's pages. Sharded
        (MHA) ranks get their own files; rank-replicated (MLA) ranks read rank 0's pages, which
        needs the service. A DP-attention rank is a process too (SGLang gives no DP size: the
        rank past 0 tells there are several; every DP rank ran on one set of files before).
        """
        ident = self.identity
        ranks = ident.tp_size * ident.pp_size * ident.cp_size
        if (config.backend != "hf3fs" or config.metadata != "inproc"
                or (ranks == 1 and ident.dp_rank == 0)):
            return config
        if ident.rank_replicated:
            raise ValueError("pdcache plugin: hf3fs with several ranks of an MLA model needs the "
                             "shared metadata service (storage.metadata = 'tcp://HOST:PORT')")
        suffix = f"tp{ident.tp_rank}of{ident.tp_size}pp{ident.pp_rank}cp{ident.cp_rank}"
        if ident.dp_rank:
            suffix += f"dp{ident.dp_rank}"
        log.warning("pdcache plugin: hf3fs with in-process metadata: rank files %s.%s.*; use the "
                    "metadata service to share pages across processes", config.namespace, suffix)
        return config.replace(namespace=f"{config.namespace}.{suffix}")

    def close(self) -> None:
        if self.backend is not None:
            self._io.shutdown(wait=True)
            self.backend.close()
            self.backend = None

    # ---- keys ----------------------------------------------------------------------------

    def storage_keys(self, keys: Sequence[str]) -> list[bytes | None]:
        """Derived storage keys; None for a key that is not a 64-hex-digit SGLang hash."""
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(derive_storage_key(self.salt, key))
            except (ValueError, TypeError):
                self._count("bad_keys")
                out.append(None)
        return out

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += amount

    def _ready(self) -> bool:
        if self.backend is None:
            self._count("not_registered")
            log.error("pdcache plugin: used before register_mem_pool_host")
            return False
        return True

    # ---- existence -----------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of consecutive keys, from the first, that are stored."""
        if not keys or not self._ready():
            return 0
        try:
            derived = self.storage_keys(keys)
            valid = derived.index(None) if None in derived else len(derived)
            return self.backend.exists_prefix(derived[:valid]) if valid else 0
        except Exception:
            log.exception("pdcache plugin: batch_exists failed")
            self._count("errors")
            return 0

    # ---- zero-copy (v1) ------------------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read pages into the host pool at `host_indices`; per-key False on any failure."""
        try:
            firsts = self._first_tokens(keys, host_indices)
            if firsts is None:
                return [False] * len(keys)
            return self._read(keys, self._pool_targets(firsts))
        except Exception:
            log.exception("pdcache plugin: batch_get_v1 failed")
            self._count("errors")
            return [False] * len(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pages at `host_indices`; per-key False on any failure."""
        try:
            if not self.identity.is_writer:
                return [True] * len(keys)  # another rank writes this replicated page
            firsts = self._first_tokens(keys, host_indices)
            if firsts is None:
                return [False] * len(keys)
            return self._write(keys, self._pool_targets(firsts))
        except Exception:
            log.exception("pdcache plugin: batch_set_v1 failed")
            self._count("errors")
            return [False] * len(keys)

    def _first_tokens(self, keys: list[str], host_indices: torch.Tensor) -> list[int] | None:
        if not self._ready():
            return None
        size = self.geometry.page_size  # type: ignore[union-attr]
        if host_indices.numel() != len(keys) * size:
            self._count("errors")
            log.error("pdcache plugin: %d keys but %d host indices (page size %d)",
                      len(keys), host_indices.numel(), size)
            return None
        return host_indices[::size].tolist()

    # ---- generic (flat pages) ------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fill SGLang's flat data pages (`target_locations`); None for each miss."""
        try:
            if not self._ready():
                return [None] * len(keys)
            targets = list(target_locations or [])
            if len(targets) != len(keys) or any(t is None for t in targets):
                targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
            found = self._read(keys, self._flat_targets(targets))
            return [t if ok else None for t, ok in zip(targets, found)]
        except Exception:
            log.exception("pdcache plugin: batch_get failed")
            self._count("errors")
            return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store SGLang's flat data pages; True when every page is stored."""
        try:
            if not self.identity.is_writer:
                return True
            if not self._ready() or values is None or len(values) != len(keys):
                return False
            return all(self._write(keys, self._flat_targets(values)))
        except Exception:
            log.exception("pdcache plugin: batch_set failed")
            self._count("errors")
            return False

    # ---- page movement -------------------------------------------------------------------

    def _pool_targets(self, firsts: list[int]) -> list[Any]:
        """Per page: its canonical view ("pdcache") or its tuple of contiguous runs ("split")."""
        kv, geometry = self.mem_pool_host.kv_buffer, self.geometry
        if self.split:
            kv_flat = flat_bytes(kv)
            return [geometry.pool_runs(kv_flat, t) for t in firsts]  # type: ignore[union-attr]
        kv_bytes = byte_array(kv)
        return [geometry.pool_page(kv_bytes, t) for t in firsts]  # type: ignore[union-attr]

    def _flat_targets(self, flats: Sequence[torch.Tensor]) -> list[Any]:
        if self.split:
            return [self.geometry.flat_runs(f) for f in flats]  # type: ignore[union-attr]
        return [self.geometry.flat_page(f) for f in flats]  # type: ignore[union-attr]

    # A batch is cut into chunks, one per IO thread (at most `staging.pages` pages for the
    # "pdcache" payload), moved in parallel: a batch takes about 1/threads of the time when
    # storage is not the bottleneck. "split": each thread reads/writes its pages' runs in the
    # pool in place. "pdcache": each thread reorders its chunk between the host pool and its
    # own staging buffer and does the chunk's backend IO, so one chunk's copy overlaps
    # another's IO (numpy copies and pread/pwrite release the GIL), with no
    # pipeline to fill or drain.

    def _read(self, keys: Sequence[str], targets: list[Any]) -> list[bool]:
        work = self._read_runs if self.split else self._read_chunk
        return self._move_chunks(keys, targets, work, "pages_read")

    def _write(self, keys: Sequence[str], targets: list[Any]) -> list[bool]:
        work = self._write_runs if self.split else self._write_chunk
        return self._move_chunks(keys, targets, work, "pages_written")

    def _chunks(self, keys: Sequence[str]) -> list[Chunk]:
        derived = self.storage_keys(keys)
        valid = [i for i, k in enumerate(derived) if k is not None]
        step = max(1, -(-len(valid) // self._threads))
        if not self.split:
            step = min(step, self.staging.pages)
        return [Chunk(valid[s : s + step], [derived[i] for i in valid[s : s + step]])  # type: ignore[misc]
                for s in range(0, len(valid), step)]

    def _move_chunks(self, keys: Sequence[str], targets: Sequence[Any], work: Any,
                     counter: str) -> list[bool]:
        results = [False] * len(keys)
        chunks = self._chunks(keys)
        futures = [self._io.submit(work, chunk, targets) for chunk in chunks]
        deadline = time.monotonic() + self.settings.io_timeout_s  # one for the whole call
        failed = 0
        for chunk, future in zip(chunks, futures):
            done, chunk_failed = self._outcome(future, chunk, work.__name__, deadline)
            failed += chunk_failed
            for i, ok in zip(chunk.todo, done):
                results[i] = ok
            self._count(counter, sum(done))
        self._count("errors", min(failed, 1))  # one per failed SGLang call
        return results

    def _read_runs(self, chunk: Chunk, runs: Sequence[tuple[torch.Tensor, ...]]) -> list[bool]:
        """IO thread, "split": read a chunk's pages straight into their runs in the pool
        (a chunk that started is always waited for: see `_outcome`)."""
        if chunk.abandoned:
            return [False] * len(chunk.todo)
        return list(self.backend.get_into(chunk.keys, [runs[i] for i in chunk.todo]))

    def _write_runs(self, chunk: Chunk, runs: Sequence[tuple[torch.Tensor, ...]]) -> list[bool]:
        """IO thread, "split": store a chunk's pages from their runs in the pool."""
        if chunk.abandoned:  # queued past the deadline: the pool may hold other pages by now
            return [False] * len(chunk.todo)
        pages = [runs[i] for i in chunk.todo]
        return list(self.backend.put_from(chunk.keys, pages, self.settings.origin))

    def _read_chunk(self, chunk: Chunk, views: Sequence[np.ndarray]) -> list[bool]:
        """IO thread: read a chunk into staging, then reorder its hits into the host pool."""
        buffer = self.staging.acquire()
        try:
            found = self.backend.get_into(chunk.keys, buffer.rows[: len(chunk.keys)])
            stored = self.geometry.stored  # type: ignore[union-attr]
            with chunk.lock:
                if chunk.abandoned:
                    return [False] * len(chunk.todo)
                for j, (i, ok) in enumerate(zip(chunk.todo, found)):
                    if ok:
                        copy_bytes(views[i], stored(buffer.array[j]))
            return list(found)
        finally:
            self.staging.release(buffer)

    def _write_chunk(self, chunk: Chunk, views: Sequence[np.ndarray]) -> list[bool]:
        """IO thread: reorder a chunk's host pages into staging, then store them."""
        buffer = self.staging.acquire()
        try:
            stored = self.geometry.stored  # type: ignore[union-attr]
            with chunk.lock:
                if chunk.abandoned:
                    return [False] * len(chunk.todo)
                for j, i in enumerate(chunk.todo):
                    copy_bytes(stored(buffer.array[j]), views[i])
            pages = buffer.rows[: len(chunk.keys)]
            return list(self.backend.put_from(chunk.keys, pages, self.settings.origin))
        finally:
            self.staging.release(buffer)

    def _outcome(self, future: Future, chunk: Chunk, what: str,
                 deadline: float) -> tuple[list[bool], int]:
        """(per-page results, 0), or (all False, 1), logged, if the call raised or ran past the
        call's deadline (`io_timeout_s`). Past it the chunk is abandoned: with staging it no
        longer touches the host pool; zero-copy ("split") IO cannot be held back, so a chunk
        already running is waited for before SGLang gets the pages back (queued ones skip)."""
        try:
            return list(future.result(timeout=max(0.0, deadline - time.monotonic()))), 0
        except Exception:
            log.exception("pdcache plugin: backend %s failed for %d pages", what,
                          len(chunk.todo))
            with chunk.lock:
                chunk.abandoned = True
            if self.split:
                futures_wait([future])
            return [False] * len(chunk.todo), 1

    # ---- maintenance ---------------------------------------------------------------------

    def delete_keys(self, keys: list[str]) -> None:
        if self._ready():
            self.backend.delete([k for k in self.storage_keys(keys) if k is not None])

    def clear(self) -> None:
        """SGLang's "clear HiCache storage" admin call. The storage namespace is shared with
        every node (and model) using it, so this removes pages only with `allow_clear: true`
        in the extra config; then every page of the namespace goes (file / hf3fs / mooncake).
        """
        if not self.settings.allow_clear:
            log.warning("pdcache plugin: clear() ignored: the storage is shared by every node "
                        "using it (set allow_clear=true in the extra config to allow it)")
            return
        if self.backend is not None and hasattr(self.backend, "clear"):
            self.backend.clear()

    def get_stats(self) -> None:
        return None  # SGLang's StorageMetrics are its own; see pdcache_stats()

    def pdcache_stats(self) -> dict[str, int | float]:
        """pdcache backend counters plus the plugin's own (bad_keys, errors, pages_*)."""
        out: dict[str, int | float] = dict(self.backend.stats()) if self.backend else {}
        with self._counter_lock:
            out.update({f"plugin_{k}": v for k, v in self.counters.items()})
        return out
