"""`pdcache bench engine`: prefill and decode tokens/s of our model (ForwardBatch + paged KV
pool) side by side with `transformers` on the same weights, in one run.

Optionally (`--margin-steps N`) also measures greedy robustness: the smallest top-1 vs top-2
logit margin over N greedy decode steps, against the largest logit difference between the
decoded (cached-KV) logits, one full forward and a chunked forward of the same tokens.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
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
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="process: CPU time with one torch thread (for an oversubscribed "
                             "machine, where wall time mostly measures the neighbours)")


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


class OursContender:
    """Our model: prefill (whole prompt or in chunks through the paged path), then decode."""

    def __init__(self, model: CausalLM, ids: list[int], args: argparse.Namespace, chunk: int):
        self.runner = PagedRunner(model, len(ids) + args.decode_steps, args.page_size, args.seed)
        self.ids, self.chunk = ids, chunk or len(ids)

    def prefill(self) -> int:
        for start in range(0, len(self.ids), self.chunk):
            logits = self.runner.forward(self.ids[start : start + self.chunk], start)
        return int(logits[-1].argmax())

    def decode(self, token: int, steps: int) -> list[int]:
        tokens = [token]
        for i in range(steps):
            tokens.append(int(self.runner.forward([tokens[-1]], len(self.ids) + i).argmax(-1)))
        return tokens


class HFContender:
    """transformers' forward with its own KV cache (DynamicCache)."""

    def __init__(self, hf: torch.nn.Module, ids: list[int]) -> None:
        self.hf, self.input_ids = hf, torch.tensor([ids])
        self.cache_arg = _cache_argument(hf)
        self.out = None

    def prefill(self) -> int:
        self.out = self.hf(self.input_ids, use_cache=True)
        return int(self.out.logits[0, -1].argmax())

    def decode(self, token: int, steps: int) -> list[int]:
        tokens, out = [token], self.out
        for _ in range(steps):
            cache = {self.cache_arg: getattr(out, self.cache_arg)}
            out = self.hf(torch.tensor([[tokens[-1]]]), use_cache=True, **cache)
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens


def time_contenders(contenders: dict, args: argparse.Namespace) -> dict[str, Timing]:
    """Prefill timings interleaved round-robin (a noisy neighbour hits all alike), median of
    `repeats`; then one timed decode of `decode_steps` per contender after a fresh prefill."""
    clock = time.process_time if args.clock == "process" else time.perf_counter
    prefill_times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, c in contenders.items():
            t0 = clock()
            c.prefill()
            prefill_times[name].append(clock() - t0)
    timings = {}
    for name, c in contenders.items():
        first = c.prefill()
        t0 = clock()
        tokens = c.decode(first, args.decode_steps)
        timings[name] = Timing(statistics.median(prefill_times[name]), clock() - t0, tokens)
    return timings


def build_hf_model(model: CausalLM, spec: str, attn: str) -> torch.nn.Module:
    """transformers' model with exactly our weights (for a checkpoint: loaded from its dir)."""
    import transformers

    if Path(spec).is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec, dtype=model.config.torch_dtype, attn_implementation=attn
        ).eval()
    c = model.config
    if c.architecture != "LlamaForCausalLM":  # DeepSeek-V3, gpt-oss: `pdcache export-model`'s config
        from pdcache.engine.export import hf_config as exported_config

        fields = exported_config(c)
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(fields.pop("model_type"), **fields),
            dtype=c.torch_dtype, attn_implementation=attn)
        hf.load_state_dict(model.state_dict(), strict=True)
        return hf.eval()
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


def _cache_argument(hf: torch.nn.Module) -> str:
    # transformers >= 5.2x renamed `past_key_values` to `cache` (input and output alike).
    params = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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
    threads_before = torch.get_num_threads()
    if args.clock == "process":
        torch.set_num_threads(1)  # CPU time of one thread is comparable; of several, it is not
    try:
        rows, extra = _measure(args)
    finally:
        torch.set_num_threads(threads_before)
    title = (f"engine: {args.model} {args.dtype}, prompt {args.prompt_len}, "
             f"decode {args.decode_steps}, clock {args.clock}")
    emit(title, rows, args.json_path, extra=extra)
    return 0


def _measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    model, _ = load_model(args.model, dtype=args.dtype, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = min(model.config.vocab_size, 256)
    ids = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
    with torch.inference_mode():
        _warm_up(model, args)
        contenders = {"pdcache": OursContender(model, ids, args, chunk=0)}
        if args.chunk and args.chunk < args.prompt_len:
            name = f"pdcache chunked {args.chunk}"
            contenders[name] = OursContender(model, ids, args, args.chunk)
        for attn in ("eager",) if args.no_sdpa else ("eager", "sdpa"):
            try:
                hf = build_hf_model(model, args.model, attn)
            except ValueError as exc:  # gpt-oss has no sdpa path (its sinks): no such row
                print(f"transformers {attn}: skipped ({exc})", file=sys.stderr)
                continue
            contenders[f"transformers {attn}"] = HFContender(hf, ids)
        timings = time_contenders(contenders, args)
        eager = timings["transformers eager"]
        rows = [_row(n, t, args.prompt_len, args.decode_steps, eager) for n, t in timings.items()]
        extra = _extra(model, args)
    return rows, extra


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


def batch_step_seconds(model: CausalLM, new_tokens: int, prefix_len: int, batch: int,
                       page_size: int, repeats: int = 3) -> float:
    """Median wall seconds of one forward step of `batch` sequences, each computing
    `new_tokens` tokens after `prefix_len` tokens already in the pool (a decode step when
    `new_tokens` is 1 and there is a prefix), on the model's device: the engine's step shape
    for `pdcache sim calibrate`. One untimed step first."""
    device = next(model.parameters()).device
    per_seq = -(-(prefix_len + new_tokens) // page_size)
    kv = allocate_device_kv(model.config, batch * per_seq, page_size, device)
    table = torch.arange(batch * per_seq).view(batch, per_seq)
    pos = torch.arange(prefix_len, prefix_len + new_tokens)
    slots = torch.cat([table[b, pos // page_size] * page_size + pos % page_size
                       for b in range(batch)])
    decode = new_tokens == 1 and prefix_len > 0
    ids = torch.randint(1, model.config.vocab_size, (batch * new_tokens,),
                        generator=torch.Generator().manual_seed(batch))
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=ids.to(device), positions=pos.repeat(batch).to(device),
        out_slots=slots.to(device), page_table=table.to(device),
        prefix_lens=[prefix_len] * batch, extend_lens=[new_tokens] * batch)

    def step() -> None:
        model(fb, kv)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
