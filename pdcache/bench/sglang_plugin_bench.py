"""`pdcache bench sglang-plugin`: page GB/s through the SGLang plugin beside pdcache natively.

Same run, same backend kind and settings, same page bytes, same batch sizes: `--pages` pages of
KV are written and read back in batches of 128 pages (SGLang's STORAGE_BATCH_SIZE; a pdcache
node's HiCache moves `io_batch_pages` = 64 per backend call, here 128 for both paths)

- natively, as a pdcache node does: `put_from` / `get_into` on views of a pdcache HostKVPool
  (zero-copy: the host page is the stored payload), one backend call per batch, in the
  calling thread ("native: one call per batch", the reference of `overhead`);
- natively with the plugin's parallelism: each batch cut into one chunk per plugin IO thread,
  moved concurrently ("native: batch over N threads", the reference of `overhead_par`: what
  the plugin costs beyond the parallelism it adds);
- through the plugin, exactly as SGLang's HiCache controller calls it: `batch_set_v1` /
  `batch_get_v1` with host token indices into an SGLang-layout host pool (page_first by
  default), once per payload mode: `pdcache` (each page reordered into pdcache's layout
  through staging buffers, readable by pdcache nodes) and `split` (zero-copy: the page's K and
  V runs are the stored payload, scatter/gather IO);
- with `--generic`, through the legacy flat-page API (`batch_get` plus SGLang's own
  `set_from_flat_data_page` scatter, emulated here with a torch copy), for reference.

Storage lives in /dev/shm (tmpfs) unless `--dir` says otherwise: the page cache is the
storage either way, and on a disk, writeback of earlier passes' dirty pages lands on
whichever pass runs next (measured here: up to 50% on file writes), which would time the
disk, not the plugin.

Protocol: one untimed warm-up round, then `--repeat` timed rounds. A round writes fresh keys
on every path, then reads them back in the same order, checks every read byte-exact against
the source pool (untimed), and deletes the round's pages (untimed, so storage and page cache
stay the same size). The order rotates per round; with `--repeat` a multiple of the number
of paths (4 by default) every path runs in every position equally often. GB/s is reported
for the best round and the median round. `overhead` = 1 - plugin GB/s / native GB/s (best
rounds); `overhead_med` = the median over rounds of the same ratio within a round (adjacent
passes, so outside load hits both alike); `overhead_par` = the same as `overhead` against
the native path with the plugin's parallelism; `cpu_overhead` = plugin CPU seconds / native
CPU seconds - 1 (this process, all threads, best rounds): the work the plugin adds, which
outside load disturbs far less than wall time; `cpu_overhead_par` the same against the
parallel native path (running a batch on several threads costs CPU by itself: GIL and lock
handoffs). Target: overhead <= 10%.
Without sglang installed the plugin's implementation class (the same code, minus SGLang's
abstract base) is used.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pdcache.bench.table import emit

SGLANG_BATCH_PAGES = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE
PAYLOAD_LABELS = {
    "pdcache": "plugin v1, payload=pdcache",  # reordered: the page format pdcache nodes read
    "split": "plugin v1, payload=split",  # zero-copy, SGLang's byte order
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NATIVE = "native"
NATIVE_PAR = "native_par"
SHM_DIR = "/dev/shm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="hf3fs,file", help="comma-separated: hf3fs,file,mooncake")
    parser.add_argument("--pages", type=int, default=768,
                        help="pages per pass (768 pages of the default 512 KiB: 384 MiB, "
                             "over 100 ms a pass here)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--layout", default="page_first",
                        choices=["page_first", "layer_first", "page_first_direct", "page_head"],
                        help="SGLang host pool layout")
    parser.add_argument("--payloads", default="pdcache,split",
                        help="plugin payload modes to time (comma-separated)")
    parser.add_argument("--repeat", type=int, default=4,
                        help="timed rounds (best and median); a multiple of the number of paths "
                             "puts every path in every position equally often")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--io-threads", type=int, default=0,
                        help="plugin IO threads (its `io_threads`; 0: its default, min(4, CPUs), "
                             "at least 2); the parallel native path uses as many")
    parser.add_argument("--generic", action="store_true",
                        help="also time the flat-page API (batch_get + SGLang's own page scatter)")
    parser.add_argument("--dir", default=None,
                        help="directory for storage (default: a temp dir in /dev/shm when it "
                             "exists, so disk writeback does not time the plugin; else in TMPDIR)")


def _fill(tensor: torch.Tensor, seed: int) -> None:
    """Random bytes, fast: a random block of a length no page size divides, tiled, so every
    page differs (a page landing at the wrong index fails the byte check)."""
    block = np.random.default_rng(seed).integers(0, 256, (8 << 20) + 4099, dtype=np.uint8)
    flat = tensor.view(-1).view(torch.uint8).numpy()
    flat[:] = np.resize(block, flat.size)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


class BenchHostPool:
    """The part of SGLang's MHATokenToKVPoolHost the plugin touches (buffer shapes per layout)."""

    def __init__(self, layout: str, pages: int, layers: int, heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype) -> None:
        self.layout, self.page_size, self.dtype = layout, page_size, dtype
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layers, heads, head_dim, head_dim
        self.page_num, self.size = pages, pages * page_size
        dims = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_size, heads, head_dim),
            "page_head": (2, pages, heads, page_size, layers, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + self.page_size]
        return self.kv_buffer[:, index // self.page_size]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._page(index).flatten()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.view(page.shape))


def _sglang_config(extra: dict[str, Any]) -> SimpleNamespace:
    """The fields of SGLang's HiCacheStorageConfig the plugin reads (tp 0/1, no PP/CP)."""
    return SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                           attn_cp_size=1, is_mla_model=False, is_storage_writer=True,
                           model_name="bench/model", extra_config=extra)


def _storage_table(name: str, base: Path, capacity: int) -> dict[str, Any]:
    table: dict[str, Any] = {"backend": name, "path": str(base / name),
                             "namespace": f"b{uuid.uuid4().hex[:8]}"}
    if name == "hf3fs":
        table.update(capacity_pages=capacity, io_engine="posix", metadata="inproc",
                     recover_index=False)
    return table


@contextmanager
def _mooncake(name: str, table: dict[str, Any], capacity_bytes: int):
    if name != "mooncake":
        yield table
        return
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

    with LocalMooncakeMaster() as master:
        yield {**table, "mooncake_master": master.address,
               "mooncake_segment_bytes": max(64 << 20, int(capacity_bytes * 1.3)),
               "mooncake_local_buffer_bytes": 16 << 20}


def _storage_dir(requested: str | None) -> str | None:
    if requested is not None:
        return requested
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else None


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds of all threads) of one pass."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _batches(n: int) -> range:
    return range(0, n, SGLANG_BATCH_PAGES)


class Paths:
    """Native and per-payload plugin paths, each with its own storage namespace."""

    def __init__(self, args: argparse.Namespace, table: dict[str, Any], stack: ExitStack):
        from pdcache.integrations.sglang import PdcacheStorageImpl, PluginSettings, extra_config
        from pdcache.offload_manager.host_pool import HostKVPool
        from pdcache.offload_manager.storage import create_backend
        from pdcache.offload_manager.storage.config import StorageConfig

        dtype, n = DTYPES[args.dtype], args.pages
        self.n, self.page_size = n, args.page_size
        geometry = _geometry(args)
        self.native_src = HostKVPool(n, geometry, args.page_size)
        self.native_dst = HostKVPool(n, geometry, args.page_size)
        _fill(self.native_src.host_kv, 1)
        self.page_bytes = self.native_src.page_nbytes
        fingerprint = geometry.fingerprint("bench/model", args.page_size)
        native_cfg = StorageConfig.from_mapping({
            **table, "namespace": table["namespace"] + "n", "page_bytes": self.page_bytes,
            "fingerprint": fingerprint, "num_layers": args.layers, "page_size": args.page_size,
            "dtype": args.dtype})
        self.native = create_backend(native_cfg)
        stack.callback(self.native.close)
        pool_args = (args.layout, n, args.layers, args.kv_heads, args.head_dim, args.page_size, dtype)
        self.sg_src, self.sg_dst = BenchHostPool(*pool_args), BenchHostPool(*pool_args)
        _fill(self.sg_src.kv_buffer, 2)
        self.plugins: dict[str, Any] = {}
        for payload in args.payloads.split(","):
            ns = {**table, "namespace": f"{table['namespace']}{payload}"}
            config = _sglang_config(extra_config(storage=ns, payload=payload,
                                                 io_threads=args.io_threads))
            self.plugins[payload] = plugin = PdcacheStorageImpl(config, {})
            plugin.register_mem_pool_host(self.sg_src)
            stack.callback(plugin.close)
        # the plugin spreads a batch over its IO threads: the same, natively, for reference
        options = extra_config(storage=table, io_threads=args.io_threads)
        self.threads = PluginSettings.from_extra_config(options).threads
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bench-native")
        stack.callback(self.pool.shutdown)
        self.all_indices = torch.arange(n * args.page_size, dtype=torch.int64)
        self.native_pages = (self.native_src.page_bytes(range(n)),
                             self.native_dst.page_bytes(range(n)))
        self.new_keys()

    @property
    def names(self) -> list[str]:
        return [NATIVE, NATIVE_PAR, *self.plugins]

    def new_keys(self) -> None:
        self.native_keys = [os.urandom(32) for _ in range(self.n)]
        self.native_par_keys = [os.urandom(32) for _ in range(self.n)]
        self.sg_keys = [os.urandom(32).hex() for _ in range(self.n)]

    def write(self, name: str) -> None:
        if name in (NATIVE, NATIVE_PAR):
            pages = self.native_pages[0]
            return self._native(self.native.put_from, pages, name, "native put failed")
        return self._plugin(name, self.sg_src, "batch_set_v1")

    def read(self, name: str) -> None:
        if name in (NATIVE, NATIVE_PAR):
            pages = self.native_pages[1]
            return self._native(self.native.get_into, pages, name, "native get missed")
        return self._plugin(name, self.sg_dst, "batch_get_v1")

    def _native(self, call: Callable[..., list[bool]], pages: list[torch.Tensor], name: str,
                err: str) -> None:
        keys = self.native_keys if name == NATIVE else self.native_par_keys
        for s in _batches(self.n):
            end = min(s + SGLANG_BATCH_PAGES, self.n)
            if name == NATIVE:
                assert all(call(keys[s:end], pages[s:end])), err
                continue
            step = -(-(end - s) // self.threads)  # as the plugin cuts a batch
            futures = [self.pool.submit(call, keys[c : c + step], pages[c : c + step])
                       for c in range(s, end, step)]
            assert all(all(f.result()) for f in futures), err

    def _plugin(self, payload: str, pool: BenchHostPool, method: str) -> None:
        plugin = self.plugins[payload]
        plugin.mem_pool_host = pool
        call = getattr(plugin, method)
        for s in _batches(self.n):
            end = min(s + SGLANG_BATCH_PAGES, self.n)
            indices = self.all_indices[s * self.page_size : end * self.page_size]
            assert all(call(self.sg_keys[s:end], indices)), f"plugin {method} ({payload}) failed"

    def generic_read(self) -> None:
        plugin, pool = next(iter(self.plugins.values())), self.sg_dst
        for s in _batches(self.n):
            keys = self.sg_keys[s : s + SGLANG_BATCH_PAGES]
            got = plugin.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
            assert all(t is not None for t in got), "plugin batch_get missed"
            for j, page in enumerate(got):
                pool.set_from_flat_data_page((s + j) * self.page_size, page)

    def clear_destination(self, name: str) -> None:
        native = name in (NATIVE, NATIVE_PAR)
        (self.native_dst.host_kv if native else self.sg_dst.kv_buffer).zero_()

    def check(self, name: str) -> None:
        if name in (NATIVE, NATIVE_PAR):
            assert _same_bytes(self.native_src.host_kv, self.native_dst.host_kv), "native not exact"
        else:
            assert _same_bytes(self.sg_src.kv_buffer, self.sg_dst.kv_buffer), f"{name} not exact"

    def delete(self) -> None:
        self.native.delete(self.native_keys + self.native_par_keys)
        for plugin in self.plugins.values():
            plugin.delete_keys(self.sg_keys)


Samples = dict[str, list[tuple[float, float]]]  # "{path}_{write|read}" -> [(wall, cpu)] per round


def _round(paths: Paths, order: list[str], generic: bool, samples: Samples) -> None:
    paths.new_keys()
    for name in order:
        samples.setdefault(f"{name}_write", []).append(_timed(functools.partial(paths.write, name)))
    for name in order:
        paths.clear_destination(name)
        samples.setdefault(f"{name}_read", []).append(_timed(functools.partial(paths.read, name)))
        paths.check(name)
    if generic:
        paths.clear_destination("generic")
        samples.setdefault("generic_read", []).append(_timed(paths.generic_read))
        paths.check("generic")
    paths.delete()


def _measure(paths: Paths, repeat: int, warmup: int, generic: bool) -> Samples:
    names, samples = paths.names, {}
    for r in range(warmup + repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        _round(paths, order, generic, samples if r >= warmup else {})
    return samples


def _rows(name: str, nbytes: int, samples: Samples, threads: int) -> list[dict[str, Any]]:
    def gbps(key: str, pick: Callable[[list[float]], float]) -> float:
        return nbytes / pick([wall for wall, _ in samples[key]]) / 1e9

    def overheads(op: str, path: str) -> dict[str, float]:
        key, native, par = f"{path}_{op}", f"{NATIVE}_{op}", f"{NATIVE_PAR}_{op}"
        paired = [1 - n / p for (p, _), (n, _) in zip(samples[key], samples[native])]
        cpu = min(c for _, c in samples[key]) / min(c for _, c in samples[native]) - 1
        out = {f"{op}_overhead": 1 - gbps(key, min) / gbps(native, min),
               f"{op}_overhead_med": statistics.median(paired), f"{op}_cpu_overhead": cpu}
        if par in samples and path != NATIVE_PAR:
            out[f"{op}_overhead_par"] = 1 - gbps(key, min) / gbps(par, min)
            out[f"{op}_cpu_overhead_par"] = (min(c for _, c in samples[key])
                                             / min(c for _, c in samples[par]) - 1)
        return out

    def row(path: str, label: str, ops: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": name, "path": label}
        for op in ops:
            out[f"{op}_GBps"] = gbps(f"{path}_{op}", min)
            out[f"{op}_GBps_med"] = gbps(f"{path}_{op}", statistics.median)
            if path != NATIVE:
                out.update(overheads(op, path))
        return out

    rows = [row(NATIVE, "native: one call per batch", ("write", "read")),
            row(NATIVE_PAR, f"native: batch over {threads} threads", ("write", "read"))]
    rows += [row(p, PAYLOAD_LABELS[p], ("write", "read"))
             for p in PAYLOAD_LABELS if f"{p}_read" in samples]
    if "generic_read" in samples:
        rows.append(row("generic", "plugin flat pages (batch_get)", ("read",)))
    return rows


def _geometry(args: argparse.Namespace) -> Any:
    """The native path's KV geometry (a `KVGeometry`: MHA of the bench's shape)."""
    from pdcache.engine.kv_geometry import KVGeometry

    return KVGeometry.mha(args.layers, args.kv_heads, args.head_dim, args.dtype)


COLUMNS = ["backend", "path", "write_GBps", "write_GBps_med", "read_GBps", "read_GBps_med",
           "write_overhead", "write_overhead_med", "write_overhead_par", "read_overhead",
           "read_overhead_med", "read_overhead_par", "write_cpu_overhead", "write_cpu_overhead_par",
           "read_cpu_overhead", "read_cpu_overhead_par"]


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    page_bytes = _geometry(args).page_bytes(args.page_size)
    with tempfile.TemporaryDirectory(dir=_storage_dir(args.dir), prefix="pdcache-sglang-bench-") as tmp:
        for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
            capacity = 2 * args.pages  # each round's pages are deleted before the next
            table = _storage_table(name, Path(tmp), capacity)
            with ExitStack() as stack:
                table = stack.enter_context(_mooncake(name, table, capacity * page_bytes))
                paths = Paths(args, table, stack)
                samples = _measure(paths, args.repeat, args.warmup, args.generic)
                threads = paths.threads
            rows += _rows(name, page_bytes * args.pages, samples, threads)
    extra = {"page_bytes": page_bytes, "pages": args.pages, "batch_pages": SGLANG_BATCH_PAGES,
             "sglang_layout": args.layout, "dtype": args.dtype, "rounds": args.repeat}
    emit("SGLang plugin vs native pdcache storage (same backend, same run, same batches)", rows,
         getattr(args, "json_path", None), columns=COLUMNS, extra=extra)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdcache bench sglang-plugin", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None, help="also write results here")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
