"""The `mooncake` backend: Mooncake Store (`mooncake_master` + clients), zero-copy and batched.

Each page is one object `pdkv/{namespace}/{key hex}` whose bytes are `header || payload`
(page_format.py), written with `batch_put_from_multi_buffers` from two buffers (a header arena
owned by this client and the host page itself) and read back with
`batch_get_into_multi_buffers` straight into the host page. Host memory is registered with the
store once: `register_host_memory(pool)` for the whole host pool, or, for a page outside every
registered region, its whole underlying torch storage on first use.

Results are per key (a batch can half-succeed). Error codes seen from the store: -704 object
not found, -200 no space, -600 buffer too small (a bigger, foreign object), -800 transfer failed
(also what a short object gives), -900 master RPC failed. After an RPC failure the client fails
fast for `retry_interval_s`, so a dead master costs one RPC timeout (about 4 s) per interval.

Capacity: with `capacity_pages` (or `capacity_bytes`) set, this client keeps an LRU of the pages
it wrote or read and removes the least recently used when full; the master's own eviction
stays the backstop. `eviction = "session"` (storage.lifecycle) picks this client's victims by
conversation instead (closed sessions' pages first, active ones protected within the bound);
the master's backstop eviction knows nothing of sessions (its soft pin, a TTL'd per-object
flag, is not used here). Thread-safe: one lock around store calls (the header arena is shared).

State objects (state_format.py) are objects `pdst/{namespace}/{key hex}` (`header || state`),
put from the header and the state's buffer in one `put_parts` and read back whole with `get`,
then verified and copied into the caller's buffer: one copy each way, where pages move
zero-copy (a state is one large object per call, not a batch; a registered host state pool
could move them zero-copy later). The store's segments must hold one whole state (73.7 MiB
on the real Qwen3-Next). This client keeps an LRU of `state_capacity` states (0: the master's
eviction only), apart from the pages'.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.page_format import (
    HEADER_BYTES,
    HostPage,
    Verdict,
    byte_view,
    encode_header,
    host_page_nbytes,
    payload_views,
    verify_page,
)
from pdcache.offload_manager.storage.state_format import (
    StateBuffer,
    StateVerdict,
    check_state,
    decode_state_object,
    encode_state_header,
    state_view,
)
from pdcache.offload_manager.storage.stats import RateLimitedLog, RejectedKeys, StorageCounters
from pdcache.utils.registry import import_optional

log = logging.getLogger(__name__)

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
NOT_FOUND = -704
NO_SPACE = -200
BUFFER_TOO_SMALL = -600
TRANSFER_FAILED = -800
RPC_FAILED = -900


class MooncakeStoreBackend(StorageBackend):
    """Pages as Mooncake Store objects (docs/design.md §4.4).

    `client`: an already set-up `MooncakeDistributedStore` to use instead of connecting one of
    its own (several backends of one process, each its own namespace, on one connection and
    one mounted segment). Such a backend does not close it: `close()` unregisters the buffers
    it registered and leaves the client to its owner, so closing costs no Mooncake teardown
    (~1-2 s per client, holding the GIL)."""

    def __init__(self, config: StorageConfig, client: Any | None = None) -> None:
        self.config = config
        self.spec = config.page_spec()
        self.counters = StorageCounters()
        self._warn = RateLimitedLog(log)
        self._rejected = RejectedKeys()  # keys whose stored page a read here refused
        self.capacity_pages = (
            config.capacity_pages or config.capacity_bytes // self.spec.object_bytes
        )
        self._prefix = f"pdkv/{config.namespace}/"
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._lifecycle = config.make_lifecycle(self.capacity_pages, self.spec.object_bytes)
        self._regions: list[tuple[int, int]] = []
        self._down_until = 0.0
        self._closed = False
        self._owns_client = client is None
        self._store = self.connect(config) if client is None else client
        self._batch = max(1, config.mooncake_batch_pages)
        self._headers = torch.zeros(self._batch, HEADER_BYTES, dtype=torch.uint8)
        self._register(self._headers.data_ptr(), self._headers.numel())
        self.state_spec = config.state_spec()
        self.state_capacity = config.state_capacity  # 0: the master's eviction only
        self._state_prefix = f"pdst/{config.namespace}/"
        self._state_lru: OrderedDict[bytes, None] = OrderedDict()
        self._rejected_states = RejectedKeys()

    @staticmethod
    def connect(cfg: StorageConfig) -> Any:
        """A `MooncakeDistributedStore` set up with `cfg`'s Mooncake settings (its caller
        closes it; pass it as `client=` to share it)."""
        store_mod = import_optional(
            "mooncake.store", "storage backend 'mooncake'", MOONCAKE_PACKAGE
        )
        if cfg.mooncake_cluster_id:
            _set_cluster_id(cfg.mooncake_cluster_id)
        store = store_mod.MooncakeDistributedStore()
        rc = store.setup(
            cfg.mooncake_local_hostname,
            cfg.mooncake_metadata,
            cfg.mooncake_segment_bytes,
            cfg.mooncake_local_buffer_bytes,
            cfg.mooncake_protocol,
            cfg.mooncake_device,
            cfg.mooncake_master,
        )
        if rc != 0:
            raise ConnectionError(
                f"mooncake store setup failed ({rc}) with master {cfg.mooncake_master}, "
                f"metadata {cfg.mooncake_metadata}; segments must be >= 16 MiB"
            )
        return store

    # memory registration

    def register_host_memory(self, tensor: torch.Tensor) -> None:
        """Register a whole host pool once, so every page in it moves without a copy."""
        storage = tensor.untyped_storage()
        self._register(storage.data_ptr(), storage.nbytes())

    def _register(self, addr: int, nbytes: int) -> None:
        if self._covered(addr, nbytes):
            return
        rc = self._store.register_buffer(addr, nbytes)
        if rc != 0:
            log.warning("mooncake: register_buffer(%#x, %d) returned %d", addr, nbytes, rc)
        self._regions.append((addr, addr + nbytes))

    def _covered(self, addr: int, nbytes: int) -> bool:
        return any(lo <= addr and addr + nbytes <= hi for lo, hi in self._regions)

    def _page_buffers(self, header: int, page: HostPage) -> tuple[list[int], list[int]]:
        """(pointers, sizes) of a stored object: the header slot, then the page or its runs."""
        if host_page_nbytes(page) != self.spec.payload_bytes:
            raise ValueError(
                f"host page of {host_page_nbytes(page)} bytes, store pages are "
                f"{self.spec.payload_bytes}"
            )
        ptrs, sizes = [header], [HEADER_BYTES]
        for run in page if isinstance(page, tuple) else (page,):
            byte_view(run)  # validates dtype, shape, device
            if not self._covered(run.data_ptr(), run.numel()):
                self.register_host_memory(run)
            ptrs.append(run.data_ptr())
            sizes.append(run.numel())
        return ptrs, sizes

    # StorageBackend

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for start in range(0, len(keys), self._batch):
            chunk = keys[start : start + self._batch]
            with self._lock:
                found = self._call("batch_is_exist", [self._object_key(k) for k in chunk])
            if found is None:
                return count
            for flag in found:
                if flag != 1:
                    return count
                count += 1
        return count

    def get_into(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        origins: list[str | None] | None = None,
    ) -> list[bool]:
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys but {len(host_pages)} host pages")
        found: list[str | None] = []
        for start in range(0, len(keys), self._batch):
            end = start + self._batch
            found.extend(self._get_chunk(keys[start:end], host_pages[start:end]))
        if origins is not None:
            origins[:] = found
        return [origin is not None for origin in found]

    def put_from(
        self, keys: Sequence[bytes], host_pages: Sequence[HostPage], origin: str = "prefill",
        namespace: str = "",  # tenant quotas are not enforced here (docs/design.md §8)
        session: str = "",  # this client's lifecycle (eviction = "session") uses it
    ) -> list[bool]:
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys but {len(host_pages)} host pages")
        self._replace_rejected(keys)
        results: list[bool] = []
        for start in range(0, len(keys), self._batch):
            end = start + self._batch
            chunk = self._put_chunk(keys[start:end], host_pages[start:end], origin, session)
            results.extend(chunk)
        return results

    def _replace_rejected(self, keys: Sequence[bytes]) -> None:
        """Remove the objects of `keys` whose page a read here refused, so the put writes them
        anew instead of skipping them as existing."""
        stale = self._rejected.take(keys)
        if stale:
            self.delete(stale)
            self.counters.add("replaced_rejected_pages", len(stale))

    def end_session(self, session: str) -> None:
        if self._lifecycle is not None:
            with self._lock:
                self._lifecycle.end_session(session)

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._lru.pop(key, None)
                if self._lifecycle is not None:
                    self._lifecycle.removed(key)
            codes = self._call("batch_remove", [self._object_key(k) for k in keys], True)
        if codes is not None:
            self.counters.add("deleted_pages", sum(1 for c in codes if c == 0))

    def stats(self) -> dict[str, int | float]:
        out = self.counters.snapshot()
        with self._lock:
            out["used_pages"] = len(self._lru)
            if self._lifecycle is not None:
                out.update({f"lifecycle_{k}": v for k, v in self._lifecycle.stats().items()})
            out["used_states"] = len(self._state_lru)
        free = max(0, self.capacity_pages - len(self._lru)) if self.capacity_pages else 0
        out.update(capacity_pages=self.capacity_pages, free_pages=free, reserved_pages=0)
        out["state_capacity"] = self.state_capacity
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._owns_client:
                    self._store.close()
                else:  # a borrowed client outlives this backend: drop only what it registered
                    for addr, _ in self._regions:
                        self._store.unregister_buffer(addr)
            except Exception as exc:  # closing must not raise; the master may be gone
                log.warning("mooncake: close failed: %s", exc)

    # state objects

    @property
    def supports_states(self) -> bool:
        return self.state_spec is not None

    def put_state(self, key: bytes, state: StateBuffer, tokens: int, origin: str = "prefill",
                  namespace: str = "",  # tenant quotas are not enforced here (§8)
                  session: str = "") -> bool:
        spec = self._state_spec()
        payload = state_view(state)
        check_state(spec, payload)
        okey = self._state_key(key)
        if self._rejected_states.take([key]):
            self.delete_states([key])
            self.counters.add("replaced_rejected_states")
        with self._lock:
            present = self._call("is_exist", okey)
            if present == 1:
                self._touch_state(key)
        if present is None:
            self.counters.add("state_write_errors")
            return False
        if present == 1:
            self.counters.add("states_skipped")
            return True
        # sealed outside the lock: the pass over a whole state must not hold up page calls
        header = encode_state_header(spec, key, tokens, origin, payload)
        with self._lock:
            self._make_state_room()
            code = self._call("put_parts", okey, header, payload)
            if code == NO_SPACE and self._state_lru:
                self._evict_states(1)
                code = self._call("put_parts", okey, header, payload)
            if code != 0:
                self.counters.add("state_full_rejects" if code == NO_SPACE else
                                  "state_write_errors")
                self._warn.warning("write", "mooncake: put of state %s failed with %s",
                                   key.hex(), code)
                return False
            self._touch_state(key)
        self.counters.add_many(states_written=1, state_bytes_written=spec.state_bytes)
        return True

    def get_state_into(self, key: bytes, out: torch.Tensor, tokens: int | None = None
                       ) -> str | None:
        spec = self._state_spec()
        view = state_view(out)
        check_state(spec, view)
        with self._lock:
            blob = self._call("get", self._state_key(key))
        if blob is None or len(blob) == 0:
            self.counters.add("state_misses")
            return None
        verdict, origin = decode_state_object(spec, key, blob, tokens)
        if verdict is not StateVerdict.OK:
            self.counters.record_failed_state_read(verdict)
            if verdict is not StateVerdict.NEEDS_KEY:
                self._rejected_states.mark(key)
            return None
        view[:] = memoryview(blob)[len(blob) - spec.state_bytes:]
        with self._lock:
            self._touch_state(key)
        self.counters.add_many(states_read=1, state_bytes_read=spec.state_bytes)
        return origin

    def exists_state(self, key: bytes) -> bool:
        self._state_spec()
        with self._lock:
            return self._call("is_exist", self._state_key(key)) == 1

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        self._state_spec()
        out: list[bool] = []
        for start in range(0, len(keys), self._batch):
            chunk = keys[start : start + self._batch]
            with self._lock:
                found = self._call("batch_is_exist", [self._state_key(k) for k in chunk])
            out += [flag == 1 for flag in found] if found is not None else [False] * len(chunk)
        return out

    def delete_states(self, keys: Sequence[bytes]) -> None:
        self._state_spec()
        with self._lock:
            for key in keys:
                self._state_lru.pop(key, None)
            codes = self._call("batch_remove", [self._state_key(k) for k in keys], True)
        if codes is not None:
            self.counters.add("deleted_states", sum(1 for c in codes if c == 0))

    def read_state_object(self, key: bytes) -> bytes | None:
        """The raw stored state object of `key` (tools, fault tests)."""
        with self._lock:
            blob = self._call("get", self._state_key(key))
        return bytes(blob) if blob else None

    def write_state_object(self, key: bytes, blob: bytes) -> bool:
        """Replace the stored state object of `key` with raw bytes (fault tests, repair)."""
        with self._lock:
            self._call("remove", self._state_key(key), True)
            return self._call("put", self._state_key(key), blob) == 0

    def _state_key(self, key: bytes) -> str:
        return self._state_prefix + key.hex()

    def _touch_state(self, key: bytes) -> None:
        self._state_lru[key] = None
        self._state_lru.move_to_end(key)

    def _make_state_room(self) -> None:
        if self.state_capacity:
            self._evict_states(len(self._state_lru) + 1 - self.state_capacity)

    def _evict_states(self, count: int) -> None:
        victims = [self._state_lru.popitem(last=False)[0]
                   for _ in range(min(count, len(self._state_lru)))]
        if victims:
            self._call("batch_remove", [self._state_key(k) for k in victims], True)
            self.counters.add("state_evictions", len(victims))

    # tools

    def keys(self) -> list[bytes]:
        """Pages this client wrote or read (the store cannot list objects by prefix)."""
        with self._lock:
            return list(self._lru)

    def clear(self) -> int:
        """Remove every page of this namespace, by any client; the number removed."""
        with self._lock:
            for key in self._lru:
                if self._lifecycle is not None:
                    self._lifecycle.removed(key)
            self._lru.clear()
            removed = self._call("remove_by_regex", f"^{re.escape(self._prefix)}", True)
        return max(0, removed or 0)

    def read_object(self, key: bytes) -> bytes | None:
        with self._lock:
            blob = self._call("get", self._object_key(key))
        return bytes(blob) if blob else None

    def write_object(self, key: bytes, blob: bytes) -> bool:
        """Replace the stored object of `key` with raw bytes (fault tests, repair tools)."""
        with self._lock:
            self._call("remove", self._object_key(key), True)
            return self._call("put", self._object_key(key), blob) == 0

    # internals

    def _object_key(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def _call(self, method: str, *args: Any) -> Any:
        """A store call, or None while the master is considered down (caller holds the lock)."""
        if self._closed or time.monotonic() < self._down_until:
            return None
        result = getattr(self._store, method)(*args)
        codes = result if isinstance(result, list) else [result]
        if any(isinstance(c, int) and c == RPC_FAILED for c in codes):
            self._down_until = time.monotonic() + self.config.retry_interval_s
            self.counters.add("metadata_errors")
            self._warn.warning(
                "rpc",
                "mooncake: master %s unreachable (%s); storage misses",
                self.config.mooncake_master,
                method,
            )
            return None
        return result

    def _get_chunk(self, keys: Sequence[bytes], pages: Sequence[HostPage]) -> list[str | None]:
        with self._lock:
            buffers = [self._page_buffers(self._headers[j].data_ptr(), p) for j, p in enumerate(pages)]
            okeys = [self._object_key(k) for k in keys]
            codes = self._call(
                "batch_get_into_multi_buffers",
                okeys,
                [ptrs for ptrs, _ in buffers],
                [sizes for _, sizes in buffers],
            )
            if codes is None:
                self.counters.add_many(misses=len(keys), read_errors=len(keys))
                return [None] * len(keys)
            return [
                self._check_read(j, k, p, c) for j, (k, p, c) in enumerate(zip(keys, pages, codes))
            ]

    def _check_read(self, j: int, key: bytes, page: HostPage, code: int) -> str | None:
        if code == NOT_FOUND:
            self.counters.add("misses")
            return None
        if code < 0:
            return self._classify_failed_read(key, code)
        header = memoryview(self._headers[j].numpy())
        verdict, origin = verify_page(self.spec, key, header, payload_views(page), code)
        if verdict is not Verdict.OK:
            self.counters.record_failed_read(verdict)
            self._rejected.refuse(key, verdict)
            return None
        self._touch(key)
        self.counters.add_many(pages_read=1, bytes_read=self.spec.payload_bytes)
        return origin

    def _classify_failed_read(self, key: bytes, code: int) -> None:
        """A failed get is a corrupt page when the object has the wrong size, else an error."""
        size = self._store.get_size(self._object_key(key)) if code != RPC_FAILED else -1
        if code == BUFFER_TOO_SMALL or (size >= 0 and size != self.spec.object_bytes):
            verdict = Verdict.TRUNCATED if 0 <= size < self.spec.object_bytes else Verdict.FOREIGN
            self.counters.record_failed_read(verdict)
            self._rejected.refuse(key, verdict)
        else:
            log.debug("mooncake: get of %s failed with %d", key.hex(), code)
            self.counters.add_many(misses=1, read_errors=1)
        return None

    def _put_chunk(
        self, keys: Sequence[bytes], pages: Sequence[HostPage], origin: str, session: str = ""
    ) -> list[bool]:
        with self._lock:
            exist = self._call("batch_is_exist", [self._object_key(k) for k in keys])
            if exist is None:
                self.counters.add("write_errors", len(keys))
                return [False] * len(keys)
            results = [flag == 1 for flag in exist]
            for key, present in zip(keys, results):
                if present:
                    self.counters.add("pages_skipped")
                    self._touch(key, session)
            todo = [j for j, present in enumerate(results) if not present]
            for j, ok in zip(todo, self._write(todo, keys, pages, origin, session)):
                results[j] = ok
        return results

    def _write(
        self,
        todo: list[int],
        keys: Sequence[bytes],
        pages: Sequence[HostPage],
        origin: str,
        session: str = "",
    ) -> list[bool]:
        if not todo:
            return []
        for j in todo:
            header = encode_header(self.spec, keys[j], origin, payload_views(pages[j]))
            self._headers[j].numpy()[:] = memoryview(header)
        self._make_room(len(todo))
        codes = self._put_objects(todo, keys, pages)
        if codes is not None and NO_SPACE in codes and self._lru:
            retry = [j for j, c in zip(todo, codes) if c == NO_SPACE]
            self._evict(len(retry))
            again = self._put_objects(retry, keys, pages) or [RPC_FAILED] * len(retry)
            by_index = dict(zip(retry, again))
            codes = [by_index.get(j, c) for j, c in zip(todo, codes)]
        written = [
            self._check_write(keys[j], c, session) for j, c in zip(todo, codes or [-1] * len(todo))
        ]
        self._make_room(0)  # a batch larger than the capacity keeps only its newest pages
        return written

    def _put_objects(
        self, todo: list[int], keys: Sequence[bytes], pages: Sequence[HostPage]
    ) -> list[int] | None:
        okeys = [self._object_key(keys[j]) for j in todo]
        buffers = [self._page_buffers(self._headers[j].data_ptr(), pages[j]) for j in todo]
        return self._call("batch_put_from_multi_buffers", okeys, [p for p, _ in buffers],
                          [s for _, s in buffers])

    def _check_write(self, key: bytes, code: int, session: str = "") -> bool:
        if code != 0:
            self.counters.add("full_rejects" if code == NO_SPACE else "write_errors")
            self._warn.warning("write", "mooncake: put of %s failed with %d", key.hex(), code)
            return False
        self._touch(key, session)
        self.counters.add_many(pages_written=1, bytes_written=self.spec.payload_bytes)
        return True

    def _touch(self, key: bytes, session: str | None = None) -> None:
        """LRU refresh; `session` (a str, "" for none) marks a write, None a read."""
        self._lru[key] = None
        self._lru.move_to_end(key)
        if self._lifecycle is not None:
            if session is None:
                self._lifecycle.touched(key)
            else:
                self._lifecycle.stored(key, session)

    def _pop_victim(self) -> bytes:
        """The next page this client evicts (lifecycle order, else LRU), out of the index."""
        if self._lifecycle is not None:
            key = self._lifecycle.evict()
            if key is not None:
                self._lru.pop(key, None)
                return key
        return self._lru.popitem(last=False)[0]

    def _make_room(self, incoming: int) -> None:
        if self.capacity_pages:
            self._evict(len(self._lru) + incoming - self.capacity_pages)

    def _evict(self, count: int) -> None:
        victims = [self._pop_victim() for _ in range(min(count, len(self._lru)))]
        if victims:
            self._call("batch_remove", [self._object_key(k) for k in victims], True)
            self.counters.add("evictions", len(victims))


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


CLUSTER_ID_ENV = "MC_STORE_CLUSTER_ID"


def _set_cluster_id(cluster_id: str) -> None:
    """Masters in HA mode publish their leader under a cluster id, which the Mooncake client
    reads only from MC_STORE_CLUSTER_ID: set from `[storage.mooncake] cluster_id` right before
    setup. One process holds one cluster: another id already set is an error, not a guess."""
    current = os.environ.get(CLUSTER_ID_ENV)
    if current not in (None, "", cluster_id):
        raise ValueError(f"{CLUSTER_ID_ENV}={current} in the environment, but the topology's "
                         f"storage.mooncake.cluster_id is {cluster_id!r}")
    os.environ[CLUSTER_ID_ENV] = cluster_id


def find_master_binary() -> str:
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return str(beside)
    raise FileNotFoundError(f"mooncake_master not found: pip install {MOONCAKE_PACKAGE}")


class LocalMooncakeMaster:
    """A `mooncake_master` on free loopback ports (tests, benchmarks, local demos).

    Use as a context manager, or call start() / stop(); stop() always kills the process.
    """

    def __init__(self, host: str = "127.0.0.1", log_path: str | None = None) -> None:
        self.host = host
        self.rpc_port = _free_port(host)
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def start(self, timeout_s: float = 20.0) -> LocalMooncakeMaster:
        argv = [
            find_master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={_free_port(self.host)}",
            "--enable_http_metadata_server=false",
        ]
        env = {
            **os.environ,
            "MC_TCP_BIND_ADDRESS": self.host,
            "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
        }
        if self._log_path:
            with open(self._log_path, "ab") as out:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        else:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            try:
                socket.create_connection((self.host, self.rpc_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"mooncake_master not ready on {self.address} after {timeout_s}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("mooncake_master %d did not exit after SIGKILL", self.proc.pid)
        self.proc = None

    def __enter__(self) -> LocalMooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
