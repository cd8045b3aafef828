"""pdcache storage as an SGLang HiCache L3 backend (`--hicache-storage-backend dynamic`).

SGLang loads the class `PdcacheHiCacheStorage` from this module with

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "pdcache",
        "module_path": "pdcache.integrations.sglang", "class_name": "PdcacheHiCacheStorage",
        "interface_v1": 1, "pdcache_config": "/etc/pdcache/topology.toml"}'

(or the storage keys inline: `"storage": {"backend": "hf3fs", ...}`, the form
`pdcache launch CONFIG --render sglang` writes; see docs/sglang.md) and hands it page hash
keys plus its config (model name, TP/PP/CP ranks). The plugin stores pages through a pdcache
storage backend (`hf3fs`, `mooncake`, `file`), so SGLang gets the stored page object of
DESIGN.md §4.3 (header + checksum: a corrupt, truncated or foreign page is a miss, never wrong
KV) and pdcache's metadata service and capacity management.

Keys. SGLang's key of page i is `g_i = SHA256(g_{i-1} || tokens_i)` (hex), with
`g_{-1}` = nothing, or SGLang's namespace seed when the request carries a cache_salt or
extra_key. The plugin stores it under `SHA256(salt || bytes(g_i))` with
`salt = make_salt(fingerprint, key_namespace)` (pdcache.engine.page_keys): the fingerprint binds
model name, KV dtype, page size, layer count, KV heads and head dim of this shard, and the TP
shard (rank/size; PP stage and attention-CP rank when used), so models, tenants and shards
never read each other's pages. pdcache nodes run with `[cache] key_scheme = "sglang"` in
their topology (`--key-scheme sglang` without one) name their pages the same way
(`pdcache.engine.page_keys.PageKeyScheme`; `sglang_compatible_page_keys`, re-exported here,
computes the same keys) and share pages with SGLang in both directions: prefill write-through,
prefetch, and decode offload, whose answer pages continue SGLang's hash chain. Which settings
must match is listed in `INTEROP` below.

Payload (`"payload"` in the extra config).
- `"pdcache"` (default): whatever SGLang's host layout (layer_first, page_first,
  page_first_direct, page_head), a page is stored in pdcache's host page layout: MHA `[layers,
  2 (K, V), page_size, kv_heads, head_dim]`, MLA `[layers, page_size, 1, kv_cache_dim]`, in the
  KV dtype. A pdcache node reads SGLang's pages straight into its host pool (and the other way
  round), and SGLang nodes with different host layouts share pages. Costs one reordering copy
  per page through a staging buffer (no SGLang host layout keeps a page's K and V in one run,
  and the checksum needs the stored bytes in order): a batch is cut into chunks that the IO
  threads move in parallel, each reordering its chunk and doing its backend IO (numpy's copy
  and pread/pwrite release the GIL; XXH3 holds it for about 10 us a page), so the copy of one
  chunk overlaps the IO of another and no stage waits for a pipeline to fill or drain. The copy
  costs CPU (about 80 us per 512 KiB page each way here, against 170-180 us of backend work):
  it is hidden when a core is free, not on a machine whose cores the IO already fills.
- `"split"`: zero-copy. A page is stored as one object whose payload is the page's contiguous
  runs in SGLang's pool (K then V for MHA, the page for MLA; host layouts page_first and
  page_first_direct), read and written in place with scatter/gather IO (preadv/pwritev,
  Mooncake's multi-buffer transfers; the checksum is computed over the runs in order). Pages
  are shared only between SGLang nodes with the same host layout (the layout is part of the
  fingerprint).

Robustness. `batch_get_v1` / `batch_set_v1` never raise and never return None (SGLang's
prefetch thread dies on either): every failure is a per-key False, logged and counted.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdcache.engine.page_keys import derive_storage_key, kv_fingerprint, make_salt
from pdcache.engine.page_keys import (  # the "sglang" key scheme, re-exported for plugin users
    sglang_chain_hashes as sglang_chain_hashes,
)
from pdcache.engine.page_keys import (
    sglang_compatible_page_keys as sglang_compatible_page_keys,
)
from pdcache.engine.page_keys import sglang_namespace_seed as sglang_namespace_seed
from pdcache.offload_manager.storage.config import storage_keys_from_spec
from pdcache.utils.registry import MissingDependencyError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

log = logging.getLogger(__name__)

CLASS_NAME = "PdcacheHiCacheStorage"
MODULE_PATH = "pdcache.integrations.sglang"
PAYLOAD_LAYOUT = "page_first"  # pdcache's host page layout, the layout named in fingerprints
PAYLOADS = ("pdcache", "split")
CHUNK_BYTES = 8 << 20  # "pdcache" payload: at most about this many bytes per chunk of a batch

# Settings that must be equal on a pdcache node and an SGLang node for them to share pages.
INTEROP = (
    "storage: the same backend and location (hf3fs: path, namespace, metadata service and "
    "capacity; mooncake: master and namespace; file: path and namespace)",
    "model name: `model_name` in the plugin config (default: SGLang's served model name) "
    "equals the pdcache nodes' model identity, `pdcache.offload_manager.builder."
    "model_identity()` (`preset:NAME:seed=N` or `ckpt:DIR:DIGEST`; the rendered script sets "
    "it as $PDCACHE_MODEL_NAME)",
    "KV dtype, page size, number of layers, KV heads per shard and head dim",
    "TP shard: tp_rank / tp_size (pdcache nodes are 0/1); MLA pages are shared by all ranks",
    "key namespace: the plugin's `key_namespace` (default \"\") equals the pdcache nodes' "
    "`[cache] key_namespace` (`--key-namespace`, default \"\")",
    "request tenant: the same cache_salt on both sides (SGLang seeds its chain with it)",
    "key scheme: the pdcache nodes run with `[cache] key_scheme = \"sglang\"` (`--key-scheme "
    "sglang`); with the default \"pdcache\" they never see SGLang's pages",
)


# --------------------------------------------------------------------------- keys


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- host pool pages


@dataclass(frozen=True)
class PageGeometry:
    """How one page sits in an SGLang host pool, and its canonical (stored) shape.

    `page_shape` is a page as sliced from the pool buffer (and as SGLang's flat data pages
    are ordered); `perm` turns that into `canonical_shape`.
    """

    kind: str  # "mha" | "mla"
    layout: str
    layer_num: int
    page_size: int
    head_num: int
    head_dim: int
    dtype: torch.dtype
    page_shape: tuple[int, ...]
    perm: tuple[int, ...]
    canonical_shape: tuple[int, ...]

    @functools.cached_property
    def page_bytes(self) -> int:
        return int(np.prod(self.canonical_shape)) * self.dtype.itemsize

    @functools.cached_property
    def run_bytes(self) -> int:
        """Bytes of one contiguous run of a page ("split" layouts)."""
        return self.page_bytes // max(1, self.split_pieces)

    @classmethod
    def from_host_pool(cls, pool: Any) -> PageGeometry:
        """Geometry of SGLang's MHATokenToKVPoolHost / MLATokenToKVPoolHost (or a lookalike)."""
        layout, size, layers = pool.layout, pool.page_size, pool.layer_num
        if hasattr(pool, "kv_cache_dim"):
            dim = int(pool.kv_cache_dim)
            shapes = {
                "layer_first": ((layers, size, 1, dim), (0, 1, 2, 3)),
                "page_first": ((size, layers, 1, dim), (1, 0, 2, 3)),
                "page_first_direct": ((layers, size, 1, dim), (0, 1, 2, 3)),
            }
            kind, heads, canonical = "mla", 1, (layers, size, 1, dim)
        else:
            heads, dim = int(pool.head_num), int(pool.head_dim)
            if getattr(pool, "v_head_dim", dim) != dim:
                raise ValueError("pdcache storage needs K and V of the same head_dim")
            shapes = {
                "layer_first": ((2, layers, size, heads, dim), (1, 0, 2, 3, 4)),
                "page_first": ((2, size, layers, heads, dim), (2, 0, 1, 3, 4)),
                "page_first_direct": ((2, layers, size, heads, dim), (1, 0, 2, 3, 4)),
                "page_head": ((2, heads, size, layers, dim), (3, 0, 2, 1, 4)),
            }
            kind, canonical = "mha", (layers, 2, size, heads, dim)
        if layout not in shapes:
            raise ValueError(f"host layout {layout!r} ({kind}) is not supported; use one of "
                             f"{sorted(shapes)}")
        page_shape, perm = shapes[layout]
        return cls(kind, layout, layers, size, heads, dim, pool.dtype, page_shape, perm,
                   canonical)

    def _bytes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * self.dtype.itemsize)

    def pool_page(self, kv_bytes: np.ndarray, first_token: int) -> np.ndarray:
        """A view (no copy) of the page starting at host token `first_token`, canonical order.

        `kv_bytes` is the pool's kv_buffer as bytes (`byte_array`): numpy slicing costs about
        a microsecond where a torch view costs ten, and a batch makes hundreds.
        """
        i, size = first_token, self.page_size
        if self.layout == "layer_first":
            page = kv_bytes[:, :, i : i + size] if self.kind == "mha" else kv_bytes[:, i : i + size]
        elif self.layout == "page_first":
            page = kv_bytes[:, i : i + size] if self.kind == "mha" else kv_bytes[i : i + size]
        else:  # page_first_direct, page_head: the buffer has a page axis
            page = kv_bytes[:, i // size] if self.kind == "mha" else kv_bytes[i // size]
        return page.transpose(self.perm)

    def flat_page(self, flat: torch.Tensor) -> np.ndarray:
        """A view of one of SGLang's flat data pages (layout order), canonical order."""
        return byte_array(flat).reshape(self._bytes_shape(self.page_shape)).transpose(self.perm)

    def stored(self, page: np.ndarray) -> np.ndarray:
        """A stored (canonical, contiguous) page of bytes seen in the canonical shape."""
        return page.reshape(self._bytes_shape(self.canonical_shape))

    @property
    def split_pieces(self) -> int:
        """Contiguous runs per page in the pool (K and V for MHA, the page for MLA: the payload
        of the "split" payload); 0 when the layout has none (layer_first, page_head)."""
        if self.layout not in ("page_first", "page_first_direct"):
            return 0
        return 2 if self.kind == "mha" else 1

    def pool_runs(self, kv_flat: torch.Tensor, first_token: int) -> tuple[torch.Tensor, ...]:
        """The page's contiguous runs (K then V for MHA) as 1-D uint8 views of the pool.

        `kv_flat` is the whole kv_buffer as one flat uint8 tensor (`flat_bytes`): slicing it
        costs a fraction of slicing the N-d buffer, and a batch makes hundreds.
        """
        run = self.run_bytes
        if self.layout == "page_first":  # token-major: a page is `page_size` tokens of runs
            start = first_token * (run // self.page_size)
        else:  # page_first_direct: a page axis
            start = (first_token // self.page_size) * run
        if self.kind == "mla":
            return (kv_flat[start : start + run],)
        v_start = start + kv_flat.numel() // 2
        return kv_flat[start : start + run], kv_flat[v_start : v_start + run]

    def flat_runs(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The same runs of one of SGLang's flat data pages (they are in pool order)."""
        return tuple(_bytes_of(flat).chunk(self.split_pieces))


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor whose last dim is contiguous as a numpy uint8 array (no copy)."""
    return tensor.view(torch.uint8).numpy()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as one flat uint8 tensor (no copy); raises if not contiguous."""
    return tensor.view(-1).view(torch.uint8)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a 1-D uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("expected a contiguous run of the host pool")
    return tensor.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's part of `--hicache-storage-backend-extra-config` (other keys are SGLang's).

    `storage` holds pdcache `StorageConfig` keys (backend, path, capacity_pages or
    capacity_bytes, metadata, namespace, io_engine, mooncake_*); `pdcache_config` names a
    pdcache TOML (a topology file, whose `[storage]` table is translated, or a file of
    StorageConfig keys); keys in `storage` override the file. page_bytes, dtype, layers, page
    size and fingerprint always come from SGLang.
    """

    storage: Mapping[str, Any] = field(default_factory=dict)
    model_name: str | None = None  # fingerprint model name; default: SGLang's model name
    origin: str = "prefill"  # recorded in page headers; "decode" on offloading decode nodes
    chunk_bytes: int = CHUNK_BYTES
    io_timeout_s: float = 60.0  # one SGLang batch call; past it its pages are failures
    key_namespace: str = ""  # extra tenant namespace salted into every key (deployment-wide)
    payload: str = "pdcache"  # "pdcache": pdcache's page layout; "split": zero-copy K/V objects
    allow_clear: bool = False  # let SGLang's clear-storage admin call empty the shared namespace
    io_threads: int = 0  # threads moving chunks of a batch; 0: min(4, CPU count), at least 2

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PluginSettings:
        extra = dict(extra or {})
        table: dict[str, Any] = {}
        if extra.get("pdcache_config"):
            table.update(load_storage_table(extra["pdcache_config"]))
        inline = extra.get("storage", {})
        if not isinstance(inline, Mapping):
            raise ValueError(f"extra-config 'storage' must be an object, got {inline!r}")
        table.update(inline)
        if "backend" not in table:
            raise ValueError("pdcache plugin: set 'pdcache_config' (a pdcache TOML) or "
                             "'storage': {'backend': ..., ...} in the extra config")
        origin = str(extra.get("origin", "prefill"))
        if origin not in ("prefill", "decode"):
            raise ValueError(f"pdcache plugin: origin must be prefill|decode, got {origin!r}")
        chunk = int(extra.get("chunk_bytes", CHUNK_BYTES))
        timeout = float(extra.get("io_timeout_s", 60.0))
        namespace = str(extra.get("key_namespace", ""))
        payload = str(extra.get("payload", "pdcache"))
        if payload not in PAYLOADS:
            raise ValueError(f"pdcache plugin: payload must be one of {PAYLOADS}, got {payload!r}")
        allow_clear = bool(extra.get("allow_clear", False))
        threads = int(extra.get("io_threads", 0))
        if threads < 0:
            raise ValueError(f"pdcache plugin: io_threads must be >= 0, got {threads}")
        return cls(table, extra.get("model_name"), origin, chunk, timeout, namespace, payload,
                   allow_clear, threads)

    @property
    def threads(self) -> int:
        return self.io_threads or max(2, min(4, os.cpu_count() or 2))


_TOPOLOGY_ONLY = {"metadata_service", "start_master", "metrics_port"}


def load_storage_table(path: str | Path) -> dict[str, Any]:
    """StorageConfig keys from a pdcache topology TOML or a TOML of StorageConfig keys."""
    data = tomllib.loads(Path(path).read_text())
    if "node" in data or "model" in data:
        from pdcache.config import load_topology

        return storage_keys_from_spec(load_topology(path).storage)
    table = data.get("storage", data)
    if _TOPOLOGY_ONLY & set(table):
        raise ValueError(f"{path}: [storage] has topology keys but the file has no [model]/"
                         "[[node]]; give the whole topology file")
    return dict(table)


@dataclass(frozen=True)
class ShardIdentity:
    """The parts of SGLang's HiCacheStorageConfig that decide which pages are interchangeable."""

    model_name: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    rank_replicated: bool = False  # MLA: every TP rank holds the same KV
    is_writer: bool = True

    @classmethod
    def from_sglang(cls, config: Any, model_name: str | None) -> ShardIdentity:
        name = model_name or config.model_name or ""
        replicated = bool(config.is_mla_model)
        writer = bool(getattr(config, "is_storage_writer", (not replicated) or config.tp_rank == 0))
        return cls(name, config.tp_rank, config.tp_size, config.pp_rank, config.pp_size,
                   config.attn_cp_rank, config.attn_cp_size, replicated, writer)

    def fingerprint(self, geometry: PageGeometry, payload: str = "pdcache") -> str:
        tp_rank, tp_size = (0, 1) if self.rank_replicated else (self.tp_rank, self.tp_size)
        layout = PAYLOAD_LAYOUT if geometry.kind == "mha" else "mla"
        if payload == "split":  # SGLang's own byte order: only SGLang nodes of this layout share
            layout = f"sglang-{geometry.kind}-{geometry.layout}-split"
        fp = kv_fingerprint(self.model_name, dtype_name(geometry.dtype), geometry.page_size,
                            geometry.layer_num, geometry.head_num, geometry.head_dim,
                            layout, tp_rank, tp_size)
        if self.pp_size > 1:
            fp += f";pp={self.pp_rank}/{self.pp_size}"
        if self.cp_size > 1:
            fp += f";cp={self.cp_rank}/{self.cp_size}"
        return fp


# --------------------------------------------------------------------------- staging


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for same-shape strided byte arrays, as one single-threaded numpy copy.

    torch's strided copy spreads small copies over its intra-op threads, which collapses to
    tens of MB/s when the cores are busy (measured on a loaded 2-core box: 0.03 vs 1.2 GB/s); numpy copies the
    innermost contiguous runs (head_dim * itemsize bytes) with the GIL released.
    """
    np.copyto(dst, src)


class StagingBuffer:
    """`pages` contiguous page slots: the tensor, its rows (the host pages handed to the
    backend) and the same memory as a numpy array (for the reordering copies)."""

    def __init__(self, pages: int, page_bytes: int) -> None:
        self.tensor = torch.empty((pages, page_bytes), dtype=torch.uint8)
        self.rows = list(self.tensor)
        self.array = self.tensor.numpy()


class StagingBuffers:
    """Reusable staging buffers (one per chunk in flight; `keep` are kept).

    Reuse matters twice: fresh memory costs a page fault per 4 KiB on first touch, and the
    mooncake backend registers each buffer once on first use.
    """

    def __init__(self, pages: int, page_bytes: int, keep: int = 8) -> None:
        self.pages, self.page_bytes, self.keep = pages, page_bytes, keep
        self._free: list[StagingBuffer] = []
        self._lock = threading.Lock()

    def acquire(self) -> StagingBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        return StagingBuffer(self.pages, self.page_bytes)

    def release(self, buffer: StagingBuffer) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)


@dataclass
class Chunk:
    """Pages of one batch that one IO thread moves: their positions in the batch and storage
    keys. A thread that starts or finishes after the caller stopped waiting (`abandoned`, set
    under `lock`) leaves the host pool alone: SGLang may already reuse those host pages."""

    todo: list[int]
    keys: list[bytes]
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False


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
        self.salt = make_salt(self.fingerprint, self.settings.key_namespace)
        chunk = max(1, min(128, self.settings.chunk_bytes // geometry.page_bytes))
        threads = self.settings.threads
        self.staging = StagingBuffers(chunk, geometry.page_bytes, keep=2 * threads)
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="pdcache-sglang-io")
        self._threads = threads
        self.storage_config = config
        self.geometry = geometry
        self.backend = create_backend(config)
        log.info("pdcache plugin: %s backend at %s, fingerprint %s", config.backend,
                 config.path, self.fingerprint)

    def _private_files(self, config: Any) -> Any:
        """hf3fs with in-process metadata: one writer process per data file set.

        Each SGLang rank is its own process, and two processes allocating slots in the same
        files without the shared metadata service would overwrite each other's pages. Sharded
        (MHA) ranks get their own files; rank-replicated (MLA) ranks read rank 0's pages, which
        needs the service.
        """
        ident = self.identity
        ranks = ident.tp_size * ident.pp_size * ident.cp_size
        if config.backend != "hf3fs" or config.metadata != "inproc" or ranks == 1:
            return config
        if ident.rank_replicated:
            raise ValueError("pdcache plugin: hf3fs with several ranks of an MLA model needs the "
                             "shared metadata service (storage.metadata = 'tcp://HOST:PORT')")
        suffix = f"tp{ident.tp_rank}of{ident.tp_size}pp{ident.pp_rank}cp{ident.cp_rank}"
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


@functools.lru_cache(maxsize=1)
def _sglang_class() -> type:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError as exc:
        raise MissingDependencyError(
            "the SGLang storage plugin", "sglang==0.5.23",
            "it runs inside SGLang: on a GPU host install sglang, which brings its CUDA torch; "
            "on CPU, for tests only: pip install --no-deps sglang==0.5.23 plus the light "
            "packages in scripts/setup.sh",
        ) from exc
    return type(CLASS_NAME, (PdcacheStorageImpl, HiCacheStorage),
                {"__module__": __name__, "__doc__": PdcacheStorageImpl.__doc__})


def __getattr__(name: str) -> Any:
    # SGLang's factory does getattr(module, class_name): build the subclass on first use, so
    # importing this module (key helpers) never imports SGLang.
    if name == CLASS_NAME:
        return _sglang_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def extra_config(
    pdcache_config: str | None = None,
    storage: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The `--hicache-storage-backend-extra-config` object that loads this plugin."""
    config: dict[str, Any] = {"backend_name": "pdcache", "module_path": MODULE_PATH,
                              "class_name": CLASS_NAME, "interface_v1": 1}
    if pdcache_config is not None:
        config["pdcache_config"] = str(pdcache_config)
    if storage:
        config["storage"] = dict(storage)
    config.update(options)
    return config


def extra_config_json(*args: Any, **kwargs: Any) -> str:
    return json.dumps(extra_config(*args, **kwargs), separators=(",", ":"))
