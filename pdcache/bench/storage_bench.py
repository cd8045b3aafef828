"""`pdcache bench storage`: read/write GB/s of each storage backend beside plain references.

Same run, same bytes: N host pages (views into one host pool, as HiCache passes them) are
copied with a plain memcpy, written/read with a plain file (pwrite/preadv of page-sized pieces,
page cache warm, no checksum), then put/get through each backend (header + checksum
verification included). Plain-file and backend reads alternate, best of `--repeat` each, so a
busy machine slows both alike; `read_vs_file` is the backend's read GB/s over the plain file
read measured beside it (target >= 0.5). Every read is checked byte-exact.

`--mac both` (the default) also runs every backend with authenticated pages (a MAC
per page: GMAC, docs/security.md) in the same run: the "+mac" row's `mac_read_ratio` /
`mac_write_ratio` are its GB/s over the same backend's without the MAC (target >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from pdcache.bench.table import emit

DEFAULT_BACKENDS = "hf3fs,hf3fs_service,file,mooncake"
BATCH_PAGES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-kib", type=int, default=512, help="payload KiB per page")
    parser.add_argument("--pages", type=int, default=256, help="pages moved per pass")
    parser.add_argument("--repeat", type=int, default=5, help="timed read passes (best kept)")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS, help="comma-separated")
    parser.add_argument("--io-threads", type=int, default=1, help="hf3fs IO threads")
    parser.add_argument("--dir", default=None, help="directory for files (default: a temp dir)")
    parser.add_argument(
        "--mac",
        choices=("off", "on", "both"),
        default="both",
        help="authenticated pages (page MAC): off, on, or both side by side",
    )


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


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


class DirectReads:
    """Pages read with O_DIRECT (the disk DMAs into the buffer, no CPU copy, as 3FS USRBIO's
    RDMA reads land in shared memory) and then verified by `verify_page`: the case where the
    verify pass is the only CPU a read costs. Each page sits in a 4 KiB-aligned slot of one
    file, read into an anonymous (page-aligned) mmap; the same slots are read and checked
    without and with the MAC alternately, so both see the same disk and load."""

    def __init__(self, path: Path, src: torch.Tensor, mac_key: bytes, threads: int = 1) -> None:
        import mmap

        from pdcache.offload_manager.storage.page_format import PageSpec, encode_object

        self.path, self.pages = path, src.shape[0]
        self.specs = {
            "checksum": PageSpec("bench", src.shape[1]),
            "mac": PageSpec("bench", src.shape[1], mac_key=mac_key),
        }
        object_bytes = self.specs["mac"].object_bytes
        self.slot_bytes = -(-object_bytes // 4096) * 4096
        self.keys = [uuid.uuid4().bytes * 2 for _ in range(self.pages)]
        self.threads = max(1, threads)
        self.buffers = [mmap.mmap(-1, self.slot_bytes) for _ in range(self.threads)]
        self.fds = {}
        for name, spec in self.specs.items():
            with open(f"{path}.{name}", "wb") as out:
                for key, page in zip(self.keys, src, strict=True):
                    blob = encode_object(spec, key, "prefill", memoryview(page.numpy()))
                    out.write(blob + bytes(self.slot_bytes - len(blob)))
                out.flush()
                os.fsync(out.fileno())
            self.fds[name] = os.open(f"{path}.{name}", os.O_RDONLY | os.O_DIRECT)

    def read(self, name: str, verify: bool = True) -> None:
        """Every page once, by `threads` threads (as a backend's I/O threads: while one
        verifies a page, another's read is in flight)."""
        if self.threads == 1:
            self._read_share(name, verify, 0)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.threads) as pool:
            for done in [pool.submit(self._read_share, name, verify, t) for t in range(self.threads)]:
                done.result()

    def _read_share(self, name: str, verify: bool, thread: int) -> None:
        from pdcache.offload_manager.storage.page_format import HEADER_BYTES, Verdict, verify_page

        spec, fd, view = self.specs[name], self.fds[name], memoryview(self.buffers[thread])
        head, payload = view[:HEADER_BYTES], view[HEADER_BYTES : spec.object_bytes]
        for i in range(thread, self.pages, self.threads):
            nbytes = os.preadv(fd, [view], i * self.slot_bytes)
            if verify:
                verdict, _ = verify_page(spec, self.keys[i], head, payload, nbytes)
                assert verdict is Verdict.OK, f"direct read of page {i}: {verdict}"

    def close(self) -> None:
        for name, fd in self.fds.items():
            os.close(fd)
            Path(f"{self.path}.{name}").unlink(missing_ok=True)
        for buffer in self.buffers:
            buffer.close()


def direct_read_rows(
    base: Path, src: torch.Tensor, repeat: int, threads: int
) -> list[dict[str, Any]]:
    """O_DIRECT read alone, + checksum verify, + MAC verify (best of `repeat`, alternating)."""
    direct = DirectReads(base / "direct", src, os.urandom(32), threads)
    nbytes = src.numel()
    best = {"read": float("inf"), "checksum": float("inf"), "mac": float("inf")}
    try:
        for _ in range(repeat):
            best["read"] = min(best["read"], _best(lambda: direct.read("mac", verify=False), 1))
            for name in ("checksum", "mac"):
                best[name] = min(best[name], _best(lambda n=name: direct.read(n), 1))
    finally:
        direct.close()
    rows = [
        {"path": "O_DIRECT read only", "read_GBps": _gbps(nbytes, best["read"])},
        {"path": "O_DIRECT read + checksum verify", "read_GBps": _gbps(nbytes, best["checksum"])},
        {"path": "O_DIRECT read + MAC verify", "read_GBps": _gbps(nbytes, best["mac"]),
         "mac_read_ratio": best["checksum"] / best["mac"]},
    ]
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


@contextmanager
def _open_backend(
    name: str,
    base: Path,
    page_bytes: int,
    pages: int,
    io_threads: int,
    mac_key: bytes | None = None,
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


def run(args: argparse.Namespace) -> int:
    page_bytes = args.page_kib * 1024
    nbytes = page_bytes * args.pages
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
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
            macs = {"off": [None], "on": [os.urandom(32)], "both": [None, os.urandom(32)]}
            for name in [n.strip() for n in args.backends.split(",") if n.strip()]:
                without: dict[str, float] = {}
                for mac_key in macs[args.mac]:
                    with _open_backend(
                        name, base, page_bytes, args.pages, args.io_threads, mac_key
                    ) as backend:
                        times = _run_backend(backend, plain, src, dst, args.repeat)
                    label = f"storage {name}" + (" +mac" if mac_key else "")
                    rows.append(_row(label, nbytes, times, times["plain_read_s"]))
                    if mac_key is None:
                        without = times
                    elif without:
                        rows[-1]["mac_read_ratio"] = without["read_s"] / times["read_s"]
                        rows[-1]["mac_write_ratio"] = without["write_s"] / times["write_s"]
        finally:
            plain.close()
    extra = {
        "page_bytes": page_bytes,
        "pages": args.pages,
        "io_threads": args.io_threads,
        "note": "read_vs_file = plain file read time / this read time, measured alternately",
        "target": "storage read_vs_file >= 0.5; +mac rows mac_*_ratio >= 0.95",
        "mac": args.mac,
    }
    columns = list(rows[0])
    if any("mac_read_ratio" in row for row in rows):
        columns += ["mac_read_ratio", "mac_write_ratio"]
    emit(
        "storage read/write throughput (same bytes, same run)",
        rows,
        args.json_path,
        columns,
        extra=extra,
    )
    if args.mac == "both" and page_bytes % 4096 == 0:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdcache-bench-") as tmp:
            direct_rows = direct_read_rows(Path(tmp), src, args.repeat, args.io_threads)
        direct_json = args.json_path and args.json_path.replace(".json", "") + ".direct.json"
        emit(
            "reads that cost no CPU copy (O_DIRECT: the disk DMAs), verified without/with the MAC",
            direct_rows,
            direct_json,
            ["path", "read_GBps", "mac_read_ratio"],
            extra={"target": "mac_read_ratio >= 0.95", "threads": args.io_threads},
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
