"""Qwen3-Next (hybrid: DeltaNet layers with a recurrent state, gated attention with KV pages)
through 1 prefill + 1 decode over zmq (docs/design.md §4.14): the room carries the state after
the prompt beside its pages, decode restores it and decodes exactly as transformers and a
no-cache unified engine do; decode's prefix cache serves a second turn; a decode of another
state geometry fails the room cleanly on both nodes; decode offload writes the answer's end
state as a stored state object beside its pages.

The checkpoint is the tiny one of `tests/engine/test_qwen3_next.py` (transformers, fp32, seed
7): 4 layers, DeltaNet and gated attention alternating, page size 4.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.config import NodeSetup  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.page_keys import PageKeyScheme, state_key  # noqa: E402
from pdcache.engine.request import pages_for  # noqa: E402
from pdcache.engine.state_pool import StateSnapshot  # noqa: E402
from tests.engine.test_qwen3_next import VOCAB, save_qwen3_next  # noqa: E402
from tests.pd_harness import (  # noqa: E402
    MetadataService,
    PDStack,
    UnifiedReference,
    assert_answers_reused,
    assert_stack_idle,
    node_setups,
    run_session,
    start_model_stack,
)
from tests.polling import poll  # noqa: E402

PAGE = 4
ANSWER = 10
PROMPT = [(i * 37 + 11) % VOCAB for i in range(30)]  # 7 full pages + 2 tokens
MESSAGE = [(i * 53 + 7) % VOCAB for i in range(6)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3-next-pd")
    return path, save_qwen3_next(path)


@pytest.fixture(scope="module")
def hybrid(checkpoint) -> tuple[Any, Any]:
    return load_model(str(checkpoint[0]))


@pytest.fixture(scope="module")
def reference(hybrid):
    ref = UnifiedReference(*hybrid, PAGE)
    yield ref
    ref.close()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def setups(tmp_path: Path, model: Any, offload: bool = False,
           decode_prefix_cache: bool = False,
           metadata: str = "inproc") -> tuple[NodeSetup, NodeSetup]:
    """`metadata`: hf3fs's metadata service; "inproc" gives each node its own (decode's
    writes are then not visible to prefill)."""
    storage = {"path": str(tmp_path / "storage"), "capacity_pages": 4096, "state_capacity": 64,
               "metadata": metadata}
    return node_setups(tmp_path, model, PAGE, "zmq", offload=offload, storage_settings=storage,
                       decode_prefix_cache=decode_prefix_cache)


def start(prefill: NodeSetup, decode: NodeSetup, hybrid, decode_model=None) -> PDStack:
    """`tests.pd_harness.start_stack` for a model loaded from a checkpoint directory."""
    model, tokenizer = hybrid
    return start_model_stack(prefill, decode, model, tokenizer, decode_model)


def state_accounting_exact(stack: PDStack) -> None:
    """Both engines' state slots back (the tree's checkpoints aside), every receiver state
    slot free, no state held by a room."""
    for engine in (stack.prefill_server.engine, stack.decode_server.engine):
        numbers = engine.check_accounting()
        assert numbers["state_requests"] == numbers["state_pending"] == 0, numbers
        assert numbers["state_free"] + numbers["state_tree"] == numbers["state_capacity"]
    states = stack.decode_server.receiver.states
    assert states is not None
    assert poll(lambda: states.num_free == states.num_slots, 10)


def assert_idle(stack: PDStack) -> None:
    """`assert_stack_idle` for a decode node with a prefix cache (its tree dropped first),
    and the state slots of both nodes."""
    stack.decode_server.engine.flush_cache()
    assert_stack_idle(stack)
    state_accounting_exact(stack)


def test_greedy_tokens_equal_transformers_and_the_state_crosses(hybrid, checkpoint,
                                                                 reference, tmp_path) -> None:
    prefill, decode = setups(tmp_path, hybrid[0])
    stack = start(prefill, decode, hybrid)
    try:
        p, d = stack.generate(PROMPT, ANSWER)
        assert "output_ids" in d, (p, d)
        assert d["output_ids"] == hf_greedy(checkpoint[1], PROMPT, ANSWER)
        assert d["output_ids"] == reference(PROMPT, ANSWER)
        assert p["output_ids"] == d["output_ids"][:1]
        sent = stack.prefill_server.sender.stats()
        received = stack.decode_server.receiver.stats()
        state_bytes = hybrid[0].config.state_geometry.state_bytes()
        assert sent["states_sent"] == received["states_received"] == 1
        assert received["state_bytes_received"] == state_bytes
        assert_stack_idle(stack)
        state_accounting_exact(stack)
    finally:
        stack.close()


def test_zero_state_on_decode_gives_other_tokens(hybrid, reference, tmp_path,
                                                 monkeypatch) -> None:
    """The protection shown off: a decode that starts from the zero state (as if the state
    had not travelled) decodes other tokens than the reference."""
    from pdcache.decode_node.controller import DecodeController

    def zero_state(self, entry):
        state = original(self, entry)
        return None if state is None else StateSnapshot(state.geometry,
                                                        torch.zeros_like(state.data))

    original = DecodeController._take_state
    monkeypatch.setattr(DecodeController, "_take_state", zero_state)
    prefill, decode = setups(tmp_path, hybrid[0])
    stack = start(prefill, decode, hybrid)
    try:
        _, d = stack.generate(PROMPT, ANSWER)
        assert d["output_ids"][0] == reference(PROMPT, ANSWER)[0]  # prefill's own token
        assert d["output_ids"] != reference(PROMPT, ANSWER)
        assert_stack_idle(stack)
    finally:
        stack.close()


def test_second_turn_hits_decodes_prefix_cache(hybrid, reference, tmp_path) -> None:
    prefill, decode = setups(tmp_path, hybrid[0], decode_prefix_cache=True)
    stack = start(prefill, decode, hybrid)
    try:
        _, first = stack.generate(PROMPT, ANSWER)
        assert first["output_ids"] == reference(PROMPT, ANSWER)
        tree = stack.decode_server.engine.tree
        assert tree is not None and poll(lambda: tree.num_checkpoints >= 1, 10)
        turn = PROMPT + first["output_ids"] + MESSAGE
        received = stack.decode_server.receiver.stats()["bytes_received"]
        page_bytes = received // pages_for(len(PROMPT), PAGE)  # turn 1 sent every page
        _, second = stack.generate(turn, ANSWER)
        assert second["output_ids"] == reference(turn, ANSWER)
        # decode's tree had the first 9 pages (up to the answer-end checkpoint, 36 tokens):
        # prefill sent only the rest, and its state after the whole prompt
        sent = stack.decode_server.receiver.stats()["bytes_received"] - received
        assert sent == (pages_for(len(turn), PAGE) - 36 // PAGE) * page_bytes, sent
        assert stack.decode_server.receiver.stats()["states_received"] == 2
        assert_idle(stack)
    finally:
        stack.close()


def test_geometry_mismatch_fails_the_room_cleanly(hybrid, tmp_path) -> None:
    """A decode node built with another state geometry (here: another SSM dtype) refuses the
    room `state_mismatch` before a byte moves; both nodes end with exact accounting."""
    model, _ = hybrid
    prefill, decode = setups(tmp_path, model)
    geometry = model.config.state_geometry
    other = dataclasses.replace(geometry, conv_dtype="bfloat16")
    assert other.key() != geometry.key()
    stack = start(prefill, _with_state_geometry(decode, other), hybrid)
    try:
        p, d = stack.generate(PROMPT, ANSWER)
        assert d.get("error", {}).get("code") == "transfer_failed", d
        assert "state" in str(d).lower()
        mismatches = (stack.prefill_server.sender.stats()["state_mismatches"]
                      + stack.decode_server.receiver.stats()["state_mismatches"])
        assert mismatches >= 1
        assert_stack_idle(stack)
        state_accounting_exact(stack)
        engine = stack.decode_server.engine
        assert engine.check_accounting()["used"] == 0
    finally:
        stack.close()


def _with_state_geometry(decode: NodeSetup, geometry) -> NodeSetup:
    """`decode` whose model config reports `geometry` as its state geometry."""
    config = decode.engine.model

    class OtherGeometry(type(config)):  # type: ignore[misc]
        @property
        def state_geometry(self):
            return geometry

    other = object.__new__(OtherGeometry)
    other.__dict__.update(config.__dict__)
    return dataclasses.replace(decode, engine=dataclasses.replace(decode.engine, model=other))


@pytest.mark.parametrize("decode_tree", [True, False], ids=["pending-checkpoint", "no-tree"])
def test_decode_offload_writes_the_answer_end_state(hybrid, reference, tmp_path,
                                                    decode_tree) -> None:
    """With decode's prefix cache the end state is the scheduler's pending decode checkpoint;
    without, the decode role's host copy of the last full page's state."""
    prefill, decode = setups(tmp_path, hybrid[0], offload=True, decode_prefix_cache=decode_tree)
    stack = start(prefill, decode, hybrid)
    offload = stack.decode_server_app.state.offload
    handed: list[Any] = []  # the states the decode role hands to offload (engine thread)
    finish = offload.finish

    def recording_finish(*args, **kwargs):
        handed.append(kwargs.get("state"))
        return finish(*args, **kwargs)

    offload.finish = recording_finish
    try:
        _, d = stack.generate(PROMPT, ANSWER, salt="tenant")
        answer = d["output_ids"]
        assert answer == reference(PROMPT, ANSWER)
        assert stack.offload_idle(30)
        snap = offload.snapshot()
        assert snap["states_offloaded"] == 1 and snap["states_failed"] == 0, snap
        # the K/V decode held: prompt + answer but its last token; its last full page ends at
        end = (len(PROMPT) + ANSWER - 1) // PAGE * PAGE
        assert len(handed) == 1 and handed[0] is not None and handed[0].tokens == end
        tokens = (PROMPT + answer)[:end]
        scheme = PageKeyScheme(decode.fingerprint, PAGE, decode.key_scheme, decode.key_namespace)
        keys, _ = scheme.keys(tokens, "tenant", None)
        key = state_key(keys[-1], hybrid[0].config.state_geometry.key())
        storage = offload.storage
        assert storage.exists_state(key)
        stored = storage.get_state(key, end)  # verified: fingerprint, geometry, position
        assert stored == handed[0].snapshot.data.numpy().tobytes()  # byte-exact
        assert storage.get_state(key, end - PAGE) is None  # another position: a counted miss
        assert_idle(stack)
    finally:
        stack.close()


# ---- the engine's side: `Engine.submit_prefilled(..., state=)` ------------------------------

def prompt_state(reference: UnifiedReference, prompt: list[int]) -> tuple[int, StateSnapshot]:
    """The reference engine's first token and its recurrent state after `prompt` (what a
    prefill node sends), captured before its request's slot is freed."""
    engine = reference.engine
    role = engine.scheduler.role
    captured: list[StateSnapshot] = []
    hold = role.hold_after_finish

    def capture(req):  # engine thread: the slot still holds the state after the prompt
        captured.append(engine.states.pool.snapshot(req.state_slot))
        return hold(req)

    role.hold_after_finish = capture
    try:
        reference._memo.pop((tuple(prompt), 1), None)
        first = reference(prompt, 1)[0]
    finally:
        del role.hold_after_finish
    assert len(captured) == 1
    return first, captured[0]


def prompt_kv(model: Any, prompt: list[int]) -> torch.Tensor:
    """The K/V of `prompt`'s pages as a prefill node writes them (pages on dim 2 of the
    pool's `device_kv`), computed by another engine."""
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine

    reference = Engine(EngineConfig(model.config, CacheConfig(PAGE, 64,
                                                              enable_prefix_cache=False)),
                       model).start(thread=False)
    held: list[list[int]] = []
    reference.scheduler.role.hold_after_finish = lambda req: held.append(req.page_ids) or True
    reference.submit(GenerateRequest("p", prompt, SamplingParams(max_new_tokens=1)), lambda _out: None)
    while reference.step():
        pass
    src = torch.tensor(held[0][: pages_for(len(prompt), PAGE)])
    return reference.pool.device_kv[:, :, src].clone()


def prefilled_tokens(model: Any, prompt: list[int], first: int,
                     state: StateSnapshot | None) -> tuple[list[int], str | None]:
    """Decode `prompt` from prefill's pages (copied in) and `state` on a fresh engine."""
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine

    engine = Engine(EngineConfig(model.config, CacheConfig(PAGE, 64, enable_prefix_cache=False)),
                    model).start(thread=False)
    # the prompt's K/V as a prefill node writes it: computed by another engine, copied over
    pages = engine.reserve("pd", len(prompt))
    engine.pool.device_kv[:, :, pages] = prompt_kv(model, prompt)
    outs: list[Any] = []
    engine.submit_prefilled(GenerateRequest("pd", prompt, SamplingParams(
        max_new_tokens=ANSWER, ignore_eos=True)), first, outs.append, state=state)
    while engine.step():
        pass
    tokens = [t for out in outs for t in out.new_token_ids]
    numbers = engine.check_accounting()
    assert numbers["used"] == 0 and numbers["state_free"] == numbers["state_capacity"], numbers
    return tokens, outs[-1].error


def test_a_prefilled_start_restores_the_state_it_is_given(hybrid, reference) -> None:
    model = hybrid[0]
    first, state = prompt_state(reference, PROMPT)
    tokens, error = prefilled_tokens(model, PROMPT, first, state)
    assert error is None and tokens == reference(PROMPT, ANSWER)
    # the protection: without the state it is refused, with another geometry's too
    assert prefilled_tokens(model, PROMPT, first, None)[1].find("recurrent state") >= 0
    other = dataclasses.replace(state.geometry, conv_dtype="bfloat16")
    wrong = StateSnapshot(other, torch.zeros(other.state_bytes(), dtype=torch.uint8))
    assert "another geometry" in (prefilled_tokens(model, PROMPT, first, wrong)[1] or "")
    # and a zero state (what decode had before state transfer) decodes other tokens
    zero = StateSnapshot(state.geometry, torch.zeros_like(state.data))
    tokens, error = prefilled_tokens(model, PROMPT, first, zero)
    assert error is None and tokens != reference(PROMPT, ANSWER)


def test_three_turns_restore_the_state_decode_wrote(hybrid, reference, tmp_path) -> None:
    """Turn t+1's prefill reuses turn t's answer pages and the answer-end state decode wrote
    (`storage_from_decode`), and still decodes the reference's tokens."""
    service = MetadataService(tmp_path / "metadata")
    prefill, decode = setups(tmp_path, hybrid[0], offload=True, metadata=service.address)
    stack = start(prefill, decode, hybrid)
    try:
        messages = [MESSAGE, [m + 1 for m in MESSAGE]]
        turns = run_session(stack, PROMPT, messages, 12, reference)
        assert_answers_reused(turns, messages, PAGE)
        assert stack.decode_server_app.state.offload.snapshot()["states_offloaded"] == 3
        hicache = stack.prefill_server.tiered.hicache.snapshot()
        assert hicache["prefetch_states"] == 2, hicache  # turns 2 and 3: decode's states
        assert_idle(stack)
    finally:
        stack.close()
        service.stop()


def test_prefilled_starts_beyond_the_state_slots_wait_for_one(hybrid, reference) -> None:
    """Decode under load: a hybrid engine has `max_running_requests` request state slots, so
    reservations beyond them wait in the admission queue until a slot frees (backpressure,
    as for pages), never a start that fails for want of a slot; each decodes the reference's
    tokens."""
    from pdcache.engine.api import GenerateRequest, SamplingParams
    from pdcache.engine.config import CacheConfig, EngineConfig
    from pdcache.engine.engine import Engine
    from pdcache.engine.reservations import Admission
    from pdcache.engine.scheduler_config import SchedulerConfig

    model = hybrid[0]
    first, state = prompt_state(reference, PROMPT)
    kv = prompt_kv(model, PROMPT)
    engine = Engine(EngineConfig(model.config, CacheConfig(PAGE, 96, enable_prefix_cache=False),
                                 SchedulerConfig(max_running_requests=2)),
                    model).start(thread=False)
    admissions: list[Admission] = []
    outs: dict[str, list[Any]] = {}
    for i in range(5):
        engine.reserve_when_free(f"r{i}", len(PROMPT), admissions.append, max_new_tokens=ANSWER)
    engine.step()
    assert [a.rid for a in admissions] == ["r0", "r1"]  # the rest wait for a state slot
    assert engine.stats()["reservations_pending"] == 3
    started = 0
    while engine.step() or started < len(admissions):
        for admission in admissions[started:]:
            assert admission.ok, admission
            engine.pool.device_kv[:, :, admission.page_ids] = kv
            outs[admission.rid] = []
            engine.submit_prefilled(GenerateRequest(admission.rid, PROMPT, SamplingParams(
                max_new_tokens=ANSWER, ignore_eos=True)), first, outs[admission.rid].append,
                state=state)
            started += 1
        assert len(engine.scheduler.running) <= 2
    assert sorted(outs) == [f"r{i}" for i in range(5)]
    for rid, out in outs.items():
        assert out[-1].finished and out[-1].error is None, (rid, out[-1])
        assert [t for o in out for t in o.new_token_ids] == reference(PROMPT, ANSWER), rid
    numbers = engine.check_accounting()
    assert numbers["used"] == 0 and numbers["state_free"] == numbers["state_capacity"], numbers


def test_more_pd_requests_than_running_slots_all_decode(hybrid, reference, tmp_path) -> None:
    """1P1D with one running request on decode: concurrent rooms queue for its one state
    slot and all decode exactly (none fails 500, none is refused)."""
    prefill, decode = setups(tmp_path, hybrid[0])
    decode = dataclasses.replace(decode, engine=dataclasses.replace(
        decode.engine, scheduler=dataclasses.replace(decode.engine.scheduler,
                                                     max_running_requests=1)))
    stack = start(prefill, decode, hybrid)
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda prompt: stack.generate(prompt, ANSWER)[1], prompts))
        for prompt, answer in zip(prompts, answers):
            assert answer.get("output_ids") == reference(prompt, ANSWER), answer
        assert_stack_idle(stack)
        state_accounting_exact(stack)
    finally:
        stack.close()


def test_decode_reuses_pages_beyond_its_last_checkpoint(hybrid, reference, tmp_path) -> None:
    """Decode's reservations match pages only (the state comes from prefill): a prompt that
    shares 5 pages with a cached one, where decode's tree has no checkpoint, reuses them."""
    prefill, decode = setups(tmp_path, hybrid[0], decode_prefix_cache=True)
    stack = start(prefill, decode, hybrid)
    try:
        _, first = stack.generate(PROMPT, ANSWER)
        assert first["output_ids"] == reference(PROMPT, ANSWER)
        tree = stack.decode_server.engine.tree
        assert tree is not None and poll(lambda: tree.num_checkpoints >= 1, 10)
        other = PROMPT[:20] + MESSAGE + PROMPT[:4]  # 5 shared pages, then another branch
        assert tree.node_at(other[:20]) is None  # no checkpoint can end there
        received = stack.decode_server.receiver.stats()["bytes_received"]
        page_bytes = received // pages_for(len(PROMPT), PAGE)
        _, second = stack.generate(other, ANSWER)
        assert second["output_ids"] == reference(other, ANSWER)
        sent = stack.decode_server.receiver.stats()["bytes_received"] - received
        assert sent == (pages_for(len(other), PAGE) - 5) * page_bytes, sent
        assert_idle(stack)
    finally:
        stack.close()


def test_offload_keeps_the_answer_end_checkpoint_for_decodes_tree(hybrid, reference,
                                                                  tmp_path) -> None:
    """With offload on, a finished request's pages are held until its copies are done; its
    pending decode checkpoint is held with them and reaches decode's tree on release, so a
    second turn through decode's prefix cache restores the state there."""
    prefill, decode = setups(tmp_path, hybrid[0], offload=True, decode_prefix_cache=True)
    stack = start(prefill, decode, hybrid)
    try:
        _, first = stack.generate(PROMPT, ANSWER)
        assert first["output_ids"] == reference(PROMPT, ANSWER)
        assert stack.offload_idle(30)
        engine = stack.decode_server.engine
        assert poll(lambda: not engine.stats()["requests_held"], 10)
        end = (len(PROMPT) + ANSWER - 1) // PAGE * PAGE  # the answer's last full page
        tree = engine.tree
        assert tree is not None
        node = tree.node_at((PROMPT + first["output_ids"])[:end])
        assert node is not None and node.state_slot is not None
        turn = PROMPT + first["output_ids"] + MESSAGE
        _, second = stack.generate(turn, ANSWER)
        assert second["output_ids"] == reference(turn, ANSWER)
        # decode's own admission of the turn hits the checkpoint (its state restored)
        from pdcache.engine.api import GenerateRequest, SamplingParams

        restored = engine.states.counters.checkpoints_restored
        outs = engine.generate(GenerateRequest("local", turn, SamplingParams(
            max_new_tokens=ANSWER, ignore_eos=True)))
        assert outs[-1].error is None and outs[-1].cached.device >= end, outs[-1]
        assert engine.states.counters.checkpoints_restored == restored + 1
        assert [t for o in outs for t in o.new_token_ids] == reference(turn, ANSWER)
        assert stack.offload_idle(30)
        assert poll(lambda: not engine.stats()["requests_held"], 10)
        assert_idle(stack)
    finally:
        stack.close()
