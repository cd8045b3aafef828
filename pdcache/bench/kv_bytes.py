"""`pdcache bench kv-bytes`: cache bytes per token and per page, from the KV geometry, for the
presets and for real models' shapes, beside Llama-3.1-70B's (bf16 for the real shapes)."""

from __future__ import annotations

import argparse

from pdcache.bench.table import emit
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.presets import PRESETS

# Real models' caches (published config.json values; bf16, one TP rank holding all heads).
REAL_SHAPES: dict[str, KVGeometry] = {
    "DeepSeek-V3 / R1, Kimi K2": KVGeometry.mla(61, kv_lora_rank=512, rope_dim=64,
                                                dtype="bfloat16"),
    "DeepSeek-V2-Lite": KVGeometry.mla(27, kv_lora_rank=512, rope_dim=64, dtype="bfloat16"),
    "Qwen3-235B-A22B (GQA + MoE)": KVGeometry.mha(94, kv_heads=4, head_dim=128,
                                                  dtype="bfloat16"),
    "Mixtral-8x7B (GQA + MoE)": KVGeometry.mha(32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    "Llama-3.1-8B": KVGeometry.mha(32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    "Llama-3.1-70B": KVGeometry.mha(80, kv_heads=8, head_dim=128, dtype="bfloat16"),
}
BASELINE = "Llama-3.1-70B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-size", type=int, default=64,
                        help="tokens per page for the per-page column (default 64)")


def rows(page_size: int) -> list[dict]:
    base = REAL_SHAPES[BASELINE].token_bytes
    shapes = {f"preset {name}": config.kv_geometry for name, config in PRESETS.items()}
    shapes.update(REAL_SHAPES)
    return [{
        "model": name, "kind": g.kind, "layers": g.num_layers, "slabs": g.num_slabs,
        "row": g.row_elements, "dtype": g.dtype, "bytes_per_token": g.token_bytes,
        "bytes_per_page": g.page_bytes(page_size), "vs_llama70b": round(g.token_bytes / base, 4),
    } for name, g in shapes.items()]


def run(args: argparse.Namespace) -> int:
    emit(f"KV cache bytes per token and per {args.page_size}-token page", rows(args.page_size),
         args.json_path, extra={"page_size": args.page_size, "baseline": BASELINE})
    return 0
