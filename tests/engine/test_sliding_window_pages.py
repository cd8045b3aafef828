"""Window pages: gpt-oss's sliding layers keep only their window on device
(`pdcache.engine.window_pages`, docs/design.md §4.14).

A tiny gpt-oss checkpoint built by transformers (fp32, fixed seed; window 8, pages of 4
tokens): greedy tokens and logprobs equal transformers' while the sliding layers' pages in
use stay bounded; a prefix hit is served only where the sliding pages of the window before it
are still there (the deepest such point otherwise, `limited_by="window"`), and serving one
without them gives other logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.engine.api import (  # noqa: E402
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
)
from pdcache.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.kv_pool import PageAllocator  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.radix import RadixTree, SlidingWindowRule  # noqa: E402
from pdcache.engine.roles import Unified  # noqa: E402
from pdcache.engine.scheduler import NO_WINDOW_ROLE, NO_WINDOW_TIERS, Scheduler  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from tests.engine.test_gpt_oss import PAGE, WINDOW, prompt_of, save_gpt_oss  # noqa: E402

PROMPT = 60
STEPS = 30
LOGPROB_ATOL = 2e-4
# the sliding pages a decoding request keeps: the window before its prompt's last token (the
# point below a page-aligned prompt end too) and the one before its own position (and the
# page being filled), each at most ceil((W - 1) / S) + 2 pages
WINDOW_BOUND = 2 * ((WINDOW - 1 + PAGE - 1) // PAGE + 2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss-window")
    return path, save_gpt_oss(path, seed=11)


@pytest.fixture(scope="module")
def model(checkpoint) -> torch.nn.Module:
    return load_model(str(checkpoint[0]))[0]


def make_engine(model: torch.nn.Module) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96),
        scheduler=SchedulerConfig(chunked_prefill_tokens=2048),
        kernels="torch",
    )
    return Engine(config, model).start(thread=False)


def run(engine: Engine, rid: str, prompt: list[int],
        watch: list[int] | None = None) -> tuple[list[int], list[float], RequestOutput]:
    """Greedy `STEPS` tokens; `watch` gets the sliding pages in use after every step."""
    outputs: list[RequestOutput] = []
    engine.submit(GenerateRequest(
        rid=rid, input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
        logprobs=LogprobRequest()), outputs.append)
    assert engine.window is not None
    while engine.step():
        if watch is not None:
            watch.append(engine.window.allocator.num_used)
    assert outputs[-1].finished and outputs[-1].error is None, outputs[-1]
    tokens = [t for out in outputs for t in out.new_token_ids]
    logprobs = [float(lp.logprob) for out in outputs for lp in out.new_logprobs]
    return tokens, logprobs, outputs[-1]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], logprobs


def assert_like_hf(hf: torch.nn.Module, prompt: list[int], tokens: list[int],
                   logprobs: list[float]) -> None:
    expected, expected_logprobs = hf_greedy(hf, prompt, len(tokens))
    assert tokens == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs),
                               atol=LOGPROB_ATOL, rtol=0)


def assert_idle(engine: Engine) -> None:
    """Nothing runs: the sliding pages in use are the tree's; a flush frees both spaces."""
    numbers = engine.check_accounting()
    assert numbers["window_requests"] == 0, numbers
    assert numbers["window_free"] + numbers["window_tree"] == numbers["window_capacity"]
    engine.flush_cache()
    numbers = engine.check_accounting()
    assert numbers["free"] == numbers["capacity"], numbers
    assert numbers["window_free"] == numbers["window_capacity"], numbers


def test_cold_prompt_and_decode_equal_transformers_with_bounded_window_pages(
        checkpoint, model) -> None:
    _, hf = checkpoint
    engine = make_engine(model)
    assert engine.window is not None and engine.window.window == WINDOW
    # two page spaces: the full layers' pool has rows for layers 1 and 3 only
    assert engine.pool.device_kv.shape[0] == 2 and engine.window.pool.device_kv.shape[0] == 2
    prompt = prompt_of(21, PROMPT)
    watch: list[int] = []
    tokens, logprobs, last = run(engine, "cold", prompt, watch)
    assert last.cached.total == 0
    assert_like_hf(hf, prompt, tokens, logprobs)
    # the prefill step holds the whole prompt's sliding pages until its forward ends; every
    # later step (decode, 30 tokens past the window) at most the two windows
    assert max(watch[:-1]) <= WINDOW_BOUND, watch
    assert engine.pool.allocator.num_used >= (PROMPT + STEPS - 1) // PAGE  # full: everything
    stats = engine.stats()
    assert stats["window_pages_freed_total"] >= (PROMPT + STEPS) // PAGE - WINDOW_BOUND
    assert stats["window_pages_cached"] <= WINDOW_BOUND
    assert_idle(engine)


def test_hits_need_the_window_pages_before_them(checkpoint, model) -> None:
    """After a 60-token prompt and its 30-token answer, the tree holds the sliding pages of
    the windows before 60 (the prompt's end) and 88 (the answer's last full page) only: a
    prompt diverging at 80 hits 60 (limited by the window), one extending the answer hits 88."""
    _, hf = checkpoint
    engine = make_engine(model)
    first = prompt_of(22, PROMPT)
    answer = run(engine, "first", first)[0]
    tree = engine.tree
    assert tree is not None

    diverging = first + answer[:20] + prompt_of(23, 10)
    match = tree.match_prefix(diverging[:-1])
    assert (match.matched_len, match.cached_len, match.limited_by) == (80, 60, "window")
    assert None not in match.window_page_ids[-2:]  # the window before 60
    tokens, logprobs, last = run(engine, "diverging", diverging)
    assert last.cached.device == 60
    assert_like_hf(hf, diverging, tokens, logprobs)
    stats = engine.stats()
    assert stats["prefix_hits_limited_by_window_total"] == 1
    assert stats["tokens_limited_by_window_total"] == 20

    extending = first + answer + prompt_of(24, 6)
    match = tree.match_prefix(extending[:-1])
    assert (match.cached_len, match.limited_by) == (88, None)
    tokens, logprobs, last = run(engine, "extending", extending)
    assert last.cached.device == 88
    assert_like_hf(hf, extending, tokens, logprobs)
    again = run(engine, "again", first)  # a hit leaves the last token: 56 of 60
    assert again[2].cached.device == 56 and again[0] == answer
    assert engine.stats()["prefix_hits_limited_by_window_total"] == 1
    assert_idle(engine)


def test_a_turn_parting_right_after_the_prompt_hits_the_next_page_boundary(
        checkpoint, model) -> None:
    """A 58-token prompt keeps the page it ends in: a next turn that renders the answer
    otherwise from token 60 on hits 60 (its window, tokens 53-59, straddles the prompt end)."""
    _, hf = checkpoint
    engine = make_engine(model)
    first = prompt_of(25, 58)
    answer = run(engine, "first", first)[0]
    parting = first + answer[:2] + prompt_of(26, 9)
    tokens, logprobs, last = run(engine, "parting", parting)
    assert last.cached.device == 60
    assert_like_hf(hf, parting, tokens, logprobs)
    assert engine.stats()["prefix_hits_limited_by_window_total"] == 0
    assert_idle(engine)


def test_a_hit_without_its_window_pages_gives_other_logits(checkpoint, model) -> None:
    """Protection off (the tree without its `SlidingWindowRule`): the hit at 80 reads freed
    sliding pages (tombstones) and the logits are wrong."""
    _, hf = checkpoint
    engine = make_engine(model)
    first = prompt_of(22, PROMPT)
    answer = run(engine, "first", first)[0]
    tree = engine.tree
    assert tree is not None and any(isinstance(r, SlidingWindowRule) for r in tree.restore_rules)
    tree.restore_rules = ()
    diverging = first + answer[:20] + prompt_of(23, 10)
    tokens, logprobs, last = run(engine, "unprotected", diverging)
    assert last.cached.device == 80
    expected, expected_logprobs = hf_greedy(hf, diverging, STEPS)
    gap = (torch.tensor(logprobs) - torch.tensor(expected_logprobs)).abs().max()
    assert tokens != expected or gap > 1e-2, gap
    assert_idle(engine)


def test_tiers_and_prefilled_starts_keep_every_page_or_are_refused(model) -> None:
    """A node with its own `make_scheduler` keeps every page of every layer unless it asks
    for window pages; a scheduler given window pages refuses lower tiers that do not carry
    window tails (HiCache's do: tests/offload_manager/test_window_tiers.py), and tiers that
    do on a decode role."""
    config = EngineConfig(model=model.config,
                          cache=CacheConfig(page_size=PAGE, num_device_pages=32))
    plain = Engine(config, model, make_scheduler=Scheduler)
    assert plain.window is None and plain.pool.device_kv.shape[0] == 4
    engine = make_engine(model)
    scheduler = engine.scheduler
    with pytest.raises(ValueError, match=NO_WINDOW_TIERS):
        Scheduler(scheduler.config, config.cache, engine.pool, engine.tree, 512, (),
                  tiers=object(), window=engine.window)  # type: ignore[arg-type]

    class WindowTiers:
        carries_window = True

    class DecodeLike(Unified):
        pass

    with pytest.raises(ValueError, match=NO_WINDOW_ROLE):
        Scheduler(scheduler.config, config.cache, engine.pool, engine.tree, 512, (),
                  tiers=WindowTiers(), role=DecodeLike(),  # type: ignore[arg-type]
                  window=engine.window)


def test_retraction_and_a_follower_keep_both_spaces_exact(checkpoint, model) -> None:
    """Three requests decode together in a pool too small for them (the newest are
    retracted: their pages, tombstones included, go to the tree and they re-prefill from
    the deepest restorable point), one a follower of another's prompt (`prefill_leader`:
    the leader's prompt pages enter the tree while it decodes). Accounting holds after every
    step; every answer is transformers'."""
    _, hf = checkpoint
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=30),
        scheduler=SchedulerConfig(chunked_prefill_tokens=64),
        kernels="torch",
    )
    engine = Engine(config, model).start(thread=False)
    shared = prompt_of(31, 33)
    prompts = {"a": shared, "b": shared, "c": prompt_of(32, 27)}
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.submit(GenerateRequest(
            rid=rid, input_ids=prompt,
            sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
            logprobs=LogprobRequest(), prefill_leader="a" if rid == "b" else None),
            outputs[rid].append)
    while engine.step():
        engine.check_accounting()
    assert engine.stats()["requests_retracted_total"] >= 1
    for rid, prompt in prompts.items():
        outs = outputs[rid]
        assert outs[-1].finished and outs[-1].error is None, outs[-1]
        tokens = [t for out in outs for t in out.new_token_ids]
        logprobs = [float(lp.logprob) for out in outs for lp in out.new_logprobs]
        assert_like_hf(hf, prompt, tokens, logprobs)
    assert outputs["b"][-1].cached.device == 32
    assert_idle(engine)


# ---- the tree alone ------------------------------------------------------------------------

def make_tree() -> tuple[RadixTree, PageAllocator, PageAllocator]:
    full, window = PageAllocator(32), PageAllocator(32)
    tree = RadixTree(PAGE, full, restore_rules=[SlidingWindowRule(WINDOW, PAGE)],
                     window_allocator=window)
    return tree, full, window


def test_the_rule_reads_the_window_across_nodes_and_tombstones_fill_and_free() -> None:
    tree, full, window = make_tree()
    tokens = list(range(40))  # 10 pages
    pages = full.alloc(10)
    sliding = window.alloc(10)
    held: list[int | None] = [None] * 5 + sliding[5:]  # pages 0-4 freed by the window
    window.free(sliding[:5])
    tree.insert(tokens, pages, window_page_ids=held)
    tree.check()
    assert tree.window_pages == 5
    # a hit at 24 needs tokens 17-23: pages 4 (a tombstone) and 5
    match = tree.match_prefix(tokens[:24])
    assert (match.cached_len, match.matched_len, match.limited_by) == (0, 24, "window")
    # at 28: pages 5 and 6, both there; the deepest restorable point of a 36-token match is 36
    assert tree.match_prefix(tokens[:28]).cached_len == 28
    assert tree.match_prefix(tokens[:36]).limited_by is None
    # a split (another sequence branching at 28) cuts both lists; the rule reads across it
    other = tokens[:28] + [99] * 8
    result = tree.insert(other, pages[:7] + full.alloc(2),
                         window_page_ids=held[:7] + window.alloc(2))
    assert result.duplicate_page_ids == [] and result.duplicate_window_page_ids == []
    tree.check()
    assert tree.match_prefix(other).cached_len == 36
    assert tree.match_prefix(tokens[:32]).cached_len == 32  # pages 6 (upper node) and 7
    # a second copy of pages 3-5 fills the tombstone of page 3 and 4; page 5's is a duplicate
    mine = window.alloc(3)
    result = tree.insert(tokens[:24], pages[:6], window_page_ids=[None] * 3 + mine)
    assert result.duplicate_window_page_ids == [mine[2]]
    window.free(result.duplicate_window_page_ids)
    tree.check()
    assert tree.match_prefix(tokens[:24]).cached_len == 24  # pages 4 and 5 now there
    assert tree.match_prefix(tokens[:16]).limited_by == "window"  # page 2 is still gone
    # eviction frees both spaces, tombstones skipped
    tree.flush()
    tree.check()
    assert full.num_used == window.num_used == tree.window_pages == 0


SMALL_CHUNK = 16  # 4 pages: the 60-token prompts prefill in 4 chunks


def small_pool_engine(model: torch.nn.Module, sliding_pages: int) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96, sliding_pages=sliding_pages),
        scheduler=SchedulerConfig(chunked_prefill_tokens=SMALL_CHUNK, max_running_requests=2),
        kernels="torch",
    )
    return Engine(config, model).start(thread=False)


def test_a_sliding_pool_smaller_than_the_prompts_serves_them_exactly(checkpoint, model) -> None:
    """`[cache] sliding_pages` at its floor (2 running x (2 tails of 4 pages + 2) + a 16-token
    chunk's 4 = 24 pages, against 96 full ones): sliding pages come a chunk at a time, so two
    concurrent 60-token prompts (15 pages each, 46 full pages in use at the end) run in it,
    and then a 120-token prompt, 30 pages, more than the whole sliding pool (which a
    request given its whole prompt's sliding pages at admission could never start), every
    token and logprob equal to transformers'."""
    _, hf = checkpoint
    floor = 2 * (2 * ((WINDOW - 1 + PAGE - 1) // PAGE + 2) + 2) + SMALL_CHUNK // PAGE
    engine = small_pool_engine(model, floor)
    assert engine.window is not None and engine.window.allocator.capacity == floor == 24
    prompts = [prompt_of(31 + i, PROMPT) for i in range(2)] + [prompt_of(33, 2 * PROMPT)]
    outputs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(3)}
    for i in range(2):
        engine.submit(GenerateRequest(
            rid=f"r{i}", input_ids=prompts[i],
            sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
            logprobs=LogprobRequest()), outputs[f"r{i}"].append)
    peak_full, peak_sliding = 0, 0
    while engine.step():
        peak_full = max(peak_full, engine.pool.allocator.num_used)
        peak_sliding = max(peak_sliding, engine.window.allocator.num_used)
    assert peak_sliding <= floor < peak_full, (peak_sliding, peak_full)
    assert peak_full >= 2 * ((PROMPT + STEPS - 1) // PAGE)  # both sequences' full pages
    tokens, logprobs, _ = run(engine, "r2", prompts[2])
    assert_like_hf(hf, prompts[2], tokens, logprobs)
    for i in range(2):
        out = outputs[f"r{i}"]
        assert out[-1].finished and out[-1].error is None, out[-1]
        assert_like_hf(hf, prompts[i], [t for o in out for t in o.new_token_ids],
                       [float(lp.logprob) for o in out for lp in o.new_logprobs])
    assert engine.stats()["window_pages_total"] == floor
    assert_idle(engine)


def test_a_sliding_pool_below_its_floor_is_refused_naming_it(model) -> None:
    with pytest.raises(ValueError, match=r"sliding_pages = 23 .* at least 24"):
        small_pool_engine(model, 23)
    with pytest.raises(ValueError, match="sliding_pages must be 0 .* to 96"):
        CacheConfig(page_size=PAGE, num_device_pages=96, sliding_pages=97)


def test_a_prefill_short_of_sliding_pages_lets_the_decoding_go_on(checkpoint, model) -> None:
    """Sliding pages held elsewhere leave four spare: the decoding request lives on them (a
    new page at each boundary, its oldest freed once out of the window), so the next
    prompt's 4-page chunk cannot get its pages, and no newer request can give way. The scheduler then runs the decode
    step (without that fallback it formed no batch at all, forever); once the first request
    finishes, its cached pages are evicted for the chunk, and both answers equal
    transformers'."""
    _, hf = checkpoint
    engine = small_pool_engine(model, 24)
    assert engine.window is not None
    prompts = [prompt_of(41, 20), prompt_of(42, PROMPT)]
    outputs: dict[str, list[RequestOutput]] = {"a": [], "b": []}

    def submit(rid: str, prompt: list[int]) -> None:
        engine.submit(GenerateRequest(
            rid=rid, input_ids=prompt,
            sampling=SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True),
            logprobs=LogprobRequest()), outputs[rid].append)

    submit("a", prompts[0])
    while not outputs["a"]:
        assert engine.step()
    allocator = engine.window.allocator
    held = allocator.alloc(allocator.num_free - SMALL_CHUNK // PAGE)
    assert held is not None
    submit("b", prompts[1])
    for _ in range(50 * STEPS):  # bounded: a scheduler that forms no batch never ends
        if not engine.step():
            break
    for rid, prompt in zip(("a", "b"), prompts):
        out = outputs[rid]
        assert out and out[-1].finished and out[-1].error is None, (rid, out[-1:])
        assert_like_hf(hf, prompt, [t for o in out for t in o.new_token_ids],
                       [float(lp.logprob) for o in out for lp in o.new_logprobs])
    allocator.free(held)
    assert_idle(engine)


def test_a_long_conversation_in_a_small_sliding_pool_reclaims_its_path_s_old_tails(
        checkpoint, model) -> None:
    """Each turn hits the whole conversation before it, locking its path, and every earlier
    turn left window tails on that path (its prompt end's, its answer end's): with one
    request at a time and the pool at its floor (14 pages), the third turn found every
    sliding page on its own locked path and stalled (sliding pages 0 free, the request
    retracted and re-admitted forever). The tree now frees locked sliding pages behind
    every reader's window (`window_pages_reclaimed_total`): every turn ends, its tokens and
    logprobs equal transformers', and a later hit is cut where they were freed, never wrong."""
    _, hf = checkpoint
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=96, sliding_pages=14),
        scheduler=SchedulerConfig(chunked_prefill_tokens=SMALL_CHUNK, max_running_requests=1),
        kernels="torch")
    engine = Engine(config, model).start(thread=False)
    conversation: list[int] = []
    for turn in range(5):
        conversation = conversation + prompt_of(40 + turn, 20)
        outputs: list[RequestOutput] = []
        engine.submit(GenerateRequest(
            rid=f"t{turn}", input_ids=conversation,
            sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
            logprobs=LogprobRequest()), outputs.append)
        for _ in range(500):  # bounded: the stalled turn stepped forever
            if not engine.step():
                break
        assert outputs and outputs[-1].finished and outputs[-1].error is None, (
            turn, outputs[-1:])
        tokens = [t for o in outputs for t in o.new_token_ids]
        assert_like_hf(hf, conversation, tokens,
                       [float(lp.logprob) for o in outputs for lp in o.new_logprobs])
        if turn:  # the turn before is still hit (where its last window is)
            assert outputs[-1].cached.device > 0, turn
        engine.check_accounting()
        conversation = conversation + tokens[:-1]
    stats = engine.stats()
    assert stats["window_pages_reclaimed_total"] > 0
    # what an operator sees of it on /metrics
    from prometheus_client import CollectorRegistry, generate_latest

    from pdcache.server.metrics import EngineStatsCollector

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(engine.stats, "w"))
    text = generate_latest(registry).decode()
    for line in (f'pdcache_window_pages_reclaimed_total{{server="w"}} '
                 f'{float(stats["window_pages_reclaimed_total"])}',
                 'pdcache_window_pages_total{server="w"} 14.0',
                 f'pdcache_window_pages_freed_total{{server="w"}} '
                 f'{float(stats["window_pages_freed_total"])}'):
        assert line in text, text
    assert_idle(engine)
