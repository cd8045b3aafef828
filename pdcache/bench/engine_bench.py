"""`pdcache bench engine`: prefill and decode tokens/s of our model (ForwardBatch + paged KV
pool) side by side with `transformers` on the same weights, in one run.

Optionally (`--margin-steps N`) also measures greedy robustness: the smallest top-1 vs top-2
logit margin over N greedy decode steps, against the largest logit difference between the
decoded (cached-KV) logits, one full forward and a chunked forward of the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcache.bench.table import emit
from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.loader import allocate_device_kv, load_model
from pdcache.engine.model import CausalLM
from pdcache.engine.presets import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", "--model", dest="model", default="small",
                        help="preset name or checkpoint directory (default: small)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512,
                        help="chunk size of the chunked-prefill row (0: skip)")
    parser.add_argument("--repeats", type=int, default=3, help="prefill timings (median)")
    parser.add_argument("--no-sdpa", action="store_true",
                        help="skip the transformers sdpa row (eager is always measured)")
    parser.add_argument("--margin-steps", type=int, default=0,
                        help="greedy steps for the margin-vs-noise check (0: skip)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Timing:
    prefill_s: float
    decode_s: float
    tokens: list[int]  # greedy tokens: the first from prefill, then one per decode step


class PagedRunner:
    """One sequence through our model with a paged pool whose page ids are shuffled."""

    def __init__(self, model: CausalLM, max_tokens: int, page_size: int, seed: int) -> None:
        self.model = model
        self.page_size = page_size
        num_pages = max_tokens // page_size + 2
        gen = torch.Generator().manual_seed(seed)
        self.pages = torch.randperm(num_pages, generator=gen)
        self.kv = allocate_device_kv(model.config, num_pages, page_size)

    def batch(self, ids: list[int], start: int, all_rows: bool = False) -> ForwardBatch:
        pos = torch.arange(start, start + len(ids))
        mode = ForwardMode.DECODE if len(ids) == 1 and start > 0 else ForwardMode.EXTEND
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids),
            positions=pos,
            out_slots=self.pages[pos // self.page_size] * self.page_size + pos % self.page_size,
            page_table=self.pages[None],
            prefix_lens=[start],
            extend_lens=[len(ids)],
            logits_indices=torch.arange(len(ids)) if all_rows else None,
        )

    def forward(self, ids: list[int], start: int, all_rows: bool = False) -> torch.Tensor:
        return self.model(self.batch(ids, start, all_rows), self.kv)


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_ours(model: CausalLM, ids: list[int], args: argparse.Namespace, chunk: int) -> Timing:
    runner = PagedRunner(model, len(ids) + args.decode_steps, args.page_size, args.seed)

    def prefill() -> torch.Tensor:
        step = chunk or len(ids)
        for start in range(0, len(ids), step):
            logits = runner.forward(ids[start : start + step], start)
        return logits

    prefill_s = _median_time(prefill, args.repeats)
    tokens = [int(prefill().argmax(-1))]
    t0 = time.perf_counter()
    for i in range(args.decode_steps):
        tokens.append(int(runner.forward([tokens[-1]], len(ids) + i).argmax(-1)))
    return Timing(prefill_s, time.perf_counter() - t0, tokens)


def build_hf_model(model: CausalLM, spec: str, attn: str) -> torch.nn.Module:
    """transformers' model with exactly our weights (for a checkpoint: loaded from its dir)."""
    import transformers

    if Path(spec).is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec, dtype=model.config.torch_dtype, attn_implementation=attn
        ).eval()
    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_config, dtype=c.torch_dtype, attn_implementation=attn
    )
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval()


def time_hf(hf: torch.nn.Module, ids: list[int], args: argparse.Namespace) -> Timing:
    input_ids = torch.tensor([ids])
    prefill_s = _median_time(lambda: hf(input_ids, use_cache=True), args.repeats)
    out = hf(input_ids, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    past = out.past_key_values
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return Timing(prefill_s, time.perf_counter() - t0, tokens)


def _row(name: str, t: Timing, prompt_len: int, steps: int, ref: Timing | None) -> dict:
    row = {
        "engine": name,
        "prefill_s": t.prefill_s,
        "prefill_tok_s": prompt_len / t.prefill_s,
        "decode_tok_s": steps / t.decode_s if steps else 0.0,
    }
    if ref is not None:
        row["prefill_x_vs_eager"] = ref.prefill_s / t.prefill_s
        row["decode_x_vs_eager"] = (ref.decode_s / t.decode_s) if steps else 0.0
        row["same_greedy_tokens"] = t.tokens == ref.tokens
    return row


def measure_margin(model: CausalLM, steps: int, page_size: int, seed: int) -> dict:
    """Greedy-decode `steps` tokens (4 prompts); return min top1-top2 margin and the max logit
    difference among decoded, full-forward and chunked-forward logits of the same tokens."""
    prompts = [[(seed * 31 + p * 7 + i * 13) % 256 for i in range(24 + 9 * p)] for p in range(4)]
    min_margin, max_diff, continuations = float("inf"), 0.0, set()
    per_prompt = max(1, steps // len(prompts))
    for ids in prompts:
        decoded, seq = _greedy(model, ids, per_prompt, page_size, seed)
        top2 = decoded.topk(2, dim=-1).values
        min_margin = min(min_margin, (top2[:, 0] - top2[:, 1]).min().item())
        full, chunked = _recompute(model, seq, page_size, seed, rows_from=len(ids) - 1)
        max_diff = max(max_diff, (full - decoded).abs().max().item(),
                       (full - chunked).abs().max().item())
        continuations.add(tuple(seq[len(ids):]))
    return {"greedy_steps": per_prompt * len(prompts), "min_top1_top2_margin": min_margin,
            "max_abs_logit_diff": max_diff, "margin_over_diff": min_margin / max(max_diff, 1e-30),
            "distinct_continuations": f"{len(continuations)}/{len(prompts)}"}


def _greedy(model, ids, steps, page_size, seed) -> tuple[torch.Tensor, list[int]]:
    runner = PagedRunner(model, len(ids) + steps, page_size, seed)
    logits, seq, rows = runner.forward(ids, 0), list(ids), []
    for _ in range(steps):
        rows.append(logits[-1])
        seq.append(int(logits[-1].argmax()))
        logits = runner.forward([seq[-1]], len(seq) - 1)
    return torch.stack(rows), seq


def _recompute(model, seq, page_size, seed, rows_from) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = seq[:-1]
    full = PagedRunner(model, len(inputs), page_size, seed + 1).forward(inputs, 0, all_rows=True)
    runner = PagedRunner(model, len(inputs), page_size, seed + 2)
    chunk = 3 * page_size + 5  # boundaries mid-page
    parts = [runner.forward(inputs[s : s + chunk], s, all_rows=True)
             for s in range(0, len(inputs), chunk)]
    return full[rows_from:], torch.cat(parts)[rows_from:]


def run(args: argparse.Namespace) -> int:
    model, _ = load_model(args.model, dtype=args.dtype, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, min(model.config.vocab_size, 256), (args.prompt_len,), generator=gen)
    ids = ids.tolist()
    rows = []
    with torch.inference_mode():
        _warm_up(model, args)
        eager = time_hf(build_hf_model(model, args.model, "eager"), ids, args)
        ours = time_ours(model, ids, args, chunk=0)
        rows.append(_row("pdcache", ours, args.prompt_len, args.decode_steps, eager))
        if args.chunk and args.chunk < args.prompt_len:
            chunked = time_ours(model, ids, args, chunk=args.chunk)
            rows.append(_row(f"pdcache chunked {args.chunk}", chunked, args.prompt_len,
                             args.decode_steps, eager))
        rows.append(_row("transformers eager", eager, args.prompt_len, args.decode_steps, eager))
        if not args.no_sdpa:
            sdpa = time_hf(build_hf_model(model, args.model, "sdpa"), ids, args)
            rows.append(_row("transformers sdpa", sdpa, args.prompt_len, args.decode_steps, eager))
        extra = _extra(model, args)
    title = f"engine: {args.model} {args.dtype}, prompt {args.prompt_len}, decode {args.decode_steps}"
    emit(title, rows, args.json_path, extra=extra)
    return 0


def _warm_up(model: CausalLM, args: argparse.Namespace) -> None:
    runner = PagedRunner(model, 64, args.page_size, args.seed)
    runner.forward(list(range(32)), 0)
    runner.forward([1], 32)


def _extra(model: CausalLM, args: argparse.Namespace) -> dict:
    extra: dict = {
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "torch_threads": torch.get_num_threads(),
        "preset": args.model if args.model in PRESETS else None,
    }
    if args.margin_steps:
        extra.update(measure_margin(model, args.margin_steps, args.page_size, args.seed))
    return extra
