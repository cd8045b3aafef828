"""`pdcache bench kernels`: GB/s of every KV copy kernel beside `dst.copy_(src)` (memcpy) of the
same bytes on the same device, and paged attention tokens/s beside
`torch.nn.functional.scaled_dot_product_attention` on already-gathered dense K/V, in one run.

Copies move a random, non-contiguous set of pages. `*_layerwise` rows call the per-layer op
once per layer (the HiCache per-layer load pattern) and count all layers' bytes. On CUDA the
host pool is pinned CPU memory and its memcpy baseline is the same-direction pinned copy.
Kernel and memcpy timings are interleaved and the best of `--repeat` is kept for both, so a
noisy shared machine moves both numbers together; `--clock process` (one thread, CPU time)
measures the work itself when the machine is oversubscribed. On CPU the default backends are
`torch` and, when installed, `numba` (copies only: its attention is torch's).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcache.bench.table import emit
from pdcache.kernels.dispatch import KERNEL_BACKENDS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COPY_OPS = ("device_to_host", "host_to_device", "device_to_host_layerwise",
            "host_to_device_layerwise", "pack_pages", "unpack_pages")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _str_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--page-sizes", type=_int_list, default=[16, 64])
    parser.add_argument("--layers", type=_int_list, default=[8, 32, 64])
    parser.add_argument("--backends", type=_str_list, default=None,
                        help="comma list of reference,torch,numba,triton (default: cpu -> "
                             "torch,numba; cuda -> torch,triton)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--mib", type=int, default=None,
                        help="bytes per copy call (default: cpu 128, cuda 1024)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per sequence for attention (default: cpu 2048, cuda 8192)")
    parser.add_argument("--extend-tokens", type=int, default=256)
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default)")
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="process: CPU time of this process (implies --threads 1; for a "
                             "shared, oversubscribed CPU machine, where wall time mostly "
                             "measures the neighbours)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Setup:
    clock: Callable[[], float]
    device: torch.device
    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    repeat: int
    copy_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], setup: Setup) -> float:
    start = setup.clock()
    fn()
    _sync(setup.device)
    return setup.clock() - start


def paired_times(kernel: Callable[[], object], baseline: Callable[[], object],
                 setup: Setup) -> tuple[float, float]:
    """Best times of `kernel` and `baseline`, measured alternately after one warm-up each
    (first touch, compilation)."""
    timed(kernel, setup)
    timed(baseline, setup)
    best_k = best_b = float("inf")
    for _ in range(setup.repeat):
        best_k = min(best_k, timed(kernel, setup))
        best_b = min(best_b, timed(baseline, setup))
    return best_k, best_b


class CopyBench:
    """Pools of one (page size, layers) shape and the memcpy buffers matching each direction."""

    def __init__(self, setup: Setup, page_size: int, layers: int, gen: torch.Generator) -> None:
        self.setup = setup
        self.layers = layers
        s = setup
        elem = torch.empty((), dtype=s.dtype).element_size()
        page_bytes = layers * 2 * page_size * s.kv_heads * s.head_dim * elem
        self.num_pages = max(1, s.copy_bytes // page_bytes)
        self.bytes = self.num_pages * page_bytes
        pool_pages = 2 * self.num_pages
        page = (page_size, s.kv_heads, s.head_dim)
        self.device_kv = torch.randn((layers, 2, pool_pages, *page), generator=gen).to(
            s.device, s.dtype)
        pin = s.device.type == "cuda"
        self.host_kv = torch.zeros((pool_pages, layers, 2, *page), dtype=s.dtype, pin_memory=pin)
        self.staging = torch.zeros((self.num_pages, layers, 2, *page), dtype=s.dtype,
                                   device=s.device)
        self.dev_ids = torch.randperm(pool_pages, generator=gen)[: self.num_pages].to(s.device)
        self.host_ids = torch.randperm(pool_pages, generator=gen)[: self.num_pages]
        flat = self.bytes // elem
        self.dev_a = torch.zeros(flat, dtype=s.dtype, device=s.device)
        self.dev_b = torch.ones(flat, dtype=s.dtype, device=s.device)
        self.host_a = torch.zeros(flat, dtype=s.dtype, pin_memory=pin)

    def calls(self, k) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
        """op -> (kernel call, memcpy of the same bytes in the same direction)."""
        dev_kv, host_kv, d_ids, h_ids = self.device_kv, self.host_kv, self.dev_ids, self.host_ids
        d2h_copy = lambda: self.host_a.copy_(self.dev_b)  # noqa: E731
        h2d_copy = lambda: self.dev_a.copy_(self.host_a)  # noqa: E731
        d2d_copy = lambda: self.dev_a.copy_(self.dev_b)  # noqa: E731

        def d2h_layers() -> None:
            for layer in range(self.layers):
                k.device_to_host(dev_kv, host_kv, d_ids, h_ids, layer=layer)

        def h2d_layers() -> None:
            for layer in range(self.layers):
                k.host_to_device(host_kv, dev_kv, h_ids, d_ids, layer=layer)

        return {
            "device_to_host": (lambda: k.device_to_host(dev_kv, host_kv, d_ids, h_ids), d2h_copy),
            "host_to_device": (lambda: k.host_to_device(host_kv, dev_kv, h_ids, d_ids), h2d_copy),
            "device_to_host_layerwise": (d2h_layers, d2h_copy),
            "host_to_device_layerwise": (h2d_layers, h2d_copy),
            "pack_pages": (lambda: k.pack_pages(dev_kv, d_ids, self.staging), d2d_copy),
            "unpack_pages": (lambda: k.unpack_pages(self.staging, dev_kv, d_ids), d2d_copy),
        }


def copy_rows(setup: Setup, backends: list[str], page_sizes: list[int], layer_counts: list[int],
              gen: torch.Generator) -> list[dict]:
    rows = []
    for page_size in page_sizes:
        for layers in layer_counts:
            bench = CopyBench(setup, page_size, layers, gen)
            for name in backends:
                kernels = KERNEL_BACKENDS.get(name)()
                for op, (kernel, memcpy) in bench.calls(kernels).items():
                    t_kernel, t_memcpy = paired_times(kernel, memcpy, setup)
                    rows.append(_copy_row(name, op, page_size, layers, bench, t_kernel, t_memcpy))
            del bench
    return rows


def _copy_row(name: str, op: str, page_size: int, layers: int, bench: CopyBench,
              t_kernel: float, t_memcpy: float) -> dict:
    gbps, memcpy_gbps = bench.bytes / t_kernel / 1e9, bench.bytes / t_memcpy / 1e9
    return {"backend": name, "op": op, "page_size": page_size, "layers": layers,
            "pages": bench.num_pages, "MiB": bench.bytes / 2**20, "GB/s": gbps,
            "memcpy GB/s": memcpy_gbps, "vs memcpy": gbps / memcpy_gbps}


class AttentionBench:
    """One layer's pool holding `batch` sequences of `context` tokens on shuffled pages, and the
    same K/V gathered densely as `[B, Hkv, context, D]` for the SDPA baseline."""

    def __init__(self, setup: Setup, page_size: int, batch: int, context: int,
                 gen: torch.Generator) -> None:
        s = setup
        pages_per_seq = -(-context // page_size)
        total = batch * pages_per_seq
        self.device_kv = torch.randn((1, 2, total, page_size, s.kv_heads, s.head_dim),
                                     generator=gen).to(s.device, s.dtype)
        order = torch.randperm(total, generator=gen).to(s.device)
        self.page_table = order.view(batch, pages_per_seq)
        self.context = context
        gathered = self.device_kv[0][:, self.page_table]  # [2, B, pages, S, H, D]
        dense = gathered.reshape(2, batch, -1, s.kv_heads, s.head_dim)[:, :, :context]
        self.k, self.v = (t.transpose(1, 2).contiguous() for t in dense)  # [B, Hkv, ctx, D]


def attention_rows(setup: Setup, backends: list[str], page_size: int, args: argparse.Namespace,
                   gen: torch.Generator) -> list[dict]:
    s = setup
    batch, context, q_heads = args.decode_batch, args.context, args.q_heads
    bench = AttentionBench(s, page_size, batch, context, gen)
    scale = s.head_dim**-0.5
    lens = [context] * batch
    q_dec = torch.randn((batch, q_heads, s.head_dim), generator=gen).to(s.device, s.dtype)
    new = min(args.extend_tokens, context)
    q_ext = torch.randn((batch * new, q_heads, s.head_dim), generator=gen).to(s.device, s.dtype)
    prefix = [context - new] * batch
    mask = _offset_causal_mask(context - new, new, context, s.device)
    q_ext_dense = q_ext.view(batch, new, q_heads, s.head_dim).transpose(1, 2)

    def sdpa_decode() -> object:
        return F.scaled_dot_product_attention(q_dec[:, :, None], bench.k, bench.v, scale=scale,
                                              enable_gqa=True)

    def sdpa_extend() -> object:
        return F.scaled_dot_product_attention(q_ext_dense, bench.k, bench.v, attn_mask=mask,
                                              scale=scale, enable_gqa=True)

    rows = []
    # numba's attention is the torch backend's own functions: one row would repeat the other.
    for name in [b for b in backends if not (b == "numba" and "torch" in backends)]:
        k = KERNEL_BACKENDS.get(name)()
        cases = {
            "decode": (lambda k=k: k.paged_attention_decode(
                q_dec, bench.device_kv, 0, bench.page_table, lens, scale), sdpa_decode, batch),
            "extend": (lambda k=k: k.paged_attention_extend(
                q_ext, bench.device_kv, 0, bench.page_table, prefix, [new] * batch, scale),
                sdpa_extend, batch * new),
        }
        for op, (kernel, baseline, tokens) in cases.items():
            t_kernel, t_sdpa = paired_times(kernel, baseline, s)
            rows.append({"backend": name, "op": op, "page_size": page_size, "batch": batch,
                         "context": context, "tokens/s": tokens / t_kernel,
                         "sdpa tokens/s": tokens / t_sdpa, "vs sdpa": t_sdpa / t_kernel})
    return rows


def _offset_causal_mask(prefix: int, num_q: int, num_kv: int, device: torch.device):
    q_pos = torch.arange(prefix, prefix + num_q, device=device)[:, None]
    return torch.arange(num_kv, device=device)[None, :] <= q_pos


def _numba() -> list[str]:
    return ["numba"] if importlib.util.find_spec("numba") else []


def _resolve(args: argparse.Namespace) -> tuple[Setup, list[str]]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pdcache bench kernels: --device cuda but torch sees no CUDA device")
    cuda = device.type == "cuda"
    backends = args.backends or (["torch", "triton"] if cuda else ["torch", *_numba()])
    if args.clock == "process" and cuda:
        raise SystemExit("pdcache bench kernels: --clock process measures CPU work; use wall "
                         "time on cuda")
    if "triton" in backends and not cuda:
        raise SystemExit("pdcache bench kernels: triton runs on CPU only interpreted "
                         "(far too slow to benchmark); use --device cuda")
    mib = args.mib or (1024 if cuda else 128)
    if args.context is None:
        args.context = 8192 if cuda else 2048
    clock = time.process_time if args.clock == "process" else time.perf_counter
    setup = Setup(clock, device, DTYPES[args.dtype], args.kv_heads, args.head_dim, args.repeat,
                  mib * 2**20)
    return setup, backends


def run(args: argparse.Namespace) -> int:
    setup, backends = _resolve(args)
    if args.clock == "process":
        args.threads = 1  # CPU time of one thread is comparable; of several, it is not
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, setup, backends)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, setup: Setup, backends: list[str]) -> int:
    gen = torch.Generator().manual_seed(args.seed)
    extra = {"device": str(setup.device), "dtype": args.dtype, "kv_heads": args.kv_heads,
             "head_dim": args.head_dim, "torch_threads": torch.get_num_threads(),
             "clock": args.clock}
    rows = copy_rows(setup, backends, args.page_sizes, args.layers, gen)
    emit(f"KV copy kernels vs memcpy ({setup.device}, {args.dtype})", rows, extra=extra)
    attn_rows: list[dict] = []
    if not args.skip_attention:
        for page_size in args.page_sizes:
            attn_rows += attention_rows(setup, backends, page_size, args, gen)
        title = f"paged attention vs SDPA on gathered K/V ({setup.device}, q_heads {args.q_heads})"
        emit(title, attn_rows)
    if args.json_path:
        # One JSON file for both tables; rows tagged by kind (the tables are already printed).
        tagged = [{"kind": "copy", **r} for r in rows] + [{"kind": "attention", **r}
                                                          for r in attn_rows]
        emit("pdcache bench kernels", tagged, json_path=args.json_path, extra=extra,
             out=io.StringIO())
        print(f"wrote {args.json_path}")
    return 0
