"""`pdcache bench sglang-plugin`: page GB/s through the SGLang plugin beside pdcache natively.

Same run, same backend kind, same bytes: N pages of KV are written and read back

- natively, as a pdcache node does: `put_from` / `get_into` on views of a pdcache HostKVPool
  (zero-copy: the host page is the stored payload);
- through the plugin, as SGLang's HiCache controller does: `batch_set_v1` / `batch_get_v1`
  with host token indices into an SGLang-layout host pool (page_first by default), in
  SGLang's batches of 128 pages, once per payload mode: `pdcache` (each page reordered into
  pdcache's layout through a staging buffer, readable by pdcache nodes) and `split`
  (zero-copy: K and V runs stored in place as two objects);
- with `--generic`, through the legacy flat-page API (`batch_get` plus SGLang's own
  `set_from_flat_data_page` scatter, emulated here with a torch copy), for reference.

Native and plugin passes alternate and the best of `--repeat` is kept, so load from other
processes hits both alike. `overhead` = 1 - plugin GB/s / native GB/s (target <= 10%);
`cpu_overhead` = plugin CPU seconds / native CPU seconds - 1 (this process, all threads): the
work the plugin adds, which outside load on a shared machine disturbs far less than wall time.
Every read is checked byte-exact. Without sglang installed the plugin's implementation
class (the same code, minus SGLang's abstract base) is used.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pdcache.bench.table import emit
from pdcache.engine.page_keys import kv_fingerprint

SGLANG_BATCH_PAGES = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE
PAYLOAD_LABELS = {
    "pdcache": "plugin v1, payload=pdcache (reordered, pdcache-readable)",
    "split": "plugin v1, payload=split (zero-copy K/V objects)",
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="hf3fs,file", help="comma-separated: hf3fs,file,mooncake")
    parser.add_argument("--pages", type=int, default=256, help="pages per pass")
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
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per path (best kept)")
    parser.add_argument("--generic", action="store_true",
                        help="also time the flat-page API (batch_get + SGLang's own page scatter)")
    parser.add_argument("--dir", default=None, help="directory for storage (default: a temp dir)")


@torch.no_grad()
def _fill(tensor: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32))


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


def _best(fn: Callable[[int], None], passes: list[float], index: int) -> None:
    """Time one pass: wall seconds, and process CPU seconds under the key's "@cpu" twin."""
    start, cpu = time.perf_counter(), time.process_time()
    fn(index)
    passes.append((time.perf_counter() - start, time.process_time() - cpu))  # type: ignore[arg-type]


class Paths:
    """The three ways of moving the same pages, each with its own storage and keys per pass."""

    def __init__(self, args: argparse.Namespace, table: dict[str, Any], stack: ExitStack):
        from pdcache.integrations.sglang import PdcacheStorageImpl, extra_config
        from pdcache.offload_manager.host_pool import HostKVPool
        from pdcache.offload_manager.storage import create_backend
        from pdcache.offload_manager.storage.config import StorageConfig

        dtype, n = DTYPES[args.dtype], args.pages
        shape = (args.layers, args.page_size, args.kv_heads, args.head_dim)
        self.n, self.page_size = n, args.page_size
        self.native_src = HostKVPool(n, *shape[:1], args.page_size, *shape[2:], dtype)
        self.native_dst = HostKVPool(n, *shape[:1], args.page_size, *shape[2:], dtype)
        _fill(self.native_src.host_kv, 1)
        self.page_bytes = self.native_src.page_nbytes
        fingerprint = kv_fingerprint("bench/model", args.dtype, args.page_size, args.layers,
                                     args.kv_heads, args.head_dim)
        native_cfg = StorageConfig.from_mapping({
            **table, "namespace": table["namespace"] + "n", "page_bytes": self.page_bytes,
            "fingerprint": fingerprint, "num_layers": args.layers, "page_size": args.page_size,
            "dtype": args.dtype})
        self.native = create_backend(native_cfg)
        stack.callback(self.native.close)
        pool_args = (args.layout, n, args.layers, args.kv_heads, args.head_dim, args.page_size, dtype)
        self.sg_src, self.sg_dst = BenchHostPool(*pool_args), BenchHostPool(*pool_args)
        _fill(self.sg_src.kv_buffer, 2)
        self.plugins = {}
        for payload in args.payloads.split(","):
            ns = {**table, "namespace": f"{table['namespace']}{payload}"}
            config = _sglang_config(extra_config(storage=ns, payload=payload))
            self.plugins[payload] = plugin = PdcacheStorageImpl(config, {})
            plugin.register_mem_pool_host(self.sg_src)
            stack.callback(plugin.close)
        self.plugin = next(iter(self.plugins.values()))
        self.native_keys = [[uuid.uuid4().bytes * 2 for _ in range(n)] for _ in range(args.repeat)]
        self.sg_keys = [[os.urandom(32).hex() for _ in range(n)] for _ in range(args.repeat)]
        self.all_indices = torch.arange(n * args.page_size, dtype=torch.int64)

    def _batches(self) -> range:
        return range(0, self.n, SGLANG_BATCH_PAGES)

    def native_write(self, rep: int) -> None:
        pages = self.native_src.page_bytes(range(self.n))
        for s in self._batches():
            ok = self.native.put_from(self.native_keys[rep][s : s + SGLANG_BATCH_PAGES],
                                      pages[s : s + SGLANG_BATCH_PAGES])
            assert all(ok), "native put failed"

    def native_read(self, rep: int) -> None:
        pages = self.native_dst.page_bytes(range(self.n))
        for s in self._batches():
            ok = self.native.get_into(self.native_keys[rep][s : s + SGLANG_BATCH_PAGES],
                                      pages[s : s + SGLANG_BATCH_PAGES])
            assert all(ok), "native get missed"

    def _indices(self, s: int) -> torch.Tensor:
        end = min(s + SGLANG_BATCH_PAGES, self.n)
        return self.all_indices[s * self.page_size : end * self.page_size]

    def plugin_write(self, payload: str, rep: int) -> None:
        plugin = self.plugins[payload]
        plugin.mem_pool_host = self.sg_src
        for s in self._batches():
            ok = plugin.batch_set_v1(self.sg_keys[rep][s : s + SGLANG_BATCH_PAGES], self._indices(s))
            assert all(ok), "plugin batch_set_v1 failed"

    def plugin_read(self, payload: str, rep: int) -> None:
        plugin = self.plugins[payload]
        plugin.mem_pool_host = self.sg_dst
        for s in self._batches():
            ok = plugin.batch_get_v1(self.sg_keys[rep][s : s + SGLANG_BATCH_PAGES], self._indices(s))
            assert all(ok), "plugin batch_get_v1 missed"

    def generic_read(self, rep: int) -> None:
        pool = self.sg_dst
        for s in self._batches():
            keys = self.sg_keys[rep][s : s + SGLANG_BATCH_PAGES]
            targets = [pool.get_dummy_flat_data_page() for _ in keys]
            # the first payload's plugin: its pages were written by plugin_write
            got = self.plugin.batch_get(keys, targets)
            assert all(t is not None for t in got), "plugin batch_get missed"
            for j, page in enumerate(got):
                pool.set_from_flat_data_page((s + j) * self.page_size, page)

    def check(self) -> None:
        assert torch.equal(self.native_src.host_kv, self.native_dst.host_kv), "native not exact"
        assert torch.equal(self.sg_src.kv_buffer, self.sg_dst.kv_buffer), "plugin not exact"


def _measure(paths: Paths, repeat: int, generic: bool) -> dict[str, float]:
    times: dict[str, list[float]] = {}
    for rep in range(repeat):  # alternate the paths so outside load hits them alike
        _best(paths.native_write, times.setdefault("native_write", []), rep)
        for payload in paths.plugins:
            write = functools.partial(paths.plugin_write, payload)
            _best(write, times.setdefault(f"{payload}_write", []), rep)
    for rep in range(repeat):
        paths.native_dst.host_kv.zero_()
        _best(paths.native_read, times.setdefault("native_read", []), rep)
        for payload in paths.plugins:
            paths.sg_dst.kv_buffer.zero_()
            read = functools.partial(paths.plugin_read, payload)
            _best(read, times.setdefault(f"{payload}_read", []), rep)
            paths.check()
    if generic:
        for rep in range(repeat):
            paths.sg_dst.kv_buffer.zero_()
            _best(paths.generic_read, times.setdefault("generic_read", []), rep)
            paths.check()
    best = {k: min(wall for wall, _ in v) for k, v in times.items()}  # type: ignore[misc]
    best.update({f"{k}@cpu": min(cpu for _, cpu in v) for k, v in times.items()})  # type: ignore[misc]
    return best


def _rows(name: str, nbytes: int, best: dict[str, float]) -> list[dict[str, Any]]:
    def gbps(key: str) -> float:
        return nbytes / best[key] / 1e9

    def overhead(key: str, native: str) -> float:
        return 1 - gbps(key) / gbps(native)

    def cpu_overhead(key: str, native: str) -> float:
        return best[f"{key}@cpu"] / best[f"{native}@cpu"] - 1

    rows = [{"backend": name, "path": "pdcache native (put_from/get_into)",
             "write_GBps": gbps("native_write"), "read_GBps": gbps("native_read")}]
    for payload in PAYLOAD_LABELS:
        write, read = f"{payload}_write", f"{payload}_read"
        if read in best:
            rows.append({"backend": name, "path": PAYLOAD_LABELS[payload],
                         "write_GBps": gbps(write), "read_GBps": gbps(read),
                         "write_overhead": overhead(write, "native_write"),
                         "read_overhead": overhead(read, "native_read"),
                         "write_cpu_overhead": cpu_overhead(write, "native_write"),
                         "read_cpu_overhead": cpu_overhead(read, "native_read")})
    if "generic_read" in best:
        rows.append({"backend": name, "path": "plugin flat pages (batch_get + SGLang scatter)",
                     "read_GBps": gbps("generic_read"),
                     "read_overhead": overhead("generic_read", "native_read"),
                     "read_cpu_overhead": cpu_overhead("generic_read", "native_read")})
    return rows


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    itemsize = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    page_bytes = 2 * args.layers * args.page_size * args.kv_heads * args.head_dim * itemsize
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdcache-sglang-bench-") as tmp:
        for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
            capacity = 2 * args.pages * args.repeat
            table = _storage_table(name, Path(tmp), capacity)
            with ExitStack() as stack:
                table = stack.enter_context(_mooncake(name, table, capacity * page_bytes))
                paths = Paths(args, table, stack)
                best = _measure(paths, args.repeat, args.generic)
            rows += _rows(name, page_bytes * args.pages, best)
    extra = {"page_bytes": page_bytes, "pages": args.pages, "sglang_layout": args.layout,
             "dtype": args.dtype, "target": "plugin overhead <= 0.10"}
    columns = ["backend", "path", "write_GBps", "read_GBps", "write_overhead", "read_overhead",
               "write_cpu_overhead", "read_cpu_overhead"]
    emit("SGLang plugin vs native pdcache storage (same backend, same run)", rows,
         getattr(args, "json_path", None), columns=columns, extra=extra)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdcache bench sglang-plugin", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", dest="json_path", default=None, help="also write results here")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
