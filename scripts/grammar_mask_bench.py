"""Per-token mask cost and output validity of the two grammar libraries pdcache could use for
constrained decoding, with our tokenizers (docs/tools.md records the numbers).

    PYTHONPATH=. python scripts/grammar_mask_bench.py [--export-dir DIR]

For xgrammar and llguidance each (skipped when not installed): compile time of a bounded JSON
schema, the median / p90 time to fill one token's bitmask along a fixed document, and, with
random logits sampled under the mask, how many of 20 outputs ended (the grammar complete
within 300 tokens) and how many are strict JSON (json.loads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdcache.engine.export import export_preset
from pdcache.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "alice", "age": 42, "tags": ["a", "bc"]}, separators=(",", ":"))
VOCAB = 261


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        stop = list(tok.eos_token_ids)
        if isinstance(tok, ByteTokenizer):
            vocab = [bytes([i]) for i in range(256)] + [b""] * 5
            info = xgr.TokenizerInfo(
                vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=stop
            )
        else:
            from transformers import PreTrainedTokenizerFast

            fast = PreTrainedTokenizerFast(tokenizer_file=str(tok.tokenizer_file))
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=VOCAB, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(info)

    def matcher(self) -> Any:
        compiled = self.compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated() or m.is_completed()

    def bitmask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, VOCAB)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        from pdcache.wire.structured import _llguidance, ll_tokenizer

        self.llg = _llguidance()
        self.lltok = ll_tokenizer(self.llg, tok, VOCAB)

    def matcher(self) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        )
        return self.llg.LLMatcher(self.lltok, grammar)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped() or m.is_accepting()

    def bitmask(self) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(1, VOCAB)


def mask_of(bitmask: torch.Tensor) -> torch.Tensor:
    return (
        ((bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1)
        .flatten()[:VOCAB]
        .bool()
    )


def measure(lib: Any, tok: Tokenizer) -> dict[str, Any]:
    t0 = time.perf_counter()
    m = lib.matcher()
    compile_ms = (time.perf_counter() - t0) * 1e3
    bitmask, times = lib.bitmask(), []
    for token in tok.encode(DOC):
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        times.append(time.perf_counter() - t0)
        assert lib.accept(m, token)
    times.sort()
    valid = ended = 0
    for seed in range(20):
        gen, m, out = torch.Generator().manual_seed(seed), lib.matcher(), []
        for _ in range(300):
            lib.fill(m, bitmask)
            logits = torch.randn(VOCAB, generator=gen).masked_fill(~mask_of(bitmask), -1e9)
            token = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
            lib.accept(m, token)
            out.append(token)
            if lib.done(m):
                ended += 1
                break
        try:
            json.loads(tok.decode([t for t in out if t < 256]))
            valid += 1
        except json.JSONDecodeError:
            pass
    return {
        "compile_ms": round(compile_ms, 2),
        "mask_us_median": round(statistics.median(times) * 1e6, 1),
        "mask_us_p90": round(times[int(len(times) * 0.9)] * 1e6, 1),
        "ended_of_20": ended,
        "strict_json_of_20": valid,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--export-dir", help="an exported preset (default: export tiny to a temp dir)"
    )
    args = parser.parse_args()
    export_dir = args.export_dir or str(Path(tempfile.mkdtemp()) / "tiny")
    if not args.export_dir:
        export_preset("tiny", export_dir)
    for tok_name, tok in (
        ("byte tokenizer (261 ids)", ByteTokenizer()),
        ("exported tokenizer.json (261 ids)", HFTokenizer(export_dir)),
    ):
        for cls in (XGrammar, LLGuidance):
            try:
                lib = cls(tok)
            except ImportError as exc:
                print(f"{cls.name:10s} {tok_name}: not installed ({exc})")
                continue
            measure(lib, tok)  # warm-up
            print(f"{cls.name:10s} {tok_name}: {measure(lib, tok)}")


if __name__ == "__main__":
    main()
