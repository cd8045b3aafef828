"""Storage faults of `pdcache chaos`: a full disk, a read-only disk, corrupt pages, slow IO.

All of them are real (docs/chaos.md, "Storage and network faults"):

- `storage-full` and `storage-readonly` move the storage directory onto a small tmpfs of their
  own (`prepare` mounts WORK_DIR/storage-tmpfs and bind-mounts its `data` directory on
  WORK_DIR/storage, which becomes `storage.path`; both faults share that one mount). Full:
  the tmpfs is shrunk to what it holds now and the rest is taken by a filler file, so the next
  page write fails with ENOSPC; heal deletes the filler and restores the size. Read-only:
  `mount -o remount,ro,bind` of WORK_DIR/storage (EROFS for every write through it); heal
  remounts it rw. Root ignores file modes, hence mounts; both need root and `mount`.
- `storage-corrupt` flips bytes of stored objects where they lie (`.page` and `.state` files of
  the `file` backend, slots of the `hf3fs` page and state data files): in the header of some,
  in the payload of others; recurrent-state checkpoints (hybrid models) get half the picks
  while any is stored, so a store of thousands of pages and a few states still sees them hit.
  Nothing heals it: readers must refuse those objects (a counted miss,
  `pdcache_storage_rejected_pages_total{reason="header"|"checksum"|"mac"}`, `rejected_*_states`
  for states) and the next genuine write of the key replaces them (`RejectedKeys`).
- `storage-slow` writes a delay into the control file named by `[storage] fault_injection`
  (`pdcache.offload_manager.storage.fault_injection`); heal writes 0.

Mooncake Store keeps pages in its clients' memory segments, not in files: the file-level
faults report themselves unavailable there (only `storage-slow` applies).
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from pdcache.chaos.faults import Fault, FaultContext, Injection
from pdcache.chaos.os_tools import (
    FaultSetupError,
    missing_privilege,
    override,
    run_tool,
    storage_root,
)
from pdcache.offload_manager.storage.page_format import HEADER_BYTES, MAGIC, stored_payload_bytes
from pdcache.offload_manager.storage.state_format import STATE_HEADER_BYTES, STATE_MAGIC

TMPFS_DIR = "storage-tmpfs"  # WORK_DIR/storage-tmpfs: the tmpfs (its root holds the filler)
DATA_DIR = "data"  # the directory of the tmpfs that nodes store into
STORAGE_DIR = "storage"  # WORK_DIR/storage: bind mount of the data directory = storage.path
FILLER = "filler"
SLOW_CONTROL = "storage-slow.delay"
HEADROOM_BYTES = 64 << 20  # tmpfs size beyond storage.capacity: the store fills up by capacity
SLACK_BYTES = 1 << 20  # what a shrunk tmpfs keeps free, then taken by the filler
FILL_CHUNK = 1 << 20
REMOUNT_DEADLINE_S = 5.0  # a file-backend write in flight holds the mount busy briefly
FILE_BACKENDS = ("file", "hf3fs")


# --------------------------------------------------------------------------- the mount


class StorageMount:
    """The tmpfs + bind mount under WORK_DIR that storage-full and storage-readonly share.
    Idempotent: `ensure` mounts what is not mounted yet, `remove` unmounts what is."""

    def __init__(self, work_dir: Path, size_bytes: int) -> None:
        self.tmpfs = work_dir.resolve() / TMPFS_DIR
        self.data = self.tmpfs / DATA_DIR
        self.path = work_dir.resolve() / STORAGE_DIR
        self.filler = self.tmpfs / FILLER
        self.size_bytes = _round_up(size_bytes, 4096)

    def ensure(self) -> Path:
        if not os.path.ismount(self.tmpfs):
            self.tmpfs.mkdir(parents=True, exist_ok=True)
            run_tool(
                [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={self.size_bytes},mode=0755",
                    "pdcache-chaos",
                    str(self.tmpfs),
                ]
            )
        self.data.mkdir(exist_ok=True)
        if not os.path.ismount(self.path):
            self.path.mkdir(parents=True, exist_ok=True)
            run_tool(["mount", "--bind", str(self.data), str(self.path)])
        return self.path

    def remove(self) -> None:
        for mount_point in (self.path, self.tmpfs):
            if os.path.ismount(mount_point):
                if run_tool(["umount", str(mount_point)], check=False).returncode != 0:
                    run_tool(["umount", "-l", str(mount_point)])  # a straggler holds it open

    def used_bytes(self) -> int:
        st = os.statvfs(self.tmpfs)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def free_bytes(self) -> int:
        st = os.statvfs(self.tmpfs)
        return st.f_bavail * st.f_frsize

    def resize(self, size_bytes: int) -> bool:
        """Remount the tmpfs with a new size; False when it holds more than that already."""
        size = _round_up(size_bytes, 4096)
        return (
            run_tool(
                ["mount", "-o", f"remount,size={size}", str(self.tmpfs)], check=False
            ).returncode
            == 0
        )

    def read_only(self) -> bool:
        return bool(os.statvfs(self.path).f_flag & os.ST_RDONLY)

    def remount(self, mode: str) -> None:
        """`mode` "ro" or "rw" on the bind mount only (the tmpfs itself stays writable).
        Retried while a write in flight keeps the mount busy (EBUSY), up to a deadline."""
        deadline = time.monotonic() + REMOUNT_DEADLINE_S
        while True:
            done = run_tool(["mount", "-o", f"remount,{mode},bind", str(self.path)], check=False)
            if done.returncode == 0:
                return
            if time.monotonic() >= deadline:
                raise FaultSetupError(f"remount {mode} of {self.path}: {done.stderr.strip()}")
            time.sleep(0.01)  # retry: an open-for-write file keeps the mount busy


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def probe_mounts(work_dir: Path) -> str | None:
    """Why tmpfs and read-only bind mounts cannot be made here, or None (tries both for real
    on a 64 KiB tmpfs under WORK_DIR, and undoes them)."""
    missing = missing_privilege("mount", "umount")
    if missing:
        return missing
    work_dir.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(prefix=".mount-probe-", dir=work_dir))
    mount = StorageMount(probe, 64 << 10)
    try:
        mount.ensure()
        mount.remount("ro")
        if not mount.read_only():
            return "a read-only bind remount did not take effect"
    except FaultSetupError as exc:
        return f"cannot mount a tmpfs and a read-only bind mount here: {exc}"
    finally:
        try:
            mount.remove()
        finally:
            for leftover in (mount.path, mount.data, mount.tmpfs, probe):
                try:
                    leftover.rmdir()
                except OSError:
                    pass
    return None


def _file_backend_problem(ctx: FaultContext) -> str | None:
    backend = override(ctx, "storage.backend", ctx.topology.storage.backend)
    if backend not in FILE_BACKENDS:
        return (
            f'storage.backend = "{backend}": pages are not files here (Mooncake Store '
            "keeps them in its clients' memory segments; none: no storage)"
        )
    return None


class _MountedStorageFault(Fault):
    """Shared by storage-full and storage-readonly: the storage directory on our tmpfs."""

    def unavailable(self, ctx: FaultContext) -> str | None:
        return _file_backend_problem(ctx) or probe_mounts(ctx.work_dir)

    def _mount(self, ctx: FaultContext) -> StorageMount:
        capacity = int(override(ctx, "storage.capacity", ctx.topology.storage.capacity))
        return StorageMount(ctx.work_dir, capacity + HEADROOM_BYTES)

    def prepare(self, ctx: FaultContext) -> dict[str, str]:
        path = self._mount(ctx).ensure()
        ctx.say(f"{self.kind}: storage.path = {path} (a tmpfs of this soak)")
        return {"storage.path": json.dumps(str(path))}

    def cleanup(self, ctx: FaultContext) -> None:
        self._mount(ctx).remove()


class StorageFull(_MountedStorageFault):
    """A full disk: the storage tmpfs shrunk to its contents, its last bytes in a filler."""

    kind = "storage-full"

    def inject(self, ctx: FaultContext) -> Injection:
        mount = self._mount(ctx)
        for _ in range(20):  # writers may grow it between the measure and the remount
            if mount.resize(mount.used_bytes() + SLACK_BYTES):
                break
        else:
            raise FaultSetupError(f"could not shrink {mount.tmpfs} to its contents")
        filled = _fill(mount.filler)
        return Injection(
            self.kind,
            "storage",
            f"tmpfs shrunk to its contents + {filled} bytes "
            f"of filler; {mount.free_bytes()} bytes free",
        )

    def heal(self, ctx: FaultContext) -> None:
        mount = self._mount(ctx)
        mount.filler.unlink(missing_ok=True)
        if not mount.resize(mount.size_bytes):
            raise FaultSetupError(f"could not restore the size of {mount.tmpfs}")


def _fill(path: Path) -> int:
    """Allocate blocks in `path` until the file system says ENOSPC; bytes allocated."""
    done = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = os.fstat(fd).st_size
        chunk = FILL_CHUNK
        while chunk >= 4096:
            try:
                os.posix_fallocate(fd, done, chunk)
                done += chunk
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    return done


class StorageReadonly(_MountedStorageFault):
    """A read-only disk: the bind mount nodes store through, remounted ro (EROFS)."""

    kind = "storage-readonly"

    def unavailable(self, ctx: FaultContext) -> str | None:
        backend = override(ctx, "storage.backend", ctx.topology.storage.backend)
        if backend == "hf3fs":
            # Linux refuses a read-only remount while any file on the mount is open for
            # writing (EBUSY), and hf3fs nodes keep their data files open read-write.
            return (
                "hf3fs nodes keep their data files open read-write, and Linux refuses "
                "a read-only remount of a mount with open writers (EBUSY); only the file "
                "backend can be made read-only under running nodes"
            )
        return super().unavailable(ctx)

    def inject(self, ctx: FaultContext) -> Injection:
        mount = self._mount(ctx)
        mount.remount("ro")
        return Injection(self.kind, "storage", f"{mount.path} remounted read-only")

    def heal(self, ctx: FaultContext) -> None:
        self._mount(ctx).remount("rw")


# --------------------------------------------------------------------------- corrupt pages


class StorageCorrupt(Fault):
    """Flip bytes of stored objects in place (pages and recurrent states): headers of some,
    payloads of others."""

    kind = "storage-corrupt"
    pages_per_injection = 4

    def unavailable(self, ctx: FaultContext) -> str | None:
        return _file_backend_problem(ctx)

    def inject(self, ctx: FaultContext) -> Injection:
        pages, states = find_stored_pages(ctx), find_stored_states(ctx)
        # states are few next to pages: half the picks go to them, or a sample would miss them
        state_picks = min(len(states), self.pages_per_injection // 2)
        chosen = ctx.rng.sample(states, state_picks)
        chosen += ctx.rng.sample(pages, min(self.pages_per_injection - state_picks, len(pages)))
        headers = payloads = 0
        for index, stored in enumerate(chosen):
            if index % 2 == 0:
                where = stored.offset + ctx.rng.randrange(stored.header_bytes)
                headers += 1
            else:
                where = stored.offset + stored.header_bytes + ctx.rng.randrange(stored.payload_bytes)
                payloads += 1
            flip_byte(stored.path, where)
        return Injection(
            self.kind,
            "storage",
            f"flipped a header byte of {headers} and a payload byte of {payloads} of "
            f"{len(pages)} stored pages and {len(states)} stored states ({state_picks} "
            "of them states)",
        )

    def heal(self, ctx: FaultContext) -> None:
        """Nothing: corrupt objects are refused on read and replaced by the next write."""


def flip_byte(path: Path, offset: int) -> None:
    """XOR one byte of `path` with 0xFF, in place (the byte always changes)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        if len(old) == 1:
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


class StoredObject(NamedTuple):
    """Where one stored object lies: its file, the offset of its header, and the sizes of its
    header (pages and states have their own) and payload."""

    path: Path
    offset: int
    header_bytes: int
    payload_bytes: int


class _ObjectFormat(NamedTuple):
    """How to recognise one kind of stored object: its magic, header size, and how to read
    the payload size from a header (None: not a valid header of this kind)."""

    magic: bytes
    header_bytes: int
    payload_bytes: Callable[[bytes], int | None]


def _state_payload_bytes(head: bytes) -> int | None:
    """Payload bytes a state header declares (state_format's `_BODY`: 4s H H 32s 16s 16s Q
    then Q), or None when it is not a state header."""
    if len(head) < _STATE_LENGTH.size + _STATE_LENGTH_OFFSET or head[:4] != STATE_MAGIC:
        return None
    (length,) = _STATE_LENGTH.unpack_from(head, _STATE_LENGTH_OFFSET)
    return length or None


_STATE_LENGTH = struct.Struct("<Q")
_STATE_LENGTH_OFFSET = 80  # 4 + 2 + 2 + 32 + 16 + 16 + 8 (magic .. tokens)
PAGE_FORMAT = _ObjectFormat(MAGIC, HEADER_BYTES, stored_payload_bytes)
STATE_FORMAT = _ObjectFormat(STATE_MAGIC, STATE_HEADER_BYTES, _state_payload_bytes)


def find_stored_pages(ctx: FaultContext, limit: int = 100_000) -> list[StoredObject]:
    """Every page stored under the nodes' storage path now (file pages, hf3fs slots)."""
    root, namespace, backend = _storage_layout(ctx)
    if backend == "file":
        return _file_objects(root / namespace, "*/*.page", PAGE_FORMAT, limit)
    return _hf3fs_slots(root, rf"{re.escape(namespace)}\.slot(\d+)", PAGE_FORMAT, limit)


def find_stored_states(ctx: FaultContext, limit: int = 100_000) -> list[StoredObject]:
    """Every recurrent-state checkpoint stored now: the `file` backend's `.state` files, the
    hf3fs state pool's slots (`{namespace}.state{slot bytes}.{i}.bin`)."""
    root, namespace, backend = _storage_layout(ctx)
    if backend == "file":
        return _file_objects(root / namespace, "*/*.state", STATE_FORMAT, limit)
    return _hf3fs_slots(root, rf"{re.escape(namespace)}\.state(\d+)", STATE_FORMAT, limit)


def _storage_layout(ctx: FaultContext) -> tuple[Path, str, str]:
    """(storage root, namespace, backend) of the nodes, overrides applied."""
    namespace = str(override(ctx, "storage.namespace", ctx.topology.storage.namespace))
    backend = str(override(ctx, "storage.backend", ctx.topology.storage.backend))
    return storage_root(ctx), namespace, backend


def _file_objects(root: Path, pattern: str, fmt: _ObjectFormat, limit: int
                  ) -> list[StoredObject]:
    found: list[StoredObject] = []
    for path in sorted(root.glob(pattern)):
        try:
            size = path.stat().st_size
        except OSError:
            continue  # evicted meanwhile
        if size > fmt.header_bytes:
            found.append(StoredObject(path, 0, fmt.header_bytes, size - fmt.header_bytes))
        if len(found) >= limit:
            break
    return found


def _hf3fs_slots(root: Path, pool: str, fmt: _ObjectFormat, limit: int) -> list[StoredObject]:
    """Slots whose header starts with the magic, in the data files of every slot size of the
    pools matching `pool` (a regex whose group is the slot size)."""
    # `.filesN`: a pool of another data file count than the default (`StorageConfig.pool_name`)
    pattern = re.compile(rf"^{pool}(?:\.files\d+)?\.\d+\.bin$")
    found: list[StoredObject] = []
    for path in sorted(root.glob("*.bin")):
        match = pattern.match(path.name)
        if match:
            found += _magic_slots(path, int(match.group(1)), fmt, limit - len(found))
    return found


def _magic_slots(path: Path, slot_bytes: int, fmt: _ObjectFormat, limit: int
                 ) -> list[StoredObject]:
    """Only allocated extents are read (SEEK_DATA): the data files are sparse."""
    found: list[StoredObject] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, offset = os.fstat(fd).st_size, 0
        while offset < size and len(found) < limit:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: no data after offset
            end = os.lseek(fd, start, os.SEEK_HOLE)
            slot = start // slot_bytes * slot_bytes
            while slot < end and len(found) < limit:
                head = os.pread(fd, fmt.header_bytes, slot)
                payload = fmt.payload_bytes(head) if head[:4] == fmt.magic else None
                if payload:
                    room = slot_bytes - fmt.header_bytes
                    found.append(StoredObject(path, slot, fmt.header_bytes, min(payload, room)))
                slot += slot_bytes
            offset = max(end, slot)
    finally:
        os.close(fd)
    return found


# --------------------------------------------------------------------------- slow storage


class StorageSlow(Fault):
    """Slow storage: every storage call of every node waits the control file's delay."""

    kind = "storage-slow"
    delay_range_s = (0.05, 0.5)

    def unavailable(self, ctx: FaultContext) -> str | None:
        backend = override(ctx, "storage.backend", ctx.topology.storage.backend)
        return 'storage.backend = "none": no storage to slow down' if backend == "none" else None

    def control_file(self, ctx: FaultContext) -> Path:
        return ctx.work_dir.resolve() / SLOW_CONTROL

    def prepare(self, ctx: FaultContext) -> dict[str, str]:
        control = self.control_file(ctx)
        write_delay(control, 0.0)
        return {"storage.fault_injection": json.dumps(str(control))}

    def inject(self, ctx: FaultContext) -> Injection:
        delay = round(ctx.rng.uniform(*self.delay_range_s), 3)
        write_delay(self.control_file(ctx), delay)
        return Injection(self.kind, "storage", f"{delay:.3f}s per storage call")

    def heal(self, ctx: FaultContext) -> None:
        write_delay(self.control_file(ctx), 0.0)

    def cleanup(self, ctx: FaultContext) -> None:
        self.control_file(ctx).unlink(missing_ok=True)


def write_delay(control: Path, delay_s: float) -> None:
    """Replace the control file atomically (a reader never sees a half-written number)."""
    control.parent.mkdir(parents=True, exist_ok=True)
    tmp = control.with_name(f".{control.name}.tmp")
    tmp.write_text(f"{delay_s}\n")
    os.replace(tmp, control)


STORAGE_FAULTS: dict[str, type[Fault]] = {
    cls.kind: cls for cls in (StorageFull, StorageReadonly, StorageCorrupt, StorageSlow)
}
