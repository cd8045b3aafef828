"""Token-exact expansion of block ids and the theoretical reusable fraction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdcache.bench.tokens import BlockExpander, ReuseTracker, hit_rate, theoretical_reuse
from pdcache.bench.traces import Blocks, parse_mooncake, parse_sessions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MOONCAKE_REAL = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake-fast25/synthetic_trace.jsonl"


def test_equal_ids_give_equal_blocks_whatever_the_instance() -> None:
    a = BlockExpander(block_size=8, vocab_high=300, vocab_low=3, seed=1)
    b = BlockExpander(block_size=8, vocab_high=300, vocab_low=3, seed=1)
    block = a.block(42)
    assert block.shape == (8,) and block.min() >= 3 and block.max() < 300
    np.testing.assert_array_equal(block, b.block(42))
    assert not np.array_equal(a.block(42), a.block(43))
    other_seed = BlockExpander(block_size=8, vocab_high=300, vocab_low=3, seed=2)
    assert not np.array_equal(a.block(42), other_seed.block(42))


def test_partial_last_block_is_trimmed() -> None:
    exp = BlockExpander(block_size=8, vocab_high=1000)
    tokens = exp.expand(Blocks((1, 2, 3), 20))
    expected = np.concatenate([exp.block(1), exp.block(2), exp.block(3)[:4]])
    np.testing.assert_array_equal(tokens, expected)
    # the same ids with another length share exactly the common prefix
    longer = exp.expand(Blocks((1, 2, 3), 24))
    np.testing.assert_array_equal(longer[:20], tokens)
    with pytest.raises(ValueError, match="need more than 3 blocks"):
        exp.expand(Blocks((1, 2, 3), 25))


def test_mooncake_sharing_is_reproduced_in_tokens() -> None:
    trace = parse_mooncake(FIXTURES / "mooncake_small.jsonl")
    exp = BlockExpander(block_size=512, vocab_high=256)
    r0, r1, r2, r3 = (exp.turn_tokens(t) for t in trace.turns())
    assert [len(r) for r in (r0, r1, r2, r3)] == [1100, 1024, 300, 1600]
    np.testing.assert_array_equal(r0[:1024], r1)  # ids [0, 1] shared
    np.testing.assert_array_equal(r3[:1100], r0)  # ids [0, 1, 2] shared, r0's block 2 partial
    assert not np.array_equal(r2, r0[:300])  # id 3 is not id 0


@pytest.mark.parametrize("page_size, per_request", [
    # worked by hand in the comment below
    (4, [0, 16, 16, 0, 16]),
    (5, [0, 15, 15, 0, 15]),
])
def test_theoretical_reuse_matches_hand_computation(page_size: int, per_request: list[int]) -> None:
    # reuse_small.jsonl, blocks of 8 tokens (B1..B6):
    #   r0 = B1 B2 B3[:4] (20)   r1 = B1 B2 B4[:6] (22)   r2 = r0 (20)
    #   r3 = B5 B6[:4] (12)      r4 = B1 B2 B3[:3] (19)
    # page 4: r1 shares pages 0-3 (B1 B2); r2 shares all 5 pages but keeps its last token:
    #   min(5, (20-1)//4 = 4) = 4 pages; r4 has 4 full pages, all seen, cap (19-1)//4 = 4.
    # page 5: r1 shares pages [0:5) [5:10) [10:15) (page [15:20) mixes B2 and B4);
    #   r2: 4 seen, cap (20-1)//5 = 3; r4: 3 full pages seen, cap (19-1)//5 = 3.
    trace = parse_mooncake(FIXTURES / "reuse_small.jsonl", block_size=8)
    reuse = theoretical_reuse(trace, page_size, BlockExpander(block_size=8, vocab_high=50000))
    assert [r.reusable_tokens for r in reuse] == per_request
    assert [r.prompt_tokens for r in reuse] == [20, 22, 20, 12, 19]
    assert hit_rate(reuse) == pytest.approx(sum(per_request) / 93)


def test_theoretical_reuse_counts_previous_answers_in_sessions() -> None:
    # sessions_small.jsonl with blocks of 8, page 4. Offline order: round 0 by start time
    # (b/0 at 50 ms, a/0 at 100 ms), then round 1 (b/1, a/1).
    # The KV that exists after a turn covers its prompt + answer except the answer's last token.
    #   b/0: 9 tokens -> 0.   a/0: 10 tokens -> 0.
    #   b/1: prompt = b/0 (9) + answer (3) + new (3) = 15; KV of 9 + 3 - 1 = 11 tokens =
    #        2 full pages, both seen; cap (15-1)//4 = 3 -> 8.
    #   a/1: prompt = 10 + 6 + 5 = 21; KV of 10 + 6 - 1 = 15 tokens = 3 pages, seen (only
    #        2 without the answer); cap (21-1)//4 = 5 -> 12.
    trace = parse_sessions(FIXTURES / "sessions_small.jsonl", block_size=8)
    reuse = theoretical_reuse(trace, 4, BlockExpander(block_size=8, vocab_high=50000))
    got = {r.request_id: (r.prompt_tokens, r.reusable_tokens) for r in reuse}
    assert got == {"b/0": (9, 0), "a/0": (10, 0), "b/1": (15, 8), "a/1": (21, 12)}
    assert [r.request_id for r in reuse] == ["b/0", "a/0", "b/1", "a/1"]


def test_tracker_extends_keys_like_a_fresh_chain() -> None:
    tracker = ReuseTracker(page_size=4)
    seq = np.arange(23)
    prompt_keys = tracker.keys(seq[:10])
    assert tracker.extend_keys(prompt_keys, seq) == tracker.keys(seq)
    assert len(tracker.keys(seq)) == 5


def _id_level_reuse(rows: list[tuple[tuple[int, ...], int]], block: int) -> list[int]:
    """Independent computation on hash ids: leading full blocks whose id-prefix was a full-block
    prefix of an earlier request, capped so the last prompt token is computed."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ids, length in rows:
        full = length // block
        k = 0
        while k < full and ids[: k + 1] in seen:
            k += 1
        out.append(block * min(k, (length - 1) // block))
        seen.update(ids[: j + 1] for j in range(full))
    return out


@pytest.mark.skipif(not MOONCAKE_REAL.is_file(), reason="Mooncake FAST'25 trace not present")
def test_real_mooncake_reuse_matches_hash_id_computation(tmp_path: Path) -> None:
    head = tmp_path / "head.jsonl"
    head.write_text("\n".join(MOONCAKE_REAL.read_text().splitlines()[:300]) + "\n")
    trace = parse_mooncake(head)
    rows = [(t.inputs[0].ids, t.input_len) for t in trace.turns()]
    by_block = theoretical_reuse(trace, 512, BlockExpander(block_size=512, vocab_high=32000))
    expected = _id_level_reuse(rows, 512)
    assert [r.reusable_tokens for r in by_block] == expected
    assert sum(expected) > 0, "the first 300 rows share prefixes"
    # finer pages can only reuse more (partial blocks of earlier requests count too)
    by_page16 = theoretical_reuse(trace, 16, BlockExpander(block_size=512, vocab_high=32000))
    assert all(f >= c for f, c in zip((r.reusable_tokens for r in by_page16), expected))
    assert hit_rate(by_page16) >= hit_rate(by_block) > 0.0
