"""Qwen3-Next through the engine (device tier): per-request recurrent state, chunked prefill,
prefix hits restored from state checkpoints, retraction, accounting; greedy tokens and
logprobs equal transformers'.

The checkpoint is the tiny one of `test_qwen3_next.py` (built by transformers, fp32, seed 7):
4 layers, DeltaNet and gated attention alternating, page size 4. transformers' reference runs
the whole sequence again for every token (no cache), so it shares nothing with our paths.

Checkpoint points (pdcache.engine.state_cache): a request's prompt's last full page, a branch
point (where its page match went deeper than its deepest checkpoint) and its answer's last
full page (the pending decode checkpoint, handed to the tree with the pages).
"""

from __future__ import annotations

from dataclasses import replace
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
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.radix import RadixTree  # noqa: E402
from pdcache.engine.scheduler import Scheduler  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from pdcache.engine.state_geometry import RecurrentStateGeometry  # noqa: E402
from pdcache.engine.state_pool import StateSnapshot  # noqa: E402
from pdcache.engine.tiers import DeviceOnly  # noqa: E402
from tests.engine.test_qwen3_next import VOCAB, save_qwen3_next  # noqa: E402

PAGE = 4
LOGPROB_ATOL = 2e-3
PROMPT = [(i * 37 + 11) % VOCAB for i in range(30)]  # 7 full pages + 2 tokens
OTHER = [(i * 53 + 7) % VOCAB for i in range(12)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3-next-engine")
    return path, save_qwen3_next(path)


@pytest.fixture(scope="module")
def model(checkpoint) -> torch.nn.Module:
    return load_model(str(checkpoint[0]))[0]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, each from a full forward."""
    ids, logprobs = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], logprobs


def make_engine(model: torch.nn.Module, *, pages: int = 96, chunk: int = 2048,
                running: int = 4, checkpoints: int = 16, prefix_cache: bool = True) -> Engine:
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=pages,
                          state_checkpoint_slots=checkpoints,
                          enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(chunked_prefill_tokens=chunk, max_running_requests=running),
    )
    return Engine(config, model).start(thread=False)


def submit(engine: Engine, rid: str, prompt: list[int], steps: int,
           outputs: dict[str, list[RequestOutput]]) -> None:
    outputs[rid] = []
    engine.submit(GenerateRequest(
        rid=rid, input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True),
        logprobs=LogprobRequest()), outputs[rid].append)


def generate(engine: Engine, prompt: list[int], steps: int,
             rid: str = "r") -> tuple[list[int], list[float], RequestOutput]:
    outputs: dict[str, list[RequestOutput]] = {}
    submit(engine, rid, prompt, steps, outputs)
    while engine.step():
        pass
    return tokens_of(outputs[rid])


def tokens_of(outs: list[RequestOutput]) -> tuple[list[int], list[float], RequestOutput]:
    assert outs[-1].finished and outs[-1].error is None, outs[-1]
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = [float(lp.logprob) for out in outs for lp in out.new_logprobs]
    return tokens, logprobs, outs[-1]


def assert_like_hf(hf: torch.nn.Module, prompt: list[int], tokens: list[int],
                   logprobs: list[float]) -> None:
    expected, expected_logprobs = hf_greedy(hf, prompt, len(tokens))
    assert tokens == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs),
                               atol=LOGPROB_ATOL, rtol=0)


def assert_idle(engine: Engine) -> None:
    """Nothing runs: every state slot is free but the tree's checkpoints; a flush frees all."""
    numbers = engine.check_accounting()
    assert numbers["state_requests"] == numbers["state_pending"] == 0, numbers
    assert numbers["state_free"] + numbers["state_tree"] == numbers["state_capacity"], numbers
    engine.flush_cache()
    numbers = engine.check_accounting()
    assert numbers["state_free"] == numbers["state_capacity"], numbers
    assert numbers["free"] == numbers["capacity"], numbers


# ---- parity ------------------------------------------------------------------------------------

def test_cold_prompt_and_a_long_decode_equal_transformers(checkpoint, model) -> None:
    engine = make_engine(model)
    tokens, logprobs, last = generate(engine, PROMPT, 40)
    assert last.cached.device == 0
    assert_like_hf(checkpoint[1], PROMPT, tokens, logprobs)
    assert_idle(engine)


def test_without_a_prefix_cache_the_pool_holds_request_slots_only(checkpoint, model) -> None:
    engine = make_engine(model, running=2, prefix_cache=False)
    assert engine.states is not None and engine.states.pool.capacity == 2
    for rid in ("a", "b"):  # the same prompt twice: computed twice, same tokens
        tokens, logprobs, last = generate(engine, PROMPT, 10, rid)
        assert last.cached.device == 0
        assert_like_hf(checkpoint[1], PROMPT, tokens, logprobs)
    numbers = engine.check_accounting()
    assert numbers["state_free"] == numbers["state_capacity"] == 2


def test_chunked_prefill_carries_the_state_across_chunks(checkpoint, model) -> None:
    engine = make_engine(model, chunk=7)  # chunks of 7 (and cut at the checkpoint point, 28)
    tokens, logprobs, last = generate(engine, PROMPT, 12)
    assert last.computed_tokens == len(PROMPT)  # extend tokens; decode steps not counted
    assert_like_hf(checkpoint[1], PROMPT, tokens, logprobs)
    assert_idle(engine)


def test_prefix_hits_restore_the_deepest_checkpoint_and_say_why(checkpoint, model) -> None:
    hf = checkpoint[1]
    engine = make_engine(model)
    first, _, _ = generate(engine, PROMPT, 6, "first")  # checkpoints at 28 and 32 (answer)
    tree = engine.tree
    assert tree is not None and tree.num_checkpoints == 2
    fill = PROMPT + first

    # shares 7 pages: the prompt's checkpoint (28) is the whole match
    second = PROMPT[:28] + OTHER
    match = tree.match_prefix(second[:-1])
    assert (match.cached_len, match.matched_len, match.limited_by) == (28, 28, None)
    tokens, logprobs, last = generate(engine, second, 8, "second")
    assert last.cached.device == 28
    assert_like_hf(hf, second, tokens, logprobs)

    # shares 5 pages, no checkpoint at or before 20: a cold start, limited by the state; the
    # request checkpoints the branch point (20) on its way
    third = PROMPT[:22] + OTHER
    match = tree.match_prefix(third[:-1])
    assert (match.cached_len, match.matched_len, match.limited_by) == (0, 20, "state")
    tokens, logprobs, last = generate(engine, third, 8, "third")
    assert last.cached.device == 0
    assert_like_hf(hf, third, tokens, logprobs)
    stats = engine.stats()
    assert stats["prefix_hits_limited_by_state_total"] == 1
    assert stats["tokens_limited_by_state_total"] == 20

    # diverges between two checkpoints (20 and 28), inside page 6: the longest exact hit is 20
    fourth = PROMPT[:26] + OTHER
    match = tree.match_prefix(fourth[:-1])
    assert (match.cached_len, match.matched_len, match.limited_by) == (20, 24, "state")
    tokens, logprobs, last = generate(engine, fourth, 8, "fourth")
    assert last.cached.device == 20
    assert_like_hf(hf, fourth, tokens, logprobs)

    # the next turn of the first conversation: restores the state its decode wrote (32)
    turn = fill + OTHER
    match = tree.match_prefix(turn[:-1])
    assert (match.cached_len, match.limited_by) == (32, None)
    tokens, logprobs, last = generate(engine, turn, 8, "turn")
    assert last.cached.device == 32
    assert_like_hf(hf, turn, tokens, logprobs)
    assert engine.stats()["state_checkpoints_restored_total"] == 3
    assert_idle(engine)


def test_batched_requests_and_retraction_recompute_from_checkpoints(checkpoint, model) -> None:
    """Three requests decode together in a pool too small for them: the newest are retracted
    (state dropped, pages cached), re-admitted from their deepest checkpoint, and still give
    transformers' tokens."""
    hf = checkpoint[1]
    engine = make_engine(model, pages=30, chunk=64)
    prompts = [PROMPT[:18], OTHER + PROMPT[:9], PROMPT[5:25]]
    outputs: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(prompts):
        submit(engine, f"r{i}", prompt, 30, outputs)
    while engine.step():
        engine.check_accounting()
    assert engine.stats()["requests_retracted_total"] >= 1
    for i, prompt in enumerate(prompts):
        tokens, logprobs, _ = tokens_of(outputs[f"r{i}"])
        assert_like_hf(hf, prompt, tokens, logprobs)
    assert_idle(engine)


def test_abort_frees_the_state_exactly_once(model) -> None:
    engine = make_engine(model)
    outputs: dict[str, list[RequestOutput]] = {}
    submit(engine, "gone", PROMPT, 20, outputs)
    engine.step()
    engine.step()
    assert engine.check_accounting()["state_requests"] == 1
    engine.abort("gone")
    while engine.step():
        pass
    assert outputs["gone"][-1].finish_reason == "abort"
    assert_idle(engine)


# ---- capacity, eviction, refusals --------------------------------------------------------------

def test_checkpoint_slots_count_in_capacity(model) -> None:
    """One checkpoint slot: a newer checkpoint drops the least recently used one (or is
    skipped, counted), never a failure."""
    engine = make_engine(model, checkpoints=1)
    for i in range(4):
        prompt = [(t + 31 * i) % VOCAB for t in PROMPT[:21]]
        generate(engine, prompt, 6, f"r{i}")
        numbers = engine.check_accounting()
        assert numbers["state_tree"] + numbers["state_pending"] <= 1
    stats = engine.stats()
    assert stats["state_checkpoints_dropped_total"] + stats["state_checkpoints_skipped_total"] > 0
    assert stats["state_checkpoints"] == 1
    assert_idle(engine)


def test_decoding_requests_never_push_out_the_prompt_checkpoints(model) -> None:
    """Four requests decode long answers at once with four checkpoint slots: their pending
    answer-end copies take at most half the share and no tree checkpoint, so the shared
    prompt's checkpoint still serves the next request (before that cap, the pending copies
    dropped every tree checkpoint and the hit fell to nothing)."""
    engine = make_engine(model, running=4, checkpoints=4)
    outputs: dict[str, list[RequestOutput]] = {}
    shared = PROMPT[:16]
    for i in range(4):
        submit(engine, f"r{i}", shared + [(7 * i + 3) % VOCAB, 11], 20, outputs)
    while engine.step():
        numbers = engine.check_accounting()
        assert numbers["state_pending"] <= 2, numbers
    _, _, last = generate(engine, shared + [5, 6, 7], 2, "next")
    assert last.cached.device == 16, last.cached
    assert_idle(engine)


def test_evicting_pages_frees_their_checkpoints(checkpoint, model) -> None:
    engine = make_engine(model, pages=24)
    for i in range(4):
        prompt = [(t + 31 * i) % VOCAB for t in PROMPT[:21]]
        generate(engine, prompt, 6, f"r{i}")
        engine.check_accounting()
    stats = engine.stats()
    assert stats["pages_evicted_total"] > 0 and stats["state_checkpoints_evicted_total"] > 0
    # a node whose checkpoint went with a deeper node's eviction, or a checkpoint evicted
    # with its pages: never a wrong hit (tokens as transformers')
    prompt = PROMPT[:21]
    tokens, logprobs, _ = generate(engine, prompt, 6, "again")
    assert_like_hf(checkpoint[1], prompt, tokens, logprobs)
    assert_idle(engine)


def test_a_state_snapshot_of_another_geometry_is_refused(model) -> None:
    engine = make_engine(model)
    assert engine.states is not None
    pool = engine.states.pool
    slot = pool.alloc()
    assert slot is not None
    snapshot = pool.snapshot(slot)
    other = replace(pool.geometry, layer_ids=(0,))
    assert isinstance(other, RecurrentStateGeometry)
    with pytest.raises(ValueError, match="another geometry"):
        pool.restore(slot, StateSnapshot(other, snapshot.data))
    with pytest.raises(ValueError, match="uint8 bytes"):
        pool.restore(slot, StateSnapshot(pool.geometry, snapshot.data[:-4]))
    pool.free(slot)


def test_tiers_that_do_not_carry_state_are_refused_for_a_hybrid_model(model) -> None:
    """A tree without the state restore rule, or tiers that cannot restore a state, would
    serve hits without the linear layers' state: refused. HiCache's tiers carry it
    (tests/offload_manager/test_hybrid_tiers.py)."""
    config = EngineConfig(model=model.config, cache=CacheConfig(page_size=PAGE,
                                                                num_device_pages=16))
    with pytest.raises(ValueError, match="tiers do not carry recurrent state"):
        Engine(config, model, make_tree=lambda pool, states=None: RadixTree(PAGE, pool.allocator))

    class OtherTiers:  # any tiers but DeviceOnly that do not say they carry the state
        def __init__(self, tree: RadixTree | None) -> None:
            self.inner = DeviceOnly(tree)

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    def make_scheduler(**kwargs) -> Scheduler:
        return Scheduler(**kwargs, tiers=OtherTiers(kwargs["tree"]))

    with pytest.raises(ValueError, match="tiers do not carry recurrent state"):
        Engine(config, model, make_scheduler=make_scheduler)


def test_a_prefilled_start_is_refused_without_state_transfer(model) -> None:
    engine = make_engine(model)
    engine.reserve("pd", len(PROMPT))
    outs: list[RequestOutput] = []
    engine.submit_prefilled(GenerateRequest(rid="pd", input_ids=PROMPT), 5, outs.append)
    while engine.step():
        pass
    assert outs[-1].finish_reason == "abort" and "recurrent state" in (outs[-1].error or "")
    assert_idle(engine)


def test_presets_run_through_the_engine_deterministically() -> None:
    prompt = list(b"the state of a hybrid model")
    runs = []
    for _ in range(2):
        engine = Engine.from_spec("tiny-qwen3-next", seed=3,
                                  cache=CacheConfig(page_size=PAGE, num_device_pages=64))
        engine.start(thread=False)
        runs.append(generate(engine, prompt, 8)[0])
        again = generate(engine, prompt, 8, "again")
        assert again[2].cached.device == len(prompt) // PAGE * PAGE
        assert again[0] == runs[-1]
        assert_idle(engine)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # not a degenerate model


def test_export_model_writes_a_checkpoint_transformers_runs_as_we_do(tmp_path: Path) -> None:
    """`pdcache export-model tiny-qwen3-next`: transformers loads it as Qwen3NextForCausalLM
    and greedy-decodes the engine's tokens; our loader reads back the preset's weights."""
    from pdcache.engine.export import export_preset

    export_preset("tiny-qwen3-next", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    ours, preset = load_model(str(tmp_path))[0], load_model("tiny-qwen3-next")[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                 preset.state_dict().values()))
    engine = make_engine(preset)
    prompt = list(b"the state of a hybrid model")
    tokens, logprobs, _ = generate(engine, prompt, 10)
    assert_like_hf(hf, prompt, tokens, logprobs)


# ---- the tree's restore rule, without a model --------------------------------------------------

class FakeSlots:
    """`CheckpointSlots` that records frees (a second free of a slot fails)."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self.freed: list[int] = []

    def take(self, slot: int) -> int:
        self.used.add(slot)
        return slot

    def free_checkpoint(self, slot: int) -> None:
        assert slot in self.used, f"double free of {slot}"
        self.used.remove(slot)
        self.freed.append(slot)

    def is_used(self, slot: int) -> bool:
        return slot in self.used


def state_tree(pages: int = 32) -> tuple[RadixTree, FakeSlots]:
    from pdcache.engine.kv_pool import PageAllocator
    from pdcache.engine.radix import StateCheckpointRule

    slots = FakeSlots()
    tree = RadixTree(PAGE, PageAllocator(pages), restore_rules=(StateCheckpointRule(),),
                     checkpoints=slots)
    return tree, slots


def test_tree_hits_only_at_checkpoints_and_splits_keep_them_below() -> None:
    tree, slots = state_tree()
    tokens = list(range(40))
    pages = tree.allocator.alloc(10)
    assert pages is not None
    leaf = tree.insert(tokens, pages).last_node  # one node of 10 pages
    assert tree.set_checkpoint(leaf, slots.take(0))
    assert not tree.set_checkpoint(leaf, 1)  # one state per node: the caller keeps slot 1
    # a match inside the node: pages match, no state there
    match = tree.match_prefix(tokens[:30])
    assert (match.cached_len, match.matched_len, match.limited_by) == (0, 28, "state")
    # an insert that splits the node at page 5: the checkpoint stays at the end (40)
    tree.insert(tokens[:20] + [999] * 8, tree.allocator.alloc(7) or [])
    upper = tree.node_at(tokens[:20])
    assert upper is not None and upper.state_slot is None and leaf.state_slot == 0
    assert tree.set_checkpoint(upper, slots.take(1))
    match = tree.match_prefix(tokens[:39])  # the page match is 36: the deepest state is 20
    assert (match.cached_len, match.matched_len, match.limited_by) == (20, 36, "state")
    assert match.last_node is upper and match.page_ids == pages[:5]
    match = tree.match_prefix(tokens + [7])
    assert (match.cached_len, match.limited_by, match.last_node) == (40, None, leaf)
    tree.count_match(tree.match_prefix(tokens[:39]))
    assert tree.limited_matches == {"state": 1} and tree.limited_tokens == {"state": 16}
    tree.check()


def test_tree_frees_each_checkpoint_once_by_eviction_or_to_make_room() -> None:
    tree, slots = state_tree()
    first = tree.insert(list(range(8)), tree.allocator.alloc(2) or []).last_node
    second = tree.insert(list(range(100, 108)), tree.allocator.alloc(2) or []).last_node
    tree.set_checkpoint(first, slots.take(0))
    tree.set_checkpoint(second, slots.take(1))
    tree.lock(second)
    tree.lock(first)
    tree.unlock(first)  # first used last, but unlocked: dropped first
    assert tree.drop_lru_checkpoint() and slots.freed == [0] and first.on_device
    assert tree.match_prefix(list(range(9))).cached_len == 0  # its pages stay, no hit
    tree.unlock(second)
    assert tree.flush() == 4
    assert slots.freed == [0, 1] and tree.num_checkpoints == 0
    assert tree.num_evicted_checkpoints == 1 and tree.num_dropped_checkpoints == 1
    assert not tree.drop_lru_checkpoint()
    tree.check()


@pytest.mark.parametrize(("pages", "chunk", "checkpoints"), [(24, 5, 3), (40, 9, 1), (24, 64, 16)])
def test_random_shared_prefixes_never_give_a_wrong_hit(model, pages, chunk, checkpoints) -> None:
    """Prompts cut from one base at random points plus random tails, answers of random
    lengths, some submitted together: every answer equals the one of an engine without a
    prefix cache, and the accounting holds after every step."""
    import random

    rng = random.Random(pages * 100 + chunk)
    base = [rng.randrange(VOCAB) for _ in range(60)]
    engine = make_engine(model, pages=pages, chunk=chunk, checkpoints=checkpoints)
    cold = make_engine(model, pages=400, running=8, prefix_cache=False)
    outputs: dict[str, list[RequestOutput]] = {}
    expected: dict[str, list[RequestOutput]] = {}
    for i in range(10):
        prompt = base[: rng.randrange(3, 50)] + [rng.randrange(VOCAB) for _ in range(3)]
        steps = rng.randrange(1, 20)
        submit(engine, str(i), prompt, steps, outputs)
        submit(cold, str(i), prompt, steps, expected)
        while rng.random() < 0.5 and engine.step():
            engine.check_accounting()
    while engine.step():
        engine.check_accounting()
    while cold.step():
        pass
    for rid, outs in outputs.items():
        assert tokens_of(outs)[0] == tokens_of(expected[rid])[0], rid
    assert engine.stats()["state_checkpoints_restored_total"] > 0
    assert_idle(engine)
