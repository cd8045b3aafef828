"""`pdcache bench storage`: read/write GB/s of each storage backend beside plain references.

Same run, same bytes: N host pages (views into one host pool, as HiCache passes them) are
copied with a plain memcpy, written/read with a plain file (pwrite/preadv of page-sized pieces,
page cache warm, no checksum), then put/get through each backend (header + checksum
verification included), `--repeat` rounds, one plain-file read per round beside them;
`read_vs_file` is the backend's median read GB/s over the plain file's (target >= 0.5). Every
read is checked byte-exact. Reported: medians over the rounds and their spread.

`--mac both` (the default) opens every backend twice, without and with authenticated pages
(a MAC per page: GMAC, docs/security.md), same threads, same I/O; each batch of pages is
written and read by both back to back, the order alternating batch by batch, so the drift of
a shared machine's load hits both alike. The "+mac" row's `read_mac_ratio` /
`write_mac_ratio` are GB/s with the MAC over without, paired round by round (median and
spread; target >= 0.95). A second table does the same with O_DIRECT reads and writes (the
disk DMAs; verify/seal pipelined with the next page's I/O) and reports CPU per page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from pdcache.bench.table import emit
from pdcache.offload_manager.storage.config import PIPELINE_ON_PAGES
from pdcache.offload_manager.storage.page_format import HEADER_BYTES

DEFAULT_BACKENDS = "hf3fs,hf3fs_service,file,mooncake"
BATCH_PAGES = 64
PIPELINED_PAGES = PIPELINE_ON_PAGES  # the "+mac pipelined" / "-pipelined" rows ([storage] page_pipeline = "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-kib", type=int, default=512, help="payload KiB per page")
    parser.add_argument("--pages", type=int, default=256, help="pages moved per pass")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (medians kept)")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS, help="comma-separated")
    parser.add_argument("--io-threads", type=int, default=1, help="hf3fs IO threads")
    parser.add_argument("--dir", default=None, help="directory for files (default: a temp dir)")
    parser.add_argument(
        "--mac",
        choices=("off", "on", "both"),
        default="both",
        help="authenticated pages (page MAC): off, on, or both side by side",
    )
    parser.add_argument(
        "--pipeline",
        choices=("default", "on", "off", "both", "all"),
        default="default",
        help="+mac rows of hf3fs (one I/O thread) and file: the store's default (' +mac': "
        "each batch pipelined or page by page, whichever measured faster lately), "
        "verifying/sealing page groups beside the I/O (on: ' +mac pipelined', "
        f"pipeline_pages = {PIPELINED_PAGES}), page by page (off: ' +mac page by page', "
        "pipeline_pages = 0), default and on (both), or all three, in the same run; Mooncake "
        "Store always goes page by page",
    )


def _modes(mac: str, pipeline: str) -> dict[str, tuple[bytes | None, int | None]]:
    """Row label suffix -> (page MAC key, pipeline_pages; None: the store's default, "auto").
    `--pipeline` picks the +mac rows: the default (" +mac"), on (" +mac pipelined": hf3fs
    verifies/seals groups beside the I/O, page_pipeline.py), off (" +mac page by page"), both
    (default and on) or all; every +mac row is paired with the row without the MAC."""
    modes: dict[str, tuple[bytes | None, int | None]] = {}
    if mac in ("off", "both"):
        modes[""] = (None, None)
    if mac in ("on", "both"):
        key = os.urandom(32)
        if pipeline in ("default", "both", "all"):
            modes[" +mac"] = (key, None)
        if pipeline in ("off", "all"):
            modes[" +mac page by page"] = (key, 0)
        if pipeline in ("on", "both", "all"):
            modes[" +mac pipelined"] = (key, PIPELINED_PAGES)
    return modes


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _gbps_stats(nbytes: int, seconds: list[float], prefix: str = "") -> dict[str, Any]:
    """Median GB/s over the passes and their spread (slowest-fastest pass)."""
    rates = sorted(_gbps(nbytes, s) for s in seconds)
    return {f"{prefix}GBps": statistics.median(rates),
            f"{prefix}spread": f"{rates[0]:.3g}-{rates[-1]:.3g}"}


def _ratio_stats(off: list[float], on: list[float], prefix: str = "") -> dict[str, Any]:
    """GB/s with the MAC over GB/s without, paired pass by pass (each pair ran back to back,
    so load drift hits both alike): the median and spread of the paired ratios."""
    ratios = sorted(t_off / t_on for t_off, t_on in zip(off, on, strict=True))
    return {f"{prefix}mac_ratio": statistics.median(ratios),
            f"{prefix}mac_ratio_spread": f"{ratios[0]:.2f}-{ratios[-1]:.2f}"}


class PlainFile:
    """The reference: every page pwritten/preadv'd at its offset in one file, no checksum."""

    def __init__(self, path: Path, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.path = path
        self.page_bytes = src.shape[1]
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.src_views = [memoryview(p.numpy()) for p in src]
        self.dst_views = [memoryview(p.numpy()) for p in dst]

    def write(self) -> None:
        for i, view in enumerate(self.src_views):
            os.pwrite(self.fd, view, i * self.page_bytes)

    def read(self) -> None:
        for i, view in enumerate(self.dst_views):
            os.preadv(self.fd, [view], i * self.page_bytes)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class DirectIO:
    """Pages read and written with O_DIRECT: the disk DMAs to/from the buffer, no CPU copy, as
    3FS USRBIO's RDMA lands in (or leaves) shared memory. The verify (read) or seal (write) pass
    is then the only CPU the I/O costs, and it is pipelined with the I/O, as an engine with a
    submission ring would: a reader thread has page i+1's read in flight while page i is
    verified; page i+1 is sealed while page i's write is in flight.

    One file of 4 KiB-aligned slots, one per page and mode, interleaved (page i's are
    adjacent), so every mode hits the same stretch of disk. Modes: the I/O alone, the xxh3
    checksum (no MAC), the MAC as sealed pages are written by default (no checksum,
    page_format.py), and the MAC with the xxh3 checksum kept (`checksum = "xxh3"`). Writes go
    from a staging mmap that holds every slot (the pages already in DMA-able memory, as in a
    registered iovec); a write pass seals the header in place and writes the slot. "io only" reads and writes the MAC slots without
    verifying or sealing. Every mode runs the same code with the same threads (`threads`
    shares, each its own pipeline); only what is computed per page differs."""

    MODES = ("io only", "checksum", "mac", "mac+xxh3")
    SLOTS = ("checksum", "mac", "mac+xxh3")  # the modes with pages of their own

    def __init__(self, path: Path, src: torch.Tensor, mac_key: bytes, threads: int = 1) -> None:
        import mmap

        from pdcache.offload_manager.storage.page_format import PageSpec, encode_object

        self.path, self.pages = path, src.shape[0]
        without = PageSpec("bench", src.shape[1])
        self.specs = {"io only": without, "checksum": without,
                      "mac": PageSpec("bench", src.shape[1], mac_key=mac_key),
                      "mac+xxh3": PageSpec("bench", src.shape[1], checksum="xxh3", mac_key=mac_key)}
        self.slot_bytes = -(-self.specs["mac"].object_bytes // 4096) * 4096
        self.keys = [uuid.uuid4().bytes * 2 for _ in range(self.pages)]
        self.threads = max(1, threads)
        # read buffers: two per thread (one in flight, one being verified)
        self.read_buffers = [mmap.mmap(-1, self.slot_bytes) for _ in range(2 * self.threads)]
        self.staging = mmap.mmap(-1, len(self.SLOTS) * self.pages * self.slot_bytes)
        for i, (key, page) in enumerate(zip(self.keys, src, strict=True)):
            for name in self.SLOTS:
                blob = encode_object(self.specs[name], key, "prefill", page.numpy().data)
                at = self._slot(i, name) * self.slot_bytes
                self.staging[at : at + len(blob)] = blob
        with open(path, "wb") as out:
            out.write(self.staging)
            out.flush()
            os.fsync(out.fileno())
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(self.threads)  # runs the shares (threads > 1)
        self.io = [ThreadPoolExecutor(1) for _ in range(self.threads)]  # one I/O thread each

    @classmethod
    def _slot(cls, page: int, mode: str) -> int:
        """Page `page`'s slot for `mode` ("io only" uses the MAC pages')."""
        return len(cls.SLOTS) * page + cls.SLOTS.index("mac" if mode == "io only" else mode)

    def read(self, mode: str, pages: list[int]) -> None:
        self._shares(self._read_share, mode, pages)

    def write(self, mode: str, pages: list[int]) -> None:
        self._shares(self._write_share, mode, pages)

    def _shares(self, fn: Callable[[str, list[int], Any], None], mode: str,
                pages: list[int]) -> None:
        if self.threads == 1:
            fn(mode, pages, self.io[0])
            return
        shares = [pages[t :: self.threads] for t in range(self.threads)]
        done = [self.pool.submit(fn, mode, share, self.io[t]) for t, share in enumerate(shares)]
        for future in done:
            future.result()

    def _read_share(self, mode: str, mine: list[int], reader: Any) -> None:
        """Read page i+1 (on `reader`, this share's I/O thread) while page i is verified."""
        from pdcache.offload_manager.storage.page_format import Verdict, verify_page

        spec, slot_bytes = self.specs[mode], self.slot_bytes
        thread = self.io.index(reader)
        views = [memoryview(b) for b in self.read_buffers[2 * thread : 2 * thread + 2]]
        if mine:
            first = self._slot(mine[0], mode) * slot_bytes
            pending = reader.submit(os.preadv, self.fd, [views[0]], first)
            for n, i in enumerate(mine):
                nbytes = pending.result()
                if n + 1 < len(mine):
                    after = self._slot(mine[n + 1], mode) * slot_bytes
                    pending = reader.submit(os.preadv, self.fd, [views[(n + 1) % 2]], after)
                if mode == "io only":
                    continue
                view = views[n % 2]
                verdict, _ = verify_page(spec, self.keys[i], view[:HEADER_BYTES],
                                         view[HEADER_BYTES : spec.object_bytes], nbytes)
                assert verdict is Verdict.OK, f"direct read of page {i}: {verdict}"

    def _write_share(self, mode: str, mine: list[int], writer: Any) -> None:
        """Seal page i+1 while page i's write is in flight (on `writer`, this share's I/O
        thread)."""
        from pdcache.offload_manager.storage.page_format import encode_header

        spec, slot_bytes, staging = self.specs[mode], self.slot_bytes, memoryview(self.staging)
        if mine:
            pending = None
            for i in mine:
                at = self._slot(i, mode) * slot_bytes
                slot = staging[at : at + slot_bytes]
                if mode != "io only":
                    payload = slot[HEADER_BYTES : spec.object_bytes]
                    slot[:HEADER_BYTES] = encode_header(spec, self.keys[i], "prefill", payload)
                if pending is not None:
                    assert pending.result() == slot_bytes, "short O_DIRECT write"
                pending = writer.submit(os.pwritev, self.fd, [slot], at)
            if pending is not None:
                assert pending.result() == slot_bytes, "short O_DIRECT write"

    def close(self) -> None:
        for executor in (self.pool, *self.io):
            executor.shutdown()
        os.close(self.fd)
        self.path.unlink(missing_ok=True)
        for buffer in self.read_buffers:
            buffer.close()
        self.staging.close()


DIRECT_CHUNK_PAGES = 8  # modes alternate every this many pages (the disk's speed drifts)


def direct_io_rows(base: Path, src: torch.Tensor, repeat: int, threads: int) -> list[dict]:
    """O_DIRECT reads then writes: I/O alone, + checksum, + MAC, + MAC with xxh3. Each of `repeat` rounds goes
    through the pages in chunks of DIRECT_CHUNK_PAGES, every chunk in every mode back to back
    (the order rotating chunk by chunk), so a disk whose speed drifts second to second slows
    all modes alike; a mode's round time is the sum over its chunks. Reported: median GB/s,
    spread, the paired ratio, and CPU time per page (process CPU, all threads)."""
    direct = DirectIO(base / "direct", src, os.urandom(32), threads)
    modes, pages = DirectIO.MODES, list(range(src.shape[0]))
    chunks = [pages[k : k + DIRECT_CHUNK_PAGES] for k in range(0, len(pages), DIRECT_CHUNK_PAGES)]
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], float] = {}
    try:
        for op, fn in (("read", direct.read), ("write", direct.write)):
            for mode in modes:  # warm-up, untimed
                fn(mode, pages)
            for r in range(repeat):
                spent = dict.fromkeys(modes, 0.0)
                for c, chunk in enumerate(chunks):
                    turn = (r + c) % len(modes)
                    for mode in modes[turn:] + modes[:turn]:
                        cpu_start = time.process_time()
                        spent[mode] += _timed(lambda f=fn, m=mode, ch=chunk: f(m, ch))
                        used = time.process_time() - cpu_start
                        cpu[(op, mode)] = cpu.get((op, mode), 0.0) + used
                for mode in modes:
                    wall.setdefault((op, mode), []).append(spent[mode])
        for mode in DirectIO.SLOTS:  # what the write passes left reads back OK
            direct.read(mode, pages)
    finally:
        direct.close()
    nbytes, rows = src.numel(), []
    for op in ("read", "write"):
        verb = {"read": "verify", "write": "seal"}[op]
        for mode in modes:
            what = {"io only": "only", "checksum": f"+ checksum {verb}", "mac": f"+ MAC {verb}",
                    "mac+xxh3": f"+ MAC {verb}, xxh3 kept"}
            row = {"path": f"O_DIRECT {op} {what[mode]}", **_gbps_stats(nbytes, wall[(op, mode)]),
                   "cpu_us_per_page": cpu[(op, mode)] / (repeat * len(pages)) * 1e6}
            if mode.startswith("mac"):
                row.update(_ratio_stats(wall[(op, "checksum")], wall[(op, mode)]))
            rows.append(row)
    return rows


def _batches(keys: list[bytes], pages: torch.Tensor) -> Iterator[tuple[list[bytes], list]]:
    for start in range(0, len(keys), BATCH_PAGES):
        yield keys[start : start + BATCH_PAGES], list(pages[start : start + BATCH_PAGES])


def _run_backend(
    backend: Any, plain: PlainFile, src: torch.Tensor, dst: torch.Tensor, repeat: int
) -> dict[str, float]:
    """Write once, then alternate plain-file and backend reads `repeat` times (best of each),
    so both are measured under the same machine load."""
    keys = [uuid.uuid4().bytes * 2 for _ in range(src.shape[0])]
    if hasattr(backend, "register_host_memory"):
        backend.register_host_memory(src)
        backend.register_host_memory(dst)

    def write() -> None:
        for batch_keys, batch_pages in _batches(keys, src):
            assert all(backend.put_from(batch_keys, batch_pages)), "put failed"

    def read() -> None:
        for batch_keys, batch_pages in _batches(keys, dst):
            assert all(backend.get_into(batch_keys, batch_pages)), "get missed"

    write_s = _best(write, 1)
    plain_s, read_s = float("inf"), float("inf")
    for _ in range(repeat):
        plain_s = min(plain_s, _best(plain.read, 1))
        dst.zero_()
        read_s = min(read_s, _best(read, 1))
        assert torch.equal(src, dst), "storage read is not byte-exact"
    return {"write_s": write_s, "read_s": read_s, "plain_read_s": plain_s}


def _run_backend_modes(
    backends: dict[str, Any], plain: PlainFile, src: torch.Tensor, dst: torch.Tensor, repeat: int
) -> dict[str, dict[str, list[float]]]:
    """Each backend (one per MAC mode, all open at once) written and read `repeat` rounds.
    A round goes through the pages batch by batch (BATCH_PAGES, one put_from/get_into each,
    as HiCache calls them); every batch is deleted (untimed, so every pass really writes),
    written and read in every mode back to back, the mode order rotating batch by batch, so
    load drift on this shared machine hits every mode alike; a mode's round time is the sum
    over its batches. One plain-file read per round is the reference. One untimed warm-up
    round first (allocates the hf3fs data files' blocks). Every read is byte-exact."""
    keys = [uuid.uuid4().bytes * 2 for _ in range(src.shape[0])]
    for backend in backends.values():
        if hasattr(backend, "register_host_memory"):
            backend.register_host_memory(src)
            backend.register_host_memory(dst)
    batches = list(zip(_batches(keys, src), _batches(keys, dst), strict=True))
    times = {mode: {"write_s": [], "read_s": [], "plain_read_s": [], "write_cpu_s": [],
                    "read_cpu_s": []} for mode in backends}
    modes = list(backends)
    for r in range(repeat + 1):
        plain_s = _timed(plain.read)
        dst.zero_()  # the plain read filled it: a read that wrote nothing must not pass
        spent = {mode: [0.0, 0.0, 0.0, 0.0] for mode in modes}  # write, read: wall, CPU
        for b, ((batch_keys, src_pages), (_, dst_pages)) in enumerate(batches):
            turn = (r + b) % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                backend = backends[mode]
                backend.delete(batch_keys)
                start, cpu_start = time.perf_counter(), time.process_time()
                assert all(backend.put_from(batch_keys, src_pages)), "put failed"
                written, cpu_written = time.perf_counter(), time.process_time()
                assert all(backend.get_into(batch_keys, dst_pages)), "get missed"
                spent[mode][0] += written - start
                spent[mode][1] += time.perf_counter() - written
                spent[mode][2] += cpu_written - cpu_start
                spent[mode][3] += time.process_time() - cpu_written
                span = slice(b * BATCH_PAGES, b * BATCH_PAGES + len(batch_keys))
                assert torch.equal(src[span], dst[span]), f"{mode} read is not byte-exact"
                dst[span].zero_()
        for mode in modes:
            if r > 0:  # round 0 is the warm-up
                for n, name in enumerate(("write_s", "read_s", "write_cpu_s", "read_cpu_s")):
                    times[mode][name].append(spent[mode][n])
                times[mode]["plain_read_s"].append(plain_s)
    return times


def _pipelined_calls(stats: dict[str, Any]) -> str:
    """How a store's default ("auto") ran its calls: "reads P/N, writes P/N" (pipelined of all
    calls with more than one group, warm-up round included); "" when it does not choose."""
    ways = []
    for op in ("read", "write"):
        pipelined = stats.get(f"pipeline_{op}_pipelined_calls")
        if pipelined is None:
            return ""
        total = (pipelined + stats[f"pipeline_{op}_inline_calls"]
                 + stats[f"pipeline_{op}_busy_calls"])
        ways.append(f"{op}s {pipelined}/{total}")
    return ", ".join(ways)


def _mode_row(path: str, nbytes: int, pages: int, times: dict[str, list[float]]) -> dict:
    plain = statistics.median(times["plain_read_s"])
    read = statistics.median(times["read_s"])
    return {"path": path, **_gbps_stats(nbytes, times["write_s"], "write_"),
            **_gbps_stats(nbytes, times["read_s"], "read_"),
            "plain_file_read_GBps": _gbps(nbytes, plain), "read_vs_file": plain / read,
            "write_cpu_us": statistics.median(times["write_cpu_s"]) / pages * 1e6,
            "read_cpu_us": statistics.median(times["read_cpu_s"]) / pages * 1e6}


@contextmanager
def _open_backend(
    name: str,
    base: Path,
    page_bytes: int,
    pages: int,
    io_threads: int,
    mac_key: bytes | None = None,
    pipeline_pages: int | None = None,
):
    from pdcache.offload_manager.storage import create_backend
    from pdcache.offload_manager.storage.config import StorageConfig

    cfg = StorageConfig(
        backend="hf3fs" if name.startswith("hf3fs") else name,
        path=str(base / name),
        page_bytes=page_bytes,
        capacity_pages=pages,
        fingerprint="bench",
        io_threads=io_threads,
        namespace=f"bench{uuid.uuid4().hex[:8]}",
        page_mac_key=mac_key,
    )
    if pipeline_pages is not None:
        cfg = cfg.replace(pipeline_pages=pipeline_pages)
    with ExitStack() as stack:
        if name == "hf3fs_service":
            from pdcache.offload_manager.storage.metadata_service import LocalMetadataService

            service = stack.enter_context(LocalMetadataService(base / "metadata-state"))
            cfg = cfg.replace(metadata=service.address)
        if name == "mooncake":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

            master = stack.enter_context(LocalMooncakeMaster())
            segment = max(16 << 20, int(pages * (page_bytes + 4096) * 1.3))
            cfg = cfg.replace(
                mooncake_master=master.address,
                mooncake_segment_bytes=segment,
                mooncake_local_buffer_bytes=16 << 20,
            )
        backend = create_backend(cfg)
        stack.callback(backend.close)
        yield backend


def _row(path: str, nbytes: int, times: dict[str, float], plain_read_s: float) -> dict:
    write = times.get("write_s")
    return {
        "path": path,
        "write_GBps": _gbps(nbytes, write) if write else "",
        "read_GBps": _gbps(nbytes, times["read_s"]),
        "plain_file_read_GBps": _gbps(nbytes, plain_read_s),
        "read_vs_file": plain_read_s / times["read_s"],
    }


MAC_SIZES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20)  # tiny/small pages .. 8B bf16


def mac_algorithm_rows(page_bytes: int, hashed_bytes: int = 64 << 20) -> list[dict[str, Any]]:
    """GB/s of the page-MAC candidates (single thread, one page per call) beside xxh3, per
    page size: what chose GMAC (docs/security.md)."""
    import hashlib
    import hmac

    import blake3
    import xxhash
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = os.urandom(32)
    gcm, nonce, head = AESGCM(key), os.urandom(12), os.urandom(88)
    rows = []
    for size in sorted({*MAC_SIZES, page_bytes}):
        page = os.urandom(size)
        calls = max(8, hashed_bytes // size)
        fns = {
            "gmac_aes256": lambda p=page: gcm.encrypt(nonce, head, p),
            "blake3_keyed": lambda p=page: blake3.blake3(p, key=key).digest(),
            "blake3_keyed_2threads": lambda p=page: blake3.blake3(
                p, key=key, max_threads=2
            ).digest(),
            "hmac_sha256": lambda p=page: hmac.digest(key, p, hashlib.sha256),
            "xxh3_checksum": lambda p=page: xxhash.xxh3_64_intdigest(p),
        }
        row: dict[str, Any] = {"page_KiB": size >> 10}
        for name, fn in fns.items():
            seconds = _best(lambda f=fn, n=calls: [f() for _ in range(n)], 2)
            row[f"{name}_GBps"] = _gbps(size * calls, seconds)
        rows.append(row)
    return rows


def _cpu_us(fn: Callable[[], Any], calls: int, repeat: int = 5) -> float:
    """Median CPU µs per call of `fn` on this thread (thread CPU time: what the step costs,
    not how long other jobs on the machine kept it waiting)."""
    samples = []
    for _ in range(repeat):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(samples)


def step_cost_rows(base: Path, src: torch.Tensor, calls: int = 64) -> list[dict[str, Any]]:
    """CPU per page of each step of a storage read and write, one thread: the copy (preadv /
    pwritev, the page cache's memcpy), the checksum, the MAC, and the whole seal
    (`encode_header`) and verify (`verify_page`) with and without the MAC, on one page hot in
    cache, and the seals also "cold": over every page of `src` in turn (a host pool larger
    than the CPU caches, as a write-back reads it). From them, the best ratio a copy-bound
    page-cache read (preadv, then verify the now-hot page) or write (seal the cold host page,
    then pwritev it, now hot) can reach with the MAC: (copy + pass without) / (copy + with)."""
    page_bytes = src.shape[1]
    import xxhash
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from pdcache.offload_manager.storage.page_format import (
        PageSpec,
        encode_header,
        verify_page,
    )

    key, mac_key = uuid.uuid4().bytes * 2, os.urandom(32)
    specs = {"checksum": PageSpec("bench", page_bytes),
             "MAC": PageSpec("bench", page_bytes, mac_key=mac_key),
             "MAC, xxh3 kept": PageSpec("bench", page_bytes, checksum="xxh3", mac_key=mac_key)}
    payload = memoryview(bytearray(os.urandom(page_bytes)))
    heads = {name: encode_header(spec, key, "prefill", payload) for name, spec in specs.items()}
    path = base / "steps.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, payload, 0)
        into = memoryview(bytearray(page_bytes))
        gcm, nonce = AESGCM(mac_key), os.urandom(12)
        cost = {
            "memcpy": _cpu_us(lambda: into.__setitem__(slice(None), payload), calls),
            "preadv (page cache)": _cpu_us(lambda: os.preadv(fd, [into], 0), calls),
            "pwritev (page cache)": _cpu_us(lambda: os.pwritev(fd, [payload], 0), calls),
            "xxh3": _cpu_us(lambda: xxhash.xxh3_64_intdigest(payload), calls),
            "GMAC": _cpu_us(lambda: gcm.encrypt(nonce, b"h" * 88, payload), calls),
        }
        cold = [memoryview(page.numpy()) for page in src]
        for name, spec in specs.items():
            cost[f"seal, {name}"] = _cpu_us(
                lambda s=spec: encode_header(s, key, "prefill", payload), calls)
            cost[f"seal cold, {name}"] = _cpu_us(
                lambda s=spec: [encode_header(s, key, "prefill", page) for page in cold], 1, 3
            ) / len(cold)
            cost[f"verify, {name}"] = _cpu_us(
                lambda s=spec, h=heads[name]: verify_page(s, key, h, payload, s.object_bytes),
                calls)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    rows: list[dict[str, Any]] = [
        {"step": name, "cpu_us_per_page": us, "GBps": page_bytes / us / 1e3}
        for name, us in cost.items()
    ]
    read, write = cost["preadv (page cache)"], cost["pwritev (page cache)"]
    for name in ("MAC", "MAC, xxh3 kept"):
        rows.append({"step": f"bound: page-cache read, {name} / checksum", "ratio":
                     (read + cost["verify, checksum"]) / (read + cost[f"verify, {name}"])})
        rows.append({"step": f"bound: page-cache write, {name} / checksum", "ratio":
                     (write + cost["seal cold, checksum"]) / (write + cost[f"seal cold, {name}"])})
    return rows


def run(args: argparse.Namespace) -> int:
    page_bytes = args.page_kib * 1024
    nbytes = page_bytes * args.pages
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdcache-bench-") as tmp:
        base = Path(tmp)
        plain = PlainFile(base / "plain.bin", src, dst)
        try:
            plain_write_s = _best(plain.write, 1)
            plain_read_s = _best(plain.read, args.repeat)
            assert torch.equal(src, dst), "plain file read is not byte-exact"
            memcpy_s = _best(lambda: dst.copy_(src), args.repeat)
            rows.append(_row("memcpy (torch copy_)", nbytes, {"read_s": memcpy_s}, plain_read_s))
            plain_times = {"write_s": plain_write_s, "read_s": plain_read_s}
            rows.append(_row("plain file pwrite/preadv", nbytes, plain_times, plain_read_s))
            modes = _modes(args.mac, args.pipeline)
            for name in [n.strip() for n in args.backends.split(",") if n.strip()]:
                with ExitStack() as stack:
                    backends = {
                        label: stack.enter_context(_open_backend(
                            name, base, page_bytes, args.pages, args.io_threads, mac_key,
                            pipeline_pages))
                        for label, (mac_key, pipeline_pages) in modes.items()
                    }
                    times = _run_backend_modes(backends, plain, src, dst, args.repeat)
                    chosen = {label: _pipelined_calls(b.stats()) for label, b in backends.items()}
                by_label = {}
                for label in backends:
                    row = _mode_row(f"storage {name}{label}", nbytes, args.pages, times[label])
                    if chosen[label]:
                        row["pipelined_calls"] = chosen[label]
                    rows.append(row)
                    by_label[label] = row
                for label in [m for m in backends if m and "" in times]:  # vs the MAC-less row
                    off, on = times[""], times[label]
                    by_label[label].update(_ratio_stats(off["read_s"], on["read_s"], "read_"))
                    by_label[label].update(_ratio_stats(off["write_s"], on["write_s"], "write_"))
        finally:
            plain.close()
    extra = {
        "page_bytes": page_bytes,
        "pages": args.pages,
        "io_threads": args.io_threads,
        "rounds": args.repeat,
        "load_avg_1m": f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
        "note": "medians of the rounds (spread: slowest-fastest); modes interleaved batch by "
        "batch; read_vs_file = plain file read time / this read time; *_mac_ratio = GB/s with "
        "the MAC / without, paired per round; *_cpu_us = process CPU per page; pipelined_calls = "
        "calls the default ran pipelined, of all (warm-up round included)",
        "mac": args.mac,
        "pipeline": args.pipeline,
    }
    columns = ["path", "write_GBps", "write_spread", "read_GBps", "read_spread",
               "plain_file_read_GBps", "read_vs_file", "write_cpu_us", "read_cpu_us"]
    if any("read_mac_ratio" in row for row in rows):
        columns += ["read_mac_ratio", "read_mac_ratio_spread", "write_mac_ratio",
                    "write_mac_ratio_spread"]
    if any("pipelined_calls" in row for row in rows):
        columns.append("pipelined_calls")
    emit("storage read/write throughput (same bytes, same run)", rows, args.json_path, columns,
         extra=extra)
    if args.mac == "both" and page_bytes % 4096 == 0:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdcache-bench-") as tmp:
            direct_rows = direct_io_rows(Path(tmp), src, args.repeat, args.io_threads)
        direct_json = args.json_path and args.json_path.replace(".json", "") + ".direct.json"
        emit(
            "O_DIRECT I/O (the disk DMAs, no CPU copy): verify/seal pipelined with the next "
            "page's I/O, without/with the MAC",
            direct_rows,
            direct_json,
            ["path", "GBps", "spread", "cpu_us_per_page", "mac_ratio", "mac_ratio_spread"],
            extra={"threads": args.io_threads,
                   "rounds": args.repeat, "load_avg_1m": round(os.getloadavg()[0], 2)},
        )
    if args.mac == "both":
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdcache-bench-") as tmp:
            step_rows = step_cost_rows(Path(tmp), src)
        steps_json = args.json_path and args.json_path.replace(".json", "") + ".steps.json"
        emit(
            "CPU per page of each step (one thread, thread CPU time, page cache warm)",
            step_rows,
            steps_json,
            ["step", "cpu_us_per_page", "GBps", "ratio"],
            extra={"note": "bound = (copy + verify or cold seal without the MAC) / (copy + with "
                   "it); cold = over all pages in turn (not in cache)",
                   "load_avg_1m": round(os.getloadavg()[0], 2)},
        )
    if args.mac != "off":
        mac_json = args.json_path and args.json_path.replace(".json", "") + ".mac.json"
        emit(
            "page MAC candidates, GB/s per page (one thread)",
            mac_algorithm_rows(page_bytes),
            mac_json,
            extra={"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        )
    return 0


def backend_op_seconds(name: str, page_bytes: int, batch_pages: list[int], repeat: int = 3,
                       io_threads: int = 2, base: Path | None = None) -> list[dict[str, float]]:
    """Per batch size in `batch_pages`: the median seconds of one `put_from`, one `get_into`
    and one `exists_prefix` of that many pages on backend `name` (one client), in a
    temporary directory under `base`: what `pdcache sim calibrate` fits the storage
    bandwidth and per-operation latency from. Every read is checked byte for byte."""
    most = max(batch_pages)
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (most, page_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="pdcache-bench-") as tmp, \
            _open_backend(name, Path(tmp), page_bytes, most * (repeat + 2), io_threads) as backend:
        for n in batch_pages:
            times: dict[str, list[float]] = {"write_s": [], "read_s": [], "exists_s": []}
            src_pages, dst_pages = list(src[:n]), list(dst[:n])
            for _ in range(repeat):
                keys = [uuid.uuid4().bytes * 2 for _ in range(n)]
                times["write_s"].append(_timed(lambda k=keys, s=src_pages: backend.put_from(k, s)))
                times["read_s"].append(_timed(lambda k=keys, d=dst_pages: backend.get_into(k, d)))
                times["exists_s"].append(_timed(lambda k=keys: backend.exists_prefix(k)))
                assert torch.equal(src[:n], dst[:n]), "storage read is not byte-exact"
                backend.delete(keys)
            rows.append({"pages": float(n), "bytes": float(n * page_bytes),
                         **{k: statistics.median(v) for k, v in times.items()}})
    return rows
