"""The `hf3fs` backend: 3FS layout of a few large data files split into fixed page slots.

Slot `s` lives in data file `s % num_data_files` at offset `(s // num_data_files) *
slot_bytes` and holds `header || payload` (page_format.py), padded to 4 KiB. The key -> slot
map is a MetadataClient: in-process (rebuilt from the slot headers on open) or the shared
`pdcache metadata-server`. Writes are reserve -> write -> commit; a failed write is aborted.

IO engines: `posix` reads with one `preadv` per page straight into the host page (header into
a small buffer, payload into the page, or into its runs when the page is given as a tuple of
runs: no extra copy) and verifies the checksum there; works on any directory or a 3FS FUSE
mount. State objects (state_format.py) live in a slot pool of their own
(`hf3fs_states.Hf3fsStateSlots`). `usrbio` uses the 3FS native client (`hf3fs_py_usrbio`)
through a shared-memory iovec and copies into the host page.

Each page is read and verified in turn (a usrbio ring batch at a time); several I/O threads
each read and verify (seal and write) their own chunk. With sealed pages and one I/O thread a
batch can move in groups (`page_pipeline.group_pages_for`: at least 2 MiB; for usrbio at least
half its ring): the pipeline's helper thread verifies group g while this thread reads group
g+1, and seals group g+1 while this thread writes group g. By default (`pipeline_pages`
None) each batch runs that way or page by page, whichever measured faster lately: the
pipeline needs a free core (docs/security.md "Verified beside the read").

Thread-safety: the metadata client and counters lock; file descriptors are only used with
positional IO, so concurrent batches are safe.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import (
    PRIVATE_FILE_MODE,
    StorageConfig,
    make_private_dir,
    make_private_file,
)
from pdcache.offload_manager.storage.layer_reads import (
    LayerStream,
    PageVerdict,
    count_verdicts,
    page_reads,
    read_layer_major,
)
from pdcache.offload_manager.storage.metadata import (
    BUSY,
    FULL,
    NEW,
    PRESENT,
    InProcMetadata,
    MetadataClient,
    MetadataUnavailable,
    RemoteMetadata,
)
from pdcache.offload_manager.storage.page_format import (
    HEADER_BYTES,
    HostPage,
    PageSpec,
    Verdict,
    check_host_batch,
    encode_header,
    parse_header,
    payload_views,
    verify_page,
)
from pdcache.offload_manager.storage.page_pipeline import PagePipeline, group_pages_for
from pdcache.offload_manager.storage.state_format import StateBuffer
from pdcache.offload_manager.storage.stats import RateLimitedLog, RejectedKeys, StorageCounters
from pdcache.utils.registry import import_optional

if TYPE_CHECKING:
    from pdcache.offload_manager.storage.hf3fs_states import Hf3fsStateSlots

log = logging.getLogger(__name__)

# a write failing with one of these found no room in the file system for its slot (sparse data
# files get a slot's blocks on its first write): that slot is retired, not handed out again
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
DELETE_BATCH = 4096  # keys per metadata request of a delete (a clear of a large pool)
T = TypeVar("T")
R = TypeVar("R")
_ReadGroup = tuple[list[int], list["SlotIO"], list[int]]  # page indexes, their IOs, bytes read
_SealedGroup = tuple[list[tuple[int, int]], list["SlotIO"]]  # (index, slot) items, their IOs


@dataclass
class SlotIO:
    """One page's IO: where (fd, offset) and the buffers (header, payload runs in order)."""

    fd: int
    offset: int
    header: memoryview
    payload: list[memoryview]

    @property
    def payload_bytes(self) -> int:
        return sum(len(part) for part in self.payload)


class IoEngine(ABC):
    """Positional reads/writes of whole slots. Returns bytes done, or -errno, per request."""

    name: str
    batch_pages: int  # requests per read_batch/write_batch call that suit this engine

    @abstractmethod
    def read_batch(self, reqs: Sequence[SlotIO]) -> list[int]: ...

    @abstractmethod
    def write_batch(self, reqs: Sequence[SlotIO]) -> list[int]: ...

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        """Release rings and buffers. Idempotent."""


def io_full(op: Callable[..., int], fd: int, bufs: list[memoryview], offset: int) -> int:
    """Repeat `preadv`/`pwritev` until all of `bufs` is done or the file ends."""
    want = sum(map(len, bufs))
    done = 0
    while done < want:
        n = op(fd, bufs, offset + done)
        if n <= 0:
            break
        done += n
        bufs = _advance(bufs, n)
    return done


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    out: list[memoryview] = []
    for buf in bufs:
        if n >= len(buf):
            n -= len(buf)
            continue
        out.append(buf[n:])
        n = 0
    return out


class PosixEngine(IoEngine):
    """pread/pwrite on file descriptors: one vectored syscall per page, no bounce buffer."""

    name = "posix"
    batch_pages = 1  # read and verify page by page while it is hot in cache

    def read_batch(self, reqs: Sequence[SlotIO]) -> list[int]:
        return [self._one(os.preadv, r) for r in reqs]

    def write_batch(self, reqs: Sequence[SlotIO]) -> list[int]:
        return [self._one(os.pwritev, r) for r in reqs]

    @staticmethod
    def _one(op: Callable[..., int], req: SlotIO) -> int:
        try:
            return io_full(op, req.fd, [req.header, *req.payload], req.offset)
        except OSError as exc:
            return -(exc.errno or errno.EIO)


class UsrbioEngine(IoEngine):
    """3FS native client (hf3fs_py_usrbio): IO through a registered shared-memory iovec.

    The host page cannot be the iovec (3FS needs its own shared memory), so a read lands in
    the iovec and is copied into the host page; a write copies the other way. One iovec and
    one ring pair per backend: a batch holds `_lock` from its copies in to its copies out
    (the backup and prefetch workers call one backend at once; sharing the iovec's slots,
    writes reported success for pages whose bytes another batch had overwritten).
    """

    name = "usrbio"

    def __init__(self, mount_point: str, fds: Sequence[int], slot_bytes: int, entries: int):
        self._mod = import_optional(
            "hf3fs_py_usrbio", "hf3fs io_engine 'usrbio'", "hf3fs-py-usrbio"
        )
        if not mount_point:
            raise ValueError("storage.usrbio_mount must name the 3FS mount point for usrbio")
        self._slot_bytes = slot_bytes
        self._entries = entries
        self.batch_pages = entries
        self._fds = list(fds)
        self._shm = shared_memory.SharedMemory(create=True, size=entries * slot_bytes)
        self._iov = self._mod.make_iovec(self._shm, mount_point)
        self._read_ring = self._mod.make_ioring(mount_point, entries, for_read=True)
        self._write_ring = self._mod.make_ioring(mount_point, entries, for_read=False)
        self._lock = threading.Lock()  # the iovec's slots and the rings: one batch at a time
        for fd in self._fds:
            self._mod.register_fd(fd)

    def read_batch(self, reqs: Sequence[SlotIO]) -> list[int]:
        results: list[int] = []
        for start in range(0, len(reqs), self._entries):
            chunk = reqs[start : start + self._entries]
            with self._lock:
                done = self._submit(self._read_ring, chunk, for_read=True)
                for i, (req, n) in enumerate(zip(chunk, done)):
                    if n > 0:
                        self._copy_out(i, req, n)
            results.extend(done)
        return results

    def write_batch(self, reqs: Sequence[SlotIO]) -> list[int]:
        results: list[int] = []
        for start in range(0, len(reqs), self._entries):
            chunk = reqs[start : start + self._entries]
            with self._lock:
                for i, req in enumerate(chunk):
                    self._copy_in(i, req)
                results.extend(self._submit(self._write_ring, chunk, for_read=False))
        return results

    def _submit(self, ring: Any, chunk: Sequence[SlotIO], for_read: bool) -> list[int]:
        for i, req in enumerate(chunk):
            base = i * self._slot_bytes
            length = len(req.header) + req.payload_bytes
            ring.prepare(self._iov[base : base + length], for_read, req.fd, req.offset, userdata=i)
        done = [-errno.EIO] * len(chunk)
        for result in ring.submit().wait(min_results=len(chunk)):
            done[int(result.userdata)] = int(result.result)
        return done

    def _copy_out(self, i: int, req: SlotIO, nbytes: int) -> None:
        buf = self._shm.buf[i * self._slot_bytes : i * self._slot_bytes + nbytes]
        head = min(nbytes, len(req.header))
        req.header[:head] = buf[:head]
        start = head
        for part in req.payload:
            count = min(len(part), nbytes - start)
            if count <= 0:
                break
            part[:count] = buf[start : start + count]
            start += count

    def _copy_in(self, i: int, req: SlotIO) -> None:
        base = i * self._slot_bytes
        self._shm.buf[base : base + len(req.header)] = req.header
        start = base + len(req.header)
        for part in req.payload:
            self._shm.buf[start : start + len(part)] = part
            start += len(part)

    def close(self) -> None:
        for fd in self._fds:
            self._mod.deregister_fd(fd)
        self._fds = []
        self._shm.close()
        self._shm.unlink()


def _split(items: list[T], parts: int) -> list[list[T]]:
    size = max(1, -(-len(items) // parts))
    return [items[i : i + size] for i in range(0, len(items), size)]


class SlotFileAccess:
    """Raw access to a committed slot of a pool striped over data files (tools, fault
    tests, repair): `Hf3fsBackend`'s page slots and `Hf3fsStateSlots`' state slots. Needs
    `metadata` (the pool's index), `_paths` (its data files), `slot_bytes` and
    `spec.object_bytes`; reads and writes outside the caller's own I/O path."""

    metadata: MetadataClient
    _paths: list[Path]
    slot_bytes: int
    spec: Any

    def locate(self, key: bytes) -> tuple[Path, int] | None:
        """(data file, byte offset) of the committed slot of `key`."""
        slot = self.metadata.lookup([key])[0]
        if slot is None:
            return None
        return self._paths[slot % len(self._paths)], (slot // len(self._paths)) * self.slot_bytes

    def read_object(self, key: bytes) -> bytes | None:
        where = self.locate(key)
        if where is None:
            return None
        with open(where[0], "rb") as f:
            f.seek(where[1])
            return f.read(self.spec.object_bytes)

    def write_object(self, key: bytes, blob: bytes) -> bool:
        """Overwrite the start of `key`'s committed slot with raw bytes (fault tests, repair)."""
        where = self.locate(key)
        if where is None:
            return False
        fd = os.open(where[0], os.O_WRONLY)
        try:
            return os.pwrite(fd, blob, where[1]) == len(blob)
        finally:
            os.close(fd)


class Hf3fsBackend(SlotFileAccess, StorageBackend):
    """Page slots in large data files + key -> slot metadata (docs/design.md §4.4)."""

    def __init__(self, config: StorageConfig, metadata: MetadataClient | None = None) -> None:
        self.config = config
        self.spec: PageSpec = config.page_spec()
        self.slot_bytes = config.slot_bytes
        self.counters = StorageCounters()
        self._warn = RateLimitedLog(log)
        # slots whose write found the file system full (I/O threads add, `_publish` takes):
        # aborted as retired, so the index stops handing them out (`SlotIndex.abort`)
        self._unwritable: set[int] = set()
        self._unwritable_lock = threading.Lock()
        self._rejected = RejectedKeys()  # keys whose stored page a read here refused
        self._closed = False
        self.read_only = False
        self._dir = Path(config.path)
        self._paths = [
            self._dir / f"{config.pool_name}.{i}.bin" for i in range(config.num_data_files)
        ]
        self.metadata = metadata or self._make_metadata()
        self._fds = self._open_files(self.metadata.num_slots)
        try:
            self.engine = self._make_engine()
        except BaseException:
            self._close_files()
            raise
        self._pool = ThreadPoolExecutor(config.io_threads) if config.io_threads > 1 else None
        # one I/O thread, sealed pages: verify and seal page groups on a helper beside the I/O
        # (page_pipeline.py; by default each call as measured faster); a usrbio group is at
        # least half its ring, so the ring stays full
        pipeline = config.pipeline_pages
        if pipeline is None and not isinstance(self.engine, PosixEngine):
            pipeline = 0  # "auto" was measured with posix I/O only (usrbio needs a 3FS mount)
        grouping = group_pages_for(pipeline, config.page_bytes, self.spec.sealer is not None)
        read_group, write_group = (max(g, self.engine.batch_pages // 2) if g else 0
                                   for g in (grouping.read, grouping.write))
        self._pipeline = PagePipeline(read_group, inline_group=self.engine.batch_pages,
                                      write_group_pages=write_group,
                                      adaptive=grouping.adaptive and self._pool is None)
        if isinstance(self.metadata, InProcMetadata) and config.recover_index:
            self.metadata.load(self._scan_headers())
        self.state_spec = config.state_spec()
        self._states: Hf3fsStateSlots | None = None
        if self.state_spec is not None:
            from pdcache.offload_manager.storage.hf3fs_states import Hf3fsStateSlots

            try:
                self._states = Hf3fsStateSlots(config, self.state_spec, self.counters,
                                               self.read_only)
            except BaseException:
                self.close()
                raise

    # setup

    def _make_metadata(self) -> MetadataClient:
        cfg = self.config
        if cfg.metadata == "inproc":
            lifecycle = cfg.make_lifecycle(cfg.num_pages, cfg.slot_bytes)
            return InProcMetadata(cfg.num_pages, cfg.reservation_ttl_s, lifecycle)
        return RemoteMetadata(
            cfg.metadata,
            cfg.pool_name,
            cfg.num_pages,
            cfg.slot_bytes,
            cfg.timeout_s,
            cfg.retry_interval_s,
            auth_key=cfg.metadata_key,
        )

    def _open_files(self, num_slots: int) -> list[int]:
        per_file = -(-num_slots // len(self._paths))
        try:
            make_private_dir(self._dir)
        except OSError as exc:
            log.warning("hf3fs: cannot create %s (%s)", self._dir, exc)
        return [self._open_one(p, per_file * self.slot_bytes) for p in self._paths]

    def _open_one(self, path: Path, size: int) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            log.warning("hf3fs: %s is not writable (%s); read-only", path, exc)
            self.read_only = True
            try:
                return os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return -1  # nothing stored here and nothing can be: every IO fails (EBADF)
        make_private_file(fd, path)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # sparse: blocks are allocated when slots are written
        except OSError as exc:  # e.g. a file-size limit: slots past it fail on write
            log.warning("hf3fs: cannot size %s to %d bytes (%s)", path, size, exc)
        return fd

    def _make_engine(self) -> IoEngine:
        cfg = self.config
        if cfg.io_engine == "usrbio":
            return UsrbioEngine(cfg.usrbio_mount, self._fds, self.slot_bytes, cfg.usrbio_entries)
        return PosixEngine()

    def _scan_headers(self) -> list[tuple[bytes, int]]:
        """(key, slot) of every slot whose header is valid for this store."""
        found = []
        header = bytearray(HEADER_BYTES)
        for slot in range(self.metadata.num_slots):
            fd, offset = self._where(slot)
            try:
                n = os.preadv(fd, [header], offset)
            except OSError:
                n = 0
            verdict, info = parse_header(self.spec, header[:n])
            if verdict is Verdict.OK and info is not None:
                found.append((info.key, slot))
            elif verdict not in (Verdict.EMPTY, Verdict.TRUNCATED):
                self.counters.add("rejected_slots")  # unreadable or foreign header: not indexed
        return found

    # StorageBackend

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        try:
            return self.metadata.exists_prefix(keys)
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            return 0

    def get_into(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[HostPage],
        origins: list[str | None] | None = None,
    ) -> list[bool]:
        check_host_batch(self.spec, keys, host_pages)
        if origins is not None:
            origins[:] = [None] * len(keys)
        try:
            slots = self.metadata.lookup(keys)
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            self.counters.add("misses", len(keys))
            return [False] * len(keys)
        hits = [i for i, s in enumerate(slots) if s is not None]
        found = self._read_pages(hits, keys, slots, host_pages)
        # served pages counted once per call (the lock and the update cost ~2 us a call); a
        # refused or unread page was counted (as a miss, with its reason) where it was seen
        served = sum(origin is not None for origin in found)
        self.counters.add_many(misses=len(keys) - len(hits), pages_read=served,
                               bytes_read=served * self.spec.payload_bytes)
        results = [False] * len(keys)
        for i, origin in zip(hits, found):
            results[i] = origin is not None
            if origins is not None:
                origins[i] = origin
        return results

    def read_layers(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor],
                    stream: LayerStream, origins: list[str | None] | None = None) -> list[bool]:
        """`get_into`, layer-major (`layer_reads.read_layer_major`): headers, then layer 0 of
        every page, layer 1, ..., reported to `stream`; pages verified once complete. Posix
        engine only (`streams_layers`)."""
        check_host_batch(self.spec, keys, host_pages)
        try:
            slots = self.metadata.lookup(keys)
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            self.counters.add("misses", len(keys))
            stream.finish([])
            return [False] * len(keys)

        def locate(i: int) -> tuple[int, int] | None:
            slot = slots[i]
            return None if slot is None else self._where(slot)

        verdicts = read_layer_major(self.spec, page_reads(keys, host_pages, locate), stream)
        return self._count_verdicts(keys, verdicts, origins)

    @property
    def streams_layers(self) -> bool:
        """Whether `read_layers` works here: positional reads straight into host pages."""
        return isinstance(self.engine, PosixEngine)

    def _count_verdicts(self, keys: Sequence[bytes], verdicts: Sequence[PageVerdict],
                        origins: list[str | None] | None) -> list[bool]:
        return count_verdicts(self.counters, self._rejected, self.spec.payload_bytes, keys,
                              verdicts, origins)

    def put_from(
        self, keys: Sequence[bytes], host_pages: Sequence[HostPage], origin: str = "prefill",
        namespace: str = "",  # tenant quotas are not enforced here (docs/design.md §8)
        session: str = "",  # the metadata index's lifecycle (eviction = "session") uses it
    ) -> list[bool]:
        check_host_batch(self.spec, keys, host_pages)
        if self.read_only:  # a reservation would evict another node's page for nothing
            self.counters.add("write_errors", len(keys))
            return [False] * len(keys)
        self._replace_rejected(keys)
        try:
            reservations = self.metadata.reserve(keys, session)
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            self.counters.add("write_errors", len(keys))
            return [False] * len(keys)
        results = [False] * len(keys)
        todo = []
        for i, (status, slot) in enumerate(reservations):
            if status in (PRESENT, BUSY):
                results[i] = True
                self.counters.add("pages_skipped")
            elif status == FULL:
                self.counters.add("full_rejects")
            elif status == NEW:
                todo.append((i, slot))
        written = self._write_pages(todo, keys, host_pages, origin)
        self._publish(keys, todo, written, results, session)
        return results

    def _replace_rejected(self, keys: Sequence[bytes]) -> None:
        """Free the slots of `keys` whose page a read here refused, so the put reserves and
        writes them anew instead of skipping them as PRESENT."""
        stale = self._rejected.take(keys)
        if stale:
            self.delete(stale)
            self.counters.add("replaced_rejected_pages", len(stale))

    def end_session(self, session: str) -> None:
        try:
            self.metadata.end_session(session)
        except MetadataUnavailable:
            self.counters.add("metadata_errors")

    def delete(self, keys: Sequence[bytes]) -> None:
        if self.read_only:  # the header stays (no write access): keep the slot its owner's
            return
        try:
            self._delete_all(keys)
        except MetadataUnavailable:
            self.counters.add("metadata_errors")

    def _delete_all(self, keys: Sequence[bytes]) -> int:
        """Delete `keys` a batch at a time (one request of every key of a large pool passed
        the service's message limit: dropped, and nothing was deleted); how many were.
        Raises MetadataUnavailable."""
        deleted = 0
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            slots = self.metadata.lookup(batch)
            live = [(k, s) for k, s in zip(batch, slots) if s is not None]
            # Invalidate the header first so a header scan can never resurrect the page.
            zero = memoryview(bytearray(HEADER_BYTES))
            self.engine.write_batch([SlotIO(*self._where(s), zero, []) for _, s in live])
            freed = self.metadata.delete([k for k, _ in live])
            self.counters.add("deleted_pages", len(freed))
            deleted += len(freed)
        return deleted

    def stats(self) -> dict[str, int | float]:
        out = self.counters.snapshot()
        try:
            out.update(self.metadata.stats())
        except MetadataUnavailable:
            self.counters.add("metadata_errors")
        out["read_only"] = int(self.read_only)
        out.update(self._pipeline.stats())
        if self._states is not None:
            out.update(self._states.stats())
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pipeline.close()
        self.engine.close()
        self._close_files()
        if self._states is not None:
            self._states.close()

    def _close_files(self) -> None:
        # taken before closing: a second close (another thread's) finds none, and never
        # closes a number the kernel has given to someone else's socket since
        fds, self._fds = self._fds, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        self.metadata.close()

    def register_host_memory(self, tensor: torch.Tensor) -> None:
        """Nothing to register: positional file IO reads straight into any host memory."""

    # state objects: their own slot pool (hf3fs_states.py)

    @property
    def supports_states(self) -> bool:
        return self._states is not None

    def put_state(self, key: bytes, state: StateBuffer, tokens: int, origin: str = "prefill",
                  namespace: str = "",  # tenant quotas are not enforced here (§8)
                  session: str = "") -> bool:
        if self.read_only:  # as `put_from`: no reservation, a counted failure
            self.counters.add("write_errors")
            return False
        return self._state_slots().put(key, state, tokens, origin, session)

    def get_state_into(self, key: bytes, out: torch.Tensor, tokens: int | None = None
                       ) -> str | None:
        return self._state_slots().get_into(key, out, tokens)

    def exists_state(self, key: bytes) -> bool:
        return self._state_slots().exists(key)

    def exists_states(self, keys: Sequence[bytes]) -> list[bool]:
        return self._state_slots().exists_many(list(keys))

    def delete_states(self, keys: Sequence[bytes]) -> None:
        if not self.read_only:
            self._state_slots().delete(list(keys))

    def read_state_object(self, key: bytes) -> bytes | None:
        """The raw stored state object of `key` (tools, fault tests)."""
        return self._state_slots().read_object(key)

    def write_state_object(self, key: bytes, blob: bytes) -> bool:
        """Overwrite the start of `key`'s committed state slot with raw bytes (fault tests)."""
        return self._state_slots().write_object(key, blob)

    def _state_slots(self) -> Hf3fsStateSlots:
        self._state_spec()  # ValueError without a state geometry
        assert self._states is not None
        return self._states

    # tools: raw access for `pdcache storage`, fault tests and debugging

    def keys(self) -> list[bytes]:
        return [k for k, _ in self.metadata.entries()]

    def clear(self) -> int:
        """Delete every page; how many were. Raises MetadataUnavailable when the index could
        not be reached (the storage CLI reported a clear that deleted nothing as done)."""
        if self.read_only:
            return 0
        return self._delete_all(self.keys())

    # internals

    def _metadata_down(self, exc: MetadataUnavailable) -> None:
        self.counters.add("metadata_errors")
        self._warn.warning("metadata", "hf3fs: metadata unavailable, storage misses: %s", exc)

    def _where(self, slot: int) -> tuple[int, int]:
        nfiles = len(self._fds)
        return self._fds[slot % nfiles], (slot // nfiles) * self.slot_bytes

    def _map_chunks(self, fn: Callable[[list[T]], list[R]], items: list[T]) -> list[R]:
        """`fn` over items in engine-sized sub-batches, spread over the IO threads."""
        step = self.engine.batch_pages

        def run(chunk: list[T]) -> list[R]:
            return [r for k in range(0, len(chunk), step) for r in fn(chunk[k : k + step])]

        if self._pool is None or len(items) < 2:
            return run(items)
        done = self._pool.map(run, _split(items, self.config.io_threads))
        return [r for chunk in done for r in chunk]

    def _read_pages(self, idxs: list[int], keys: Sequence[bytes], slots: Sequence[int | None],
                    pages: Sequence[HostPage]) -> list[str | None]:
        """Read pages `idxs` into their host pages and verify them: origin, or None each. Several
        I/O threads read and verify their own chunks; one verifies beside its reads."""
        def read(group: list[int]) -> _ReadGroup:
            return self._read_group(group, slots, pages)

        def verify(done: _ReadGroup) -> list[str | None]:
            return self._verify_group(done, keys)

        if self._pool is not None:
            return self._map_chunks(lambda chunk: verify(read(chunk)), idxs)
        return self._pipeline.read_then_verify(idxs, read, verify)

    def _read_group(self, idxs: list[int], slots: Sequence[int | None],
                    pages: Sequence[HostPage]) -> _ReadGroup:
        reqs = []
        for i in idxs:
            fd, offset = self._where(slots[i])  # type: ignore[arg-type]
            reqs.append(
                SlotIO(fd, offset, memoryview(bytearray(HEADER_BYTES)), payload_views(pages[i]))
            )
        return idxs, reqs, self.engine.read_batch(reqs)

    def _verify_group(self, done: _ReadGroup, keys: Sequence[bytes]) -> list[str | None]:
        """Origins of a read group's pages (None: refused or unread, counted here; the pages
        served are counted by `get_into`)."""
        idxs, reqs, nbytes = done
        return [self._verify(keys[i], req, n) for i, req, n in zip(idxs, reqs, nbytes)]

    def _verify(self, key: bytes, req: SlotIO, nbytes: int) -> str | None:
        """The page's origin, or None (a failed read or a refused page: counted here; a served
        page is counted by the caller)."""
        if nbytes < 0:
            self.counters.add_many(read_errors=1, misses=1)
            return None
        verdict, origin = verify_page(self.spec, key, req.header, req.payload, nbytes)
        if verdict is not Verdict.OK:
            self.counters.record_failed_read(verdict)
            self._rejected.refuse(key, verdict)
            return None
        return origin

    def _write_pages(self, items: list[tuple[int, int]], keys: Sequence[bytes],
                     pages: Sequence[HostPage], origin: str) -> list[bool]:
        """Seal and write (index, slot) `items`: written or not, each. Several I/O threads seal
        and write their own chunks; one writes beside the helper's sealing of the next group."""
        def seal(group: list[tuple[int, int]]) -> _SealedGroup:
            return self._seal_group(group, keys, pages, origin)

        if self._pool is not None:
            return self._map_chunks(lambda chunk: self._write_group(seal(chunk)), items)
        return self._pipeline.seal_then_write(items, seal, self._write_group)

    def _seal_group(self, items: list[tuple[int, int]], keys: Sequence[bytes],
                    pages: Sequence[HostPage], origin: str) -> _SealedGroup:
        reqs = []
        for i, slot in items:
            payload = payload_views(pages[i])
            header = memoryview(encode_header(self.spec, keys[i], origin, payload))
            reqs.append(SlotIO(*self._where(slot), header, payload))
        return items, reqs

    def _write_group(self, sealed: _SealedGroup) -> list[bool]:
        items, reqs = sealed
        nbytes = self.engine.write_batch(reqs)
        want = self.spec.object_bytes
        for (_, slot), n in zip(items, nbytes):
            if n != want:
                reason = os.strerror(-n) if n < 0 else f"short write {n}/{want}"
                self._warn.warning("write", "hf3fs: write of slot %d failed: %s", slot, reason)
                self.counters.add("write_errors")
                if -n in FULL_ERRNOS:
                    with self._unwritable_lock:
                        self._unwritable.add(slot)
        return [n == want for n in nbytes]

    def _publish(
        self,
        keys: Sequence[bytes],
        todo: list[tuple[int, int]],
        written: list[bool],
        results: list[bool],
        session: str = "",
    ) -> None:
        """Commit the slots that were written (for `session`), abort the others."""
        done = [(i, s) for (i, s), ok in zip(todo, written) if ok]
        failed = [(i, s) for (i, s), ok in zip(todo, written) if not ok]
        with self._unwritable_lock:
            full = [(i, s) for i, s in failed if s in self._unwritable]
            self._unwritable.difference_update(s for _, s in full)
        failed = [item for item in failed if item not in full]
        try:
            if full:  # the file system has no room for these slots: the pool shrinks
                self.metadata.abort([keys[i] for i, _ in full], [s for _, s in full], retire=True)
                self.counters.add("retired_slots", len(full))
            if failed:
                self.metadata.abort([keys[i] for i, _ in failed], [s for _, s in failed])
            committed = self.metadata.commit(
                [keys[i] for i, _ in done], [s for _, s in done], session
            )
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            self.counters.add("write_errors", len(done))
            return
        for (i, _), ok in zip(done, committed):
            results[i] = ok
            if ok:
                self.counters.add_many(pages_written=1, bytes_written=self.spec.payload_bytes)
            else:
                self.counters.add("write_errors")
