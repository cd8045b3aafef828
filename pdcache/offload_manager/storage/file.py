"""The `file` backend: one file per page (`header || payload`), for debugging and small setups.

Layout: `{path}/{namespace}/{key[:1] hex}/{key hex}.page`, and state objects (state_format.py)
beside them as `{key hex}.state` (their own LRU of `state_capacity` objects). A put writes a
temporary file in the same directory and renames it into place, so readers never see a partial page (and a crash
leaves only a temp file). Existence is the file system's, so several processes may share a
directory; capacity (LRU) is enforced on the pages this process knows about (those present at
open, then those it writes or reads). Tenant quotas (`StorageConfig.namespace_quotas`, bytes
of stored objects, headers included: pages and state objects alike): an object written for a
tenant namespace at its quota first evicts that namespace's least recently used objects, never
another tenant's; the owner of a page is known for the pages this process wrote
(pages found at open belong to no tenant). `eviction = "session"`: the capacity evicts by
conversation (`storage.lifecycle`: closed sessions' pages first, active sessions' protected
within the bound); quotas still evict a tenant's own LRU page. Thread-safe: the LRU index
(and the lifecycle) has a lock; a put reserves its slot before writing the file, and a slot
whose file is still being written is never the capacity's victim. Sealed pages (a page MAC
key): a batch may verify (seal) page groups on the `PagePipeline` helper thread beside the
caller's reads (writes) of the next group (page_pipeline.py). Index changes keep batch
order either way: a put's (skip, evict, store) are all made on the caller, the seal on the
helper only computes; a read's LRU refresh comes with its verify, group after group.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import (
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    StorageConfig,
    make_private_dir,
)
from pdcache.offload_manager.storage.hf3fs import io_full
from pdcache.offload_manager.storage.layer_reads import (
    LayerStream,
    count_verdicts,
    page_reads,
    read_layer_major,
)
from pdcache.offload_manager.storage.page_format import (
    HEADER_BYTES,
    HostPage,
    Verdict,
    check_host_batch,
    encode_header,
    payload_nbytes,
    payload_views,
    verify_page,
)
from pdcache.offload_manager.storage.page_pipeline import PagePipeline, group_pages_for
from pdcache.offload_manager.storage.state_format import (
    STATE_HEADER_BYTES,
    StateBuffer,
    StateVerdict,
    check_state,
    encode_state_header,
    state_view,
    verify_state,
)
from pdcache.offload_manager.storage.stats import RateLimitedLog, RejectedKeys, StorageCounters

log = logging.getLogger(__name__)
# one page read (`FileBackend._read`): key, header buffer, payload views, bytes read (-1: none)
_PageRead = tuple[bytes, memoryview, list[memoryview], int]
# one page to write (`FileBackend._seal`): key, sealed header (None: the page was stored when
# sealed), payload views
_PageWrite = tuple[bytes, bytes | None, list[memoryview]]
SUFFIX = ".page"
STATE_SUFFIX = ".state"
STALE_TEMP_S = 600.0  # a temp file this old belongs to no live writer


def _present(path: Path) -> bool:
    """Whether `path` exists. An error looking (EACCES on a shard directory, a stale NFS
    handle) is "not here": the write or read that follows fails counted, never raises out of
    the backend (`Path.exists` re-raises every error but a missing file)."""
    try:
        return path.exists()
    except OSError:
        return False


class FileBackend(StorageBackend):
    """One file per page with atomic rename (docs/design.md §4.4)."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.spec = config.page_spec()
        self.root = Path(config.path) / config.namespace
        self._root_prefix = f"{self.root}{os.sep}"
        self.capacity_pages = config.num_pages  # 0: unlimited
        self.counters = StorageCounters()
        self._warn = RateLimitedLog(log)
        self._rejected = RejectedKeys()  # keys whose stored page a read here refused
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        # keys whose slot a put reserved and whose file it is still writing (how many puts):
        # never a victim, or the put's finish would bring back a page that has no room
        self._writing: dict[bytes, int] = {}
        slot = HEADER_BYTES + config.page_bytes  # what one stored page costs a quota
        self._page_cost = slot
        self._quotas = dict(config.namespace_quotas)  # tenant namespace -> bytes
        self._owner: dict[bytes, str] = {}  # key -> tenant namespace (quota'd ones only)
        # namespace -> its objects (pages and states) and their bytes, LRU; and their sum
        self._owned: dict[str, OrderedDict[bytes, int]] = {}
        self._owned_bytes: dict[str, int] = {}
        self.state_spec = config.state_spec()
        self.state_capacity = config.state_capacity  # 0: unlimited
        self._state_lru: OrderedDict[bytes, None] = OrderedDict()
        self._rejected_states = RejectedKeys()  # state keys whose object a read here refused
        self._lifecycle = config.make_lifecycle(self.capacity_pages, slot)
        self._lock = threading.Lock()
        # sealed pages: the MAC of a page group on a helper beside the next group's I/O, each
        # batch that way or page by page as measured faster (page_pipeline.py)
        grouping = group_pages_for(config.pipeline_pages, config.page_bytes,
                                   self.spec.sealer is not None)
        self._pipeline = PagePipeline(grouping.read, write_group_pages=grouping.write,
                                      adaptive=grouping.adaptive)
        try:
            make_private_dir(self.root)
        except OSError as exc:
            log.warning("file storage: cannot create %s (%s); puts will fail", self.root, exc)
        self._load_index()

    def _load_index(self) -> None:
        """Known pages, oldest modification first (the LRU order after a restart); temp files
        that a crashed writer left long ago are removed."""
        stale_before = time.time() - STALE_TEMP_S
        for tmp in self.root.glob("*/.*.tmp"):
            with contextlib.suppress(OSError):
                if tmp.stat().st_mtime < stale_before:
                    tmp.unlink()
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                found.append((path.stat().st_mtime_ns, bytes.fromhex(path.stem)))
            except (OSError, ValueError):
                continue
        for _, key in sorted(found):
            self._lru[key] = None
            if self._lifecycle is not None:
                self._lifecycle.touched(key)  # no session known: unprotected
        states = []
        for path in self.root.glob(f"*/*{STATE_SUFFIX}"):
            try:
                states.append((path.stat().st_mtime_ns, bytes.fromhex(path.stem)))
            except (OSError, ValueError):
                continue
        for _, key in sorted(states):
            self._state_lru[key] = None

    def page_path(self, key: bytes) -> Path:
        return Path(self._page_file(key))

    def _page_file(self, key: bytes) -> str:
        """`page_path` as a str, for the per-page hot paths (pathlib costs ~10 us a page)."""
        name = key.hex()
        return f"{self._root_prefix}{name[:2]}{os.sep}{name}{SUFFIX}"

    # StorageBackend

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if not os.path.exists(self._page_file(key)):
                break
            count += 1
        return count

    def get_into(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        origins: list[str | None] | None = None,
    ) -> list[bool]:
        check_host_batch(self.spec, keys, host_pages)
        found = self._pipeline.read_then_verify(
            list(zip(keys, host_pages)), self._read_group, self._verify_group)
        if origins is not None:
            origins[:] = found
        return [origin is not None for origin in found]

    def read_layers(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor],
                    stream: LayerStream, origins: list[str | None] | None = None) -> list[bool]:
        """`get_into`, layer-major (`layer_reads.read_layer_major`): headers, then layer 0 of
        every page, layer 1, ..., reported to `stream`; pages verified once complete. Every
        page file stays open for the read (an eviction meanwhile unlinks, never changes it)."""
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys but {len(host_pages)} host pages")
        fds: list[int] = []

        def locate(i: int) -> tuple[int, int] | None:
            if len(fds) < i:  # an earlier page is missing: the usable prefix ended there
                return None
            try:
                fds.append(os.open(self.page_path(keys[i]), os.O_RDONLY))
            except OSError:
                return None
            return fds[-1], 0

        try:
            reads = page_reads(keys, host_pages, locate)
            verdicts = read_layer_major(self.spec, reads, stream)
        finally:
            for fd in fds:
                os.close(fd)
        for key, verdict in zip(keys, verdicts):
            if verdict is not None and verdict[0] is Verdict.OK:
                self._touch_read(key)
        return count_verdicts(self.counters, self._rejected, self.spec.payload_bytes, keys,
                              verdicts, origins)

    @property
    def streams_layers(self) -> bool:
        """`read_layers` works on any directory."""
        return True

    def put_from(
        self, keys: Sequence[bytes], host_pages: Sequence[HostPage], origin: str = "prefill",
        namespace: str = "",
        session: str = "",
    ) -> list[bool]:
        check_host_batch(self.spec, keys, host_pages)
        owner = namespace if namespace in self._quotas else ""
        self._replace_rejected(keys)

        def seal(group: list[tuple[bytes, HostPage]]) -> list[_PageWrite]:
            return [self._seal(key, page, origin) for key, page in group]

        def write(sealed: list[_PageWrite]) -> list[bool]:
            return [self._write(*page, origin, owner, session) for page in sealed]

        return self._pipeline.seal_then_write(list(zip(keys, host_pages)), seal, write)

    def _replace_rejected(self, keys: Sequence[bytes]) -> None:
        """Unlink the pages of `keys` that a read here refused, so the put writes them anew."""
        stale = self._rejected.take(keys)
        if stale:
            self.delete(stale)
            self.counters.add("replaced_rejected_pages", len(stale))

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if self._unlink(key):
                self.counters.add("deleted_pages")

    def end_session(self, session: str) -> None:
        if self._lifecycle is not None:
            with self._lock:
                self._lifecycle.end_session(session)

    def stats(self) -> dict[str, int | float]:
        out = self.counters.snapshot()
        with self._lock:
            out["used_pages"] = len(self._lru)
            if self._lifecycle is not None:
                out.update({f"lifecycle_{k}": v for k, v in self._lifecycle.stats().items()})
            out["used_states"] = len(self._state_lru)
        out["state_capacity"] = self.state_capacity
        out.setdefault("quota_evictions", 0)
        out.update(_capacity_stats(self.capacity_pages, int(out["used_pages"])))
        out.update(self._pipeline.stats())
        return out

    def close(self) -> None:
        """Joins the pipeline's helper thread; no file is held open between calls."""
        self._pipeline.close()

    def register_host_memory(self, tensor: torch.Tensor) -> None:
        """Nothing to register: positional file IO reads straight into any host memory."""

    # state objects (state_format.py)

    @property
    def supports_states(self) -> bool:
        return self.state_spec is not None

    def put_state(self, key: bytes, state: StateBuffer, tokens: int, origin: str = "prefill",
                  namespace: str = "", session: str = "") -> bool:
        spec = self._state_spec()
        payload = state_view(state)
        check_state(spec, payload)
        if self._rejected_states.take([key]):
            self.delete_states([key])
            self.counters.add("replaced_rejected_states")
        path = self.state_path(key)
        if _present(path):  # before the seal: a skipped state costs no pass over its bytes
            with self._lock:
                self._touch_state_locked(key, "")
            self.counters.add("states_skipped")
            return True
        header = encode_state_header(spec, key, tokens, origin, payload)
        owner = namespace if namespace in self._quotas else ""
        if owner:
            self._make_quota_room(owner, spec.object_bytes)
        if not self._make_state_room(key):
            self.counters.add("state_full_rejects")
            return False
        return self._write_state(key, path, header, payload, owner)

    def _write_state(self, key: bytes, path: Path, header: bytes, payload: memoryview,
                     owner: str) -> bool:
        """Write a state whose place `_make_state_room` reserved; index it, or give it back."""
        assert self.state_spec is not None
        try:
            self._write_atomic(path, header, [payload])
        except OSError as exc:
            self._warn.warning("write", "file storage: writing %s failed: %s", path, exc)
            self.counters.add("state_write_errors")
            with self._lock:
                self._end_write_locked(key)
                if not _present(path):
                    self._state_lru.pop(key, None)
            return False
        with self._lock:
            self._end_write_locked(key)
            self._touch_state_locked(key, owner)
        self.counters.add_many(states_written=1, state_bytes_written=self.state_spec.state_bytes)
        return True

    def get_state_into(self, key: bytes, out: torch.Tensor, tokens: int | None = None
                       ) -> str | None:
        spec = self._state_spec()
        payload = state_view(out)
        check_state(spec, payload)
        header = memoryview(bytearray(STATE_HEADER_BYTES))
        try:
            fd = os.open(self.state_path(key), os.O_RDONLY)
            try:
                # a state is tens of MiB: one preadv may return short; a short object is
                # refused as truncated (and its key rejected), so read until done or EOF
                nbytes = io_full(os.preadv, fd, [header, payload], 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self.counters.add("state_misses")
            return None
        except OSError:
            self.counters.add_many(state_read_errors=1, state_misses=1)
            return None
        verdict, origin = verify_state(spec, key, header, payload, nbytes, tokens)
        if verdict is not StateVerdict.OK:
            self.counters.record_failed_state_read(verdict)
            if verdict is not StateVerdict.NEEDS_KEY:  # valid for keyed readers: keep it
                self._rejected_states.mark(key)
            return None
        with self._lock:
            if key in self._state_lru:  # not put back when evicted meanwhile
                self._touch_state_locked(key, "")
        self.counters.add_many(states_read=1, state_bytes_read=spec.state_bytes)
        return origin

    def exists_state(self, key: bytes) -> bool:
        return _present(self.state_path(key))

    def delete_states(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            with self._lock:
                removed = self._unlink_state_locked(key)
            if removed:
                self.counters.add("deleted_states")

    def state_path(self, key: bytes) -> Path:
        name = key.hex()
        return Path(f"{self._root_prefix}{name[:2]}{os.sep}{name}{STATE_SUFFIX}")

    def _make_state_room(self, key: bytes) -> bool:
        """Evict least recently used states (never one being written) until `key` fits
        `state_capacity`, and reserve its place; False if nothing can go."""
        with self._lock:
            while (self.state_capacity and key not in self._state_lru
                   and len(self._state_lru) >= self.state_capacity):
                victim = next((k for k in self._state_lru if k not in self._writing), None)
                if victim is None:
                    return False
                self._unlink_state_locked(victim)
                self.counters.add("state_evictions")
            self._state_lru[key] = None
            self._writing[key] = self._writing.get(key, 0) + 1
            return True

    def _touch_state_locked(self, key: bytes, owner: str) -> None:
        self._state_lru[key] = None
        self._state_lru.move_to_end(key)
        assert self.state_spec is not None
        self._own_locked(key, owner, self.state_spec.object_bytes)

    def _unlink_state_locked(self, key: bytes) -> bool:
        self._state_lru.pop(key, None)
        self._disown_locked(key)
        try:
            self.state_path(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.debug("file storage: cannot delete state %s: %s", key.hex(), exc)
            return False
        return True

    def read_state_object(self, key: bytes) -> bytes | None:
        """The raw stored state object of `key` (tools, fault tests)."""
        try:
            return self.state_path(key).read_bytes()
        except OSError:
            return None

    def write_state_object(self, key: bytes, blob: bytes) -> bool:
        """Replace the stored state object of `key` with raw bytes (fault tests, repair)."""
        try:
            self._write_atomic(self.state_path(key), blob, [])
        except OSError:
            return False
        with self._lock:
            self._touch_state_locked(key, "")
        return True

    # tools

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._lru)

    def clear(self) -> None:
        self.delete(self.keys())

    def read_object(self, key: bytes) -> bytes | None:
        try:
            return self.page_path(key).read_bytes()
        except OSError:
            return None

    def write_object(self, key: bytes, blob: bytes) -> bool:
        """Replace the stored file of `key` with raw bytes (fault tests, repair tools)."""
        try:
            self._write_atomic(self.page_path(key), blob, [])
        except OSError:
            return False
        self._touch(key)
        return True

    # internals

    def _read_group(self, group: list[tuple[bytes, HostPage]]) -> list[_PageRead]:
        return [self._read(key, page) for key, page in group]

    def _verify_group(self, reads: list[_PageRead]) -> list[str | None]:
        return [self._verify(read) for read in reads]

    def _read(self, key: bytes, page: HostPage) -> _PageRead:
        """The page's file read into (header, `page`): how many bytes, or -1 (counted) when
        there is none or it could not be read."""
        payload = payload_views(page)  # its size checked by check_host_batch
        header = memoryview(bytearray(HEADER_BYTES))
        try:
            fd = os.open(self._page_file(key), os.O_RDONLY)
            try:
                nbytes = os.preadv(fd, [header, *payload], 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self.counters.add("misses")
            return key, header, payload, -1
        except OSError:
            self.counters.add_many(read_errors=1, misses=1)
            return key, header, payload, -1
        return key, header, payload, nbytes

    def _verify(self, read: _PageRead) -> str | None:
        """The origin of a page read by `_read`, or None (refused: counted here)."""
        key, header, payload, nbytes = read
        if nbytes < 0:
            return None
        verdict, origin = verify_page(self.spec, key, header, payload, nbytes)
        if verdict is not Verdict.OK:
            self.counters.record_failed_read(verdict)
            self._rejected.refuse(key, verdict)
            return None
        self._touch_read(key)
        self.counters.add_many(pages_read=1, bytes_read=self.spec.payload_bytes)
        return origin

    def _seal(self, key: bytes, page: HostPage, origin: str) -> _PageWrite:
        """(key, header, payload views) of a page to write, its header carrying the MAC or
        checksum (the CPU pass over the payload: on the pipeline's helper when pipelined).
        A page whose file is there gets no header (None): `_write` decides, in batch order on
        the caller, whether it is skipped, before anyone pays for that pass. Reads nothing but
        the file system: every index change stays on the caller."""
        payload = payload_views(page)
        if os.path.exists(self._page_file(key)):
            return key, None, payload
        return key, encode_header(self.spec, key, origin, payload), payload

    def _write(
        self, key: bytes, header: bytes | None, payload: list[memoryview], origin: str,
        owner: str = "", session: str = ""
    ) -> bool:
        path = self.page_path(key)
        if _present(path) and self._refresh_present(key, session):
            self.counters.add("pages_skipped")
            return True
        if header is None:  # stored when sealed, gone since (evicted, deleted): seal it here
            header = encode_header(self.spec, key, origin, payload)
        if owner:
            self._make_quota_room(owner, self._page_cost)
        if not self._make_room(key):
            self.counters.add("full_rejects")
            return False
        try:
            self._write_atomic(path, header, payload)
        except OSError as exc:
            self._warn.warning("write", "file storage: writing %s failed: %s", path, exc)
            self.counters.add("write_errors")
            with self._lock:  # give back the slot _make_room reserved
                self._end_write_locked(key)
                if not _present(path):
                    self._lru.pop(key, None)
            return False
        if not self._commit_write(key, owner, session):
            self.counters.add("full_rejects")
            return False
        self.counters.add_many(pages_written=1, bytes_written=self.spec.payload_bytes)
        return True

    def _commit_write(self, key: bytes, owner: str, session: str) -> bool:
        """The page's file is in place: index it. Its reserved slot may have gone meanwhile
        (a delete of the key): then it needs room again, and without any the page goes."""
        with self._lock:
            self._end_write_locked(key)
            if key not in self._lru and not self._fit_one_locked():
                self._unlink_locked(key)
                return False
            self._stored_locked(key, owner, session)
        return True

    def _end_write_locked(self, key: bytes) -> None:
        left = self._writing[key] - 1
        if left:
            self._writing[key] = left
        else:
            del self._writing[key]

    def _write_atomic(self, path: Path, header: bytes, payload: list[memoryview]) -> None:
        path.parent.mkdir(PRIVATE_DIR_MODE, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
            try:
                want = len(header) + payload_nbytes(payload)
                if os.writev(fd, [header, *payload]) != want:
                    raise OSError(errno.ENOSPC, "short write")
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _make_room(self, key: bytes) -> bool:
        """Evict least recently used pages until `key` fits, and reserve its slot in the LRU
        in the same critical section (concurrent writers cannot both take the last slot);
        False if nothing can go."""
        with self._lock:
            if key not in self._lru and not self._fit_one_locked():
                return False
            self._lru[key] = None
            self._writing[key] = self._writing.get(key, 0) + 1
            return True

    def _fit_one_locked(self) -> bool:
        """Evict until one more page fits the capacity; False if nothing can go."""
        while self.capacity_pages and len(self._lru) >= self.capacity_pages:
            victim = self._victim_locked()
            if victim is None:
                return False
            self._unlink_locked(victim)
            self.counters.add("evictions")
        return True

    def _victim_locked(self) -> bytes | None:
        """The next page the capacity evicts: the lifecycle's (closed sessions first; it
        knows only stored pages), or the least recently used page not being written; None
        when nothing can go (only reserved slots left)."""
        if self._lifecycle is not None:
            return self._lifecycle.evict()
        return next((key for key in self._lru if key not in self._writing), None)

    def _make_quota_room(self, owner: str, incoming: int) -> None:
        """Evict `owner`'s least recently used objects (pages, states) until `incoming` more
        bytes fit its quota: a tenant at its quota makes room from its own objects only (an
        object larger than the whole quota is still stored, alone)."""
        while True:
            with self._lock:
                owned = self._owned.get(owner)
                if not owned or self._owned_bytes[owner] + incoming <= self._quotas[owner]:
                    return
                victim = next(iter(owned))
                if victim in self._state_lru:
                    self._unlink_state_locked(victim)
                else:
                    self._unlink_locked(victim)
            self.counters.add("quota_evictions")

    def _refresh_present(self, key: bytes, session: str) -> bool:
        """A put of a page found on disk: refresh it, unless it was evicted since (False: the
        put writes it again). One known only to the directory (another process wrote it)
        takes a slot like a write."""
        with self._lock:  # unlinks happen under it: the file's presence is settled here
            if key not in self._lru and (not _present(self.page_path(key))
                                         or not self._fit_one_locked()):
                return False
            self._stored_locked(key, "", session)
        return True

    def _touch(self, key: bytes, owner: str = "", session: str = "") -> None:
        """A write's refresh (the page was written, or found present, for `session`)."""
        with self._lock:
            self._stored_locked(key, owner, session)

    def _stored_locked(self, key: bytes, owner: str, session: str) -> None:
        self._touch_locked(key, owner)
        if self._lifecycle is not None:
            self._lifecycle.stored(key, session)

    def _touch_locked(self, key: bytes, owner: str) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)
        self._own_locked(key, owner, self._page_cost)

    def _own_locked(self, key: bytes, owner: str, cost: int) -> None:
        """A write for `owner` ("": none) or a read: the object's place in its tenant's LRU
        (a read or a rewrite refreshes it there too) and its bytes in the tenant's sum."""
        if owner and self._owner.get(key, owner) != owner:
            self._disown_locked(key)  # rewritten for another tenant: it owns it now
        if owner:
            self._owner[key] = owner
        owner = self._owner.get(key, "")
        if not owner:
            return
        owned = self._owned.setdefault(owner, OrderedDict())
        if key not in owned:
            self._owned_bytes[owner] = self._owned_bytes.get(owner, 0) + cost
        owned[key] = cost
        owned.move_to_end(key)

    def _disown_locked(self, key: bytes) -> None:
        owner = self._owner.pop(key, "")
        if owner:
            cost = self._owned[owner].pop(key, None)
            if cost is not None:
                self._owned_bytes[owner] -= cost

    def _touch_read(self, key: bytes) -> None:
        """A read's LRU refresh. Unlinks happen under the lock, so a page evicted while it was
        being read (its file gone now) is not put back in the index."""
        with self._lock:
            if key in self._lru or _present(self.page_path(key)):
                self._touch_locked(key, "")
                if self._lifecycle is not None:
                    self._lifecycle.touched(key)

    def _unlink(self, key: bytes) -> bool:
        with self._lock:
            return self._unlink_locked(key)

    def _unlink_locked(self, key: bytes) -> bool:
        # the file goes under the lock: the index and the directory never disagree for long
        # enough that a reader re-adds an evicted key (see _touch_read)
        self._lru.pop(key, None)
        if self._lifecycle is not None:
            self._lifecycle.removed(key)
        self._disown_locked(key)
        try:
            self.page_path(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.debug("file storage: cannot delete %s: %s", key.hex(), exc)
            return False
        return True


def _capacity_stats(capacity: int, used: int) -> dict[str, int]:
    """Accounting keys shared with hf3fs (free + used + reserved == capacity when bounded; hf3fs
    adds its retired slots)."""
    free = max(0, capacity - used) if capacity else 0
    return {"capacity_pages": capacity, "free_pages": free, "reserved_pages": 0}
