"""`[cache] state_checkpoints`: where a hybrid model's recurrent state is checkpointed.

On the tiny Qwen3-Next checkpoint of `test_qwen3_next_engine.py` (page size 4) a 30-token
prompt (7 full pages + 2) answered with 9 tokens (8 decode forwards: 38 tokens computed)
gets its checkpoints at exactly these fill lengths:
- hit_points (the default): the prompt's last full page (28) and the answer's (36);
- every_page (vLLM's mamba_cache_mode `all`): every page boundary, 4 … 36;
- chunk_ends (SGLang's `no_buffer`), prefill chunks of 10: each chunk's end cut to its last
  full page (8, 16, 24), the prompt's last full page (28) and the answer's end (36).
A second prompt diverging at 22 then hits what each policy left: nothing at hit_points (its
branch point is taken on the way, the third such prompt hits 20), 20 at every_page, 16 at
chunk_ends. Tokens and logprobs equal transformers' under each.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from pdcache.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.radix import RadixTree  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from tests.engine.test_qwen3_next_engine import (  # noqa: E402
    OTHER,
    PAGE,
    PROMPT,
    assert_idle,
    assert_like_hf,
    checkpoint,  # noqa: F401  (fixture)
    generate,
    model,  # noqa: F401  (fixture)
)

STEPS = 9
CHUNK = 10
BRANCHED = PROMPT[:22] + OTHER

# policy → (checkpoint fill lengths after the first request, the branched prompt's hit)
EXPECTED: dict[str, tuple[list[int], int]] = {
    "hit_points": ([28, 36], 0),
    "every_page": (list(range(4, 37, 4)), 20),
    "chunk_ends": ([8, 16, 24, 28, 36], 16),
}


def make_engine(model, policy: str) -> Engine:  # noqa: F811
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96, state_checkpoint_slots=32,
                          state_checkpoints=policy),
        scheduler=SchedulerConfig(chunked_prefill_tokens=CHUNK, max_running_requests=4),
    )
    return Engine(config, model).start(thread=False)


def checkpoint_lengths(tree: RadixTree, fill: list[int]) -> list[int]:
    """The fill lengths at which a node of `fill`'s path ends carrying a checkpoint."""
    found = []
    for end in range(PAGE, len(fill) + 1, PAGE):
        node = tree.node_at(fill[:end])
        if node is not None and node.state_slot is not None:
            found.append(end)
    return found


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_each_policy_checkpoints_exactly_its_points(checkpoint, model, policy: str) -> None:  # noqa: F811
    hf = checkpoint[1]
    points, branched_hit = EXPECTED[policy]
    engine = make_engine(model, policy)
    tokens, logprobs, last = generate(engine, PROMPT, STEPS, "first")
    assert last.cached.device == 0
    assert_like_hf(hf, PROMPT, tokens, logprobs)
    assert engine.tree is not None
    assert checkpoint_lengths(engine.tree, PROMPT + tokens) == points
    assert engine.stats()["state_checkpoints"] == len(points)

    tokens, logprobs, last = generate(engine, BRANCHED, 6, "branched")
    assert last.cached.device == branched_hit
    assert_like_hf(hf, BRANCHED, tokens, logprobs)

    turn = PROMPT + generate(engine, PROMPT, STEPS, "again")[0] + OTHER  # the next turn
    tokens, logprobs, last = generate(engine, turn, 4, "turn")
    assert last.cached.device == 36  # every policy keeps the answer's end
    assert_like_hf(hf, turn, tokens, logprobs)
    assert_idle(engine)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="state_checkpoints"):
        CacheConfig(page_size=PAGE, state_checkpoints="every_token")  # type: ignore[arg-type]
