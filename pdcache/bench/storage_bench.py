"""`pdcache bench storage`: read/write GB/s of each storage backend beside plain references.

Same run, same bytes: N host pages (views into one host pool, as HiCache passes them) are
copied with a plain memcpy, written/read with a plain file (pwrite/preadv of page-sized pieces,
page cache warm, no checksum), then put/get through each backend (header + CRC-32 verification
included). `read_vs_file` is a backend's read GB/s over the plain file read; the target is
>= 0.5. Every read is checked byte-exact against the source pages.
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
    parser.add_argument("--repeat", type=int, default=3, help="timed read passes (best kept)")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS, help="comma-separated")
    parser.add_argument("--io-threads", type=int, default=1, help="hf3fs IO threads")
    parser.add_argument("--dir", default=None, help="directory for files (default: a temp dir)")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _plain_file(path: Path, src: torch.Tensor, dst: torch.Tensor, repeat: int) -> dict[str, Any]:
    """pwrite then preadv of every page at its offset in one file: the reference."""
    page_bytes = src.shape[1]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        src_views = [memoryview(p.numpy()) for p in src]
        dst_views = [memoryview(p.numpy()) for p in dst]

        def write() -> None:
            for i, view in enumerate(src_views):
                os.pwrite(fd, view, i * page_bytes)

        def read() -> None:
            for i, view in enumerate(dst_views):
                os.preadv(fd, [view], i * page_bytes)

        write_s = _best(write, 1)
        read_s = _best(read, repeat)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    assert torch.equal(src, dst), "plain file read is not byte-exact"
    return {"write_s": write_s, "read_s": read_s}


def _batches(keys: list[bytes], pages: torch.Tensor) -> Iterator[tuple[list[bytes], list]]:
    for start in range(0, len(keys), BATCH_PAGES):
        yield keys[start : start + BATCH_PAGES], list(pages[start : start + BATCH_PAGES])


def _run_backend(backend: Any, src: torch.Tensor, dst: torch.Tensor, repeat: int) -> dict:
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
    dst.zero_()
    read_s = _best(read, repeat)
    assert torch.equal(src, dst), "storage read is not byte-exact"
    return {"write_s": write_s, "read_s": read_s}


@contextmanager
def _open_backend(name: str, base: Path, page_bytes: int, pages: int, io_threads: int):
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


def _row(path: str, nbytes: int, times: dict[str, float], file_read_gbps: float) -> dict:
    read_gbps = _gbps(nbytes, times["read_s"])
    write = times.get("write_s")
    return {
        "path": path,
        "write_GBps": _gbps(nbytes, write) if write else "",
        "read_GBps": read_gbps,
        "read_vs_file": read_gbps / file_read_gbps,
    }


def run(args: argparse.Namespace) -> int:
    page_bytes = args.page_kib * 1024
    nbytes = page_bytes * args.pages
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (args.pages, page_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdcache-bench-") as tmp:
        base = Path(tmp)
        memcpy_s = _best(lambda: dst.copy_(src), args.repeat)
        plain = _plain_file(base / "plain.bin", src, dst, args.repeat)
        file_read_gbps = _gbps(nbytes, plain["read_s"])
        rows = [
            _row("memcpy (torch copy_)", nbytes, {"read_s": memcpy_s}, file_read_gbps),
            _row("plain file pwrite/preadv", nbytes, plain, file_read_gbps),
        ]
        for name in [n.strip() for n in args.backends.split(",") if n.strip()]:
            with _open_backend(name, base, page_bytes, args.pages, args.io_threads) as backend:
                times = _run_backend(backend, src, dst, args.repeat)
            rows.append(_row(f"storage {name}", nbytes, times, file_read_gbps))
    extra = {
        "page_bytes": page_bytes,
        "pages": args.pages,
        "io_threads": args.io_threads,
        "target": "storage read_vs_file >= 0.5",
    }
    emit("storage read/write throughput (same bytes, same run)", rows, args.json_path, extra=extra)
    return 0
