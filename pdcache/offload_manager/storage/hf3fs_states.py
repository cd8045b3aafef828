"""State objects of an hf3fs store (docs/design.md §4.4): a slot pool of their own.

A state object (state_format.py: a 256-byte header and one request's recurrent state, 73.7
MiB on the real Qwen3-Next) is far larger than a page slot and of one size per store (its
geometry), so states do not span page slots: they get their own pool, `{namespace}.state{N}`
(`StorageConfig.state_pool_name`), of `state_capacity` slots of `N = state_slot_bytes`
(header + state, 4 KiB-aligned) in their own data files `{pool}.{i}.bin` (slot `s` in file `s
% num_data_files`), indexed like pages: an in-process `SlotIndex` rebuilt from the slot
headers on open, or the same `pdcache metadata-server` as the pages (another pool; its HA,
authentication and group commit apply unchanged). Writes go reserve -> write -> commit (or
abort), as pages; eviction is the index's LRU among states. Why not multi-slot objects in the
page pool: a state would need ~150 page slots (512 KiB pages), as many index entries to
reserve and commit atomically, and could be half-evicted; one slot per state keeps a state
whole or absent.

Thread-safety: the metadata client and the counters lock; I/O is positional on descriptors
opened once, so concurrent calls are safe. Posix I/O only (a `usrbio` store stores states
through the FUSE mount the same way).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pdcache.offload_manager.storage.config import (
    PRIVATE_FILE_MODE,
    StorageConfig,
    make_private_dir,
    make_private_file,
)
from pdcache.offload_manager.storage.hf3fs import FULL_ERRNOS, SlotFileAccess, io_full
from pdcache.offload_manager.storage.metadata import (
    BUSY,
    NEW,
    PRESENT,
    InProcMetadata,
    MetadataClient,
    MetadataUnavailable,
    RemoteMetadata,
)
from pdcache.offload_manager.storage.state_format import (
    STATE_HEADER_BYTES,
    StateBuffer,
    StateSpec,
    StateVerdict,
    check_state,
    encode_state_header,
    parse_state_header,
    state_view,
    verify_state,
)
from pdcache.offload_manager.storage.stats import RateLimitedLog, RejectedKeys, StorageCounters

log = logging.getLogger(__name__)


class Hf3fsStateSlots(SlotFileAccess):
    """The state slot pool of one `Hf3fsBackend` (module docstring). Owns its data files and
    its metadata client; counts into the backend's `counters`."""

    def __init__(self, config: StorageConfig, spec: StateSpec, counters: StorageCounters,
                 read_only: bool = False) -> None:
        self.config = config
        self.spec = spec
        self.counters = counters
        self.slot_bytes = config.state_slot_bytes
        self._warn = RateLimitedLog(log)
        self._rejected = RejectedKeys()
        self._dir = Path(config.path)
        pool = config.state_pool_name
        self._paths = [self._dir / f"{pool}.{i}.bin" for i in range(config.num_data_files)]
        self.metadata = self._make_metadata(config, pool)
        self._fds: list[int] = []
        try:
            self._open_files(read_only)
            if isinstance(self.metadata, InProcMetadata) and config.recover_index:
                self.metadata.load(self._scan_headers())
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _make_metadata(cfg: StorageConfig, pool: str) -> MetadataClient:
        if cfg.metadata == "inproc":
            return InProcMetadata(cfg.state_capacity, cfg.reservation_ttl_s)
        return RemoteMetadata(cfg.metadata, pool, cfg.state_capacity, cfg.state_slot_bytes,
                              cfg.timeout_s, cfg.retry_interval_s, auth_key=cfg.metadata_key)

    def _open_files(self, read_only: bool) -> None:
        """Opens (creating and sizing, sparse) every data file into `self._fds`."""
        per_file = -(-self.metadata.num_slots // len(self._paths))
        try:
            make_private_dir(self._dir)
        except OSError as exc:  # as the page files: opening below says what is wrong
            log.warning("hf3fs: cannot create %s (%s)", self._dir, exc)
        for path in self._paths:
            if read_only:
                try:
                    self._fds.append(os.open(path, os.O_RDONLY))
                except FileNotFoundError:
                    self._fds.append(-1)  # nothing stored: every read fails (EBADF), a miss
                continue
            fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
            make_private_file(fd, path)
            self._fds.append(fd)
            try:
                if os.fstat(fd).st_size < per_file * self.slot_bytes:
                    os.ftruncate(fd, per_file * self.slot_bytes)  # sparse
            except OSError as exc:  # e.g. a file-size limit: slots past it fail on write
                log.warning("hf3fs: cannot size %s (%s)", path, exc)

    def _where(self, slot: int) -> tuple[int, int]:
        nfiles = len(self._fds)
        return self._fds[slot % nfiles], (slot // nfiles) * self.slot_bytes

    def _scan_headers(self) -> list[tuple[bytes, int]]:
        """(key, slot) of every slot holding a valid state header of this store."""
        found = []
        header = bytearray(STATE_HEADER_BYTES)
        for slot in range(self.metadata.num_slots):
            fd, offset = self._where(slot)
            try:
                n = os.preadv(fd, [header], offset)
            except OSError:
                n = 0
            verdict, info = parse_state_header(self.spec, header[:n])
            if verdict is StateVerdict.OK and info is not None:
                found.append((info.key, slot))
        return found

    # the backend's state calls

    def put(self, key: bytes, state: StateBuffer, tokens: int, origin: str,
            session: str) -> bool:
        payload = state_view(state)
        check_state(self.spec, payload)
        if self._rejected.take([key]):
            self.delete([key])
            self.counters.add("replaced_rejected_states")
        try:
            status, slot = self.metadata.reserve([key], session)[0]
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            self.counters.add("state_write_errors")
            return False
        if status in (PRESENT, BUSY):
            self.counters.add("states_skipped")
            return True
        if status != NEW:  # FULL (an unknown status is refused alike)
            self.counters.add("state_full_rejects")
            return False
        try:  # sealed once the slot is ours: a skipped state costs no pass over its bytes
            header = memoryview(encode_state_header(self.spec, key, tokens, origin, payload))
        except BaseException:
            self.metadata.abort([key], [slot])
            raise
        return self._write(key, slot, header, payload, session)

    def _write(self, key: bytes, slot: int, header: memoryview, payload: memoryview,
               session: str) -> bool:
        fd, offset = self._where(slot)
        try:
            written = io_full(os.pwritev, fd, [header, payload], offset)
        except OSError as exc:
            written = -(exc.errno or 0)
        try:
            if written != self.spec.object_bytes:
                self._warn.warning("write", "hf3fs: write of state slot %d failed (%d of %d "
                                   "bytes)", slot, written, self.spec.object_bytes)
                self.counters.add("state_write_errors")
                # no room in the file system for this slot: never handed out again
                self.metadata.abort([key], [slot], retire=-written in FULL_ERRNOS)
                return False
            committed = self.metadata.commit([key], [slot], session)[0]
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            self.counters.add("state_write_errors")
            return False
        if not committed:
            self.counters.add("state_write_errors")
            return False
        self.counters.add_many(states_written=1, state_bytes_written=self.spec.state_bytes)
        return True

    def get_into(self, key: bytes, out: torch.Tensor, tokens: int | None) -> str | None:
        payload = state_view(out)
        check_state(self.spec, payload)
        try:
            slot = self.metadata.lookup([key])[0]
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            slot = None
        if slot is None:
            self.counters.add("state_misses")
            return None
        fd, offset = self._where(slot)
        header = memoryview(bytearray(STATE_HEADER_BYTES))
        try:
            nbytes = io_full(os.preadv, fd, [header, payload], offset)
        except OSError:
            self.counters.add_many(state_read_errors=1, state_misses=1)
            return None
        verdict, origin = verify_state(self.spec, key, header, payload, nbytes, tokens)
        if verdict is not StateVerdict.OK:
            self.counters.record_failed_state_read(verdict)
            if verdict is not StateVerdict.NEEDS_KEY:
                self._rejected.mark(key)
            return None
        self.counters.add_many(states_read=1, state_bytes_read=self.spec.state_bytes)
        return origin

    def exists(self, key: bytes) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: list[bytes]) -> list[bool]:
        """One metadata lookup for all `keys` (all False while the metadata is down)."""
        try:
            return [slot is not None for slot in self.metadata.lookup(keys)]
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            return [False] * len(keys)

    def delete(self, keys: list[bytes]) -> None:
        """Zero each header first (a header scan never resurrects it), then free the slot."""
        try:
            slots = self.metadata.lookup(keys)
            live = [(k, s) for k, s in zip(keys, slots) if s is not None]
            zero = bytes(STATE_HEADER_BYTES)
            for _, slot in live:
                fd, offset = self._where(slot)
                try:
                    os.pwrite(fd, zero, offset)
                except OSError as exc:
                    log.debug("hf3fs: cannot zero state slot %d: %s", slot, exc)
            freed = self.metadata.delete([k for k, _ in live])
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            return
        self.counters.add("deleted_states", len(freed))

    def stats(self) -> dict[str, int]:
        try:
            index = self.metadata.stats()
        except MetadataUnavailable as exc:
            self._metadata_down(exc)
            return {}
        names = {"capacity_pages": "state_capacity", "used_pages": "used_states",
                 "reserved_pages": "reserved_states", "free_pages": "free_states",
                 "evictions": "state_evictions",
                 "expired_reservations": "state_expired_reservations"}
        return {names.get(name, f"state_{name}"): value for name, value in index.items()}

    def close(self) -> None:
        fds, self._fds = self._fds, []  # as Hf3fsBackend._close_files: never closed twice
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        self.metadata.close()

    def _metadata_down(self, exc: MetadataUnavailable) -> None:
        self.counters.add("metadata_errors")
        self._warn.warning("metadata", "hf3fs: metadata unavailable, state misses: %s", exc)
