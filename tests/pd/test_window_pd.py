"""gpt-oss (sliding-window layers) through 1 prefill + 1 decode over zmq with window pages on
decode (docs/design.md §4.14, control protocol 9): decode keeps its sliding layers' pages in a
pool of their own, prefill (one page space) writes the full layers of every prompt page and
the sliding layers of the prompt's window tail only, and decode's greedy tokens equal
transformers', also on a second turn served from decode's prefix cache up to the new
prompt's window tail (its cached sliding pages are tombstones there). A tail one page short (the window's oldest tokens never sent) decodes other
tokens.

The checkpoint is the tiny one of `tests/engine/test_gpt_oss.py` (transformers, fp32, seed
11): 4 layers, sliding (window 8) and full alternating, page size 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.decode_node import controller as decode_controller  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.request import pages_for  # noqa: E402
from tests.engine.test_gpt_oss import PAGE, prompt_of, save_gpt_oss  # noqa: E402
from tests.pd_harness import (  # noqa: E402
    PDStack,
    assert_answers_reused,
    assert_stack_idle,
    node_setups,
    run_session,
    start_model_stack,
)

PROMPT = prompt_of(5, 41)  # 10 full pages and one token
ANSWER = 16  # past the window
MESSAGE = prompt_of(9, 6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss-pd")
    return path, save_gpt_oss(path, seed=11)


@pytest.fixture(scope="module")
def gpt_oss(checkpoint) -> tuple[Any, Any]:
    return load_model(str(checkpoint[0]))


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def start(tmp_path: Path, gpt_oss, decode_prefix_cache: bool = False,
          offload: bool = False, window_tiers: bool = False) -> PDStack:
    model, tokenizer = gpt_oss
    # both nodes see each other's writes: a file store (hf3fs with in-process metadata
    # would give each its own index)
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=offload,
                                  decode_prefix_cache=decode_prefix_cache,
                                  backend="file" if offload else "hf3fs",
                                  window_tiers=window_tiers)
    return start_model_stack(prefill, decode, model, tokenizer)


def assert_window_idle(stack: PDStack) -> None:
    stack.decode_server.engine.flush_cache()  # decode's prefix cache, when on
    assert_stack_idle(stack)
    numbers = stack.decode_server.engine.check_accounting()
    assert numbers["window_free"] == numbers["window_capacity"], numbers


@pytest.mark.parametrize("window_tiers", [False, True], ids=["one-space", "window-tiers"])
def test_decode_with_window_pages_equals_transformers(gpt_oss, checkpoint, tmp_path,
                                                      window_tiers: bool) -> None:
    """The same bytes cross either way: prefill sends the full layers of every prompt page
    and the sliding layers of the tail, from its one page space, or (`[cache] window_tiers`,
    prefill keeps window pages too) the tail from its sliding pool."""
    stack = start(tmp_path, gpt_oss, window_tiers=window_tiers)
    try:
        window = stack.decode_server.engine.window
        assert window is not None
        assert (stack.prefill_server.engine.window is not None) == window_tiers
        p, d = stack.generate(PROMPT, ANSWER)
        assert "output_ids" in d, (p, d)
        assert d["output_ids"] == hf_greedy(checkpoint[1], PROMPT, ANSWER)
        sent = stack.prefill_server.sender.stats()
        tail = window.tail_pages(len(PROMPT))
        pages = pages_for(len(PROMPT), PAGE)
        assert len(tail) == 3 and tail.stop == pages
        assert sent["window_pages_sent"] == len(tail)
        geometry = gpt_oss[0].config.kv_geometry
        kinds = geometry.layer_kinds
        slab = geometry.slab_page_bytes(PAGE)
        assert sent["bytes_sent"] == 2 * slab * (
            kinds.count("full") * pages + kinds.count("sliding") * len(tail))
        assert stack.decode_server.receiver.stats()["bytes_received"] == sent["bytes_sent"]
        assert_window_idle(stack)
    finally:
        stack.close()


def test_a_tail_one_page_short_decodes_other_tokens(gpt_oss, checkpoint, tmp_path,
                                                    monkeypatch) -> None:
    """Protection off: decode asks for the window tail without its first page; that
    sliding page, reserved but never written, is read by the first decode steps."""
    original = decode_controller._window_destination

    def short_tail(admission: Any) -> dict[str, Any]:
        window = original(admission)
        return {"dst_window_pages": window["dst_window_pages"][1:],
                "window_first_page": window["window_first_page"] + 1}

    monkeypatch.setattr(decode_controller, "_window_destination", short_tail)
    stack = start(tmp_path, gpt_oss)
    try:
        _, d = stack.generate(PROMPT, ANSWER)
        expected = hf_greedy(checkpoint[1], PROMPT, ANSWER)
        assert d["output_ids"][0] == expected[0]  # prefill's own token
        assert d["output_ids"] != expected
        assert stack.prefill_server.sender.stats()["window_pages_sent"] == 2
        assert_window_idle(stack)
    finally:
        stack.close()



def test_second_turn_from_decodes_prefix_cache_up_to_the_tail(gpt_oss, checkpoint,
                                                              tmp_path) -> None:
    stack = start(tmp_path, gpt_oss, decode_prefix_cache=True)
    hf = checkpoint[1]
    try:
        window = stack.decode_server.engine.window
        assert window is not None
        _, first = stack.generate(PROMPT, ANSWER)
        assert first["output_ids"] == hf_greedy(hf, PROMPT, ANSWER)
        turn = PROMPT + first["output_ids"] + MESSAGE  # 63 tokens, 16 pages
        sent_before = stack.prefill_server.sender.stats()
        _, second = stack.generate(turn, ANSWER)
        assert second["output_ids"] == hf_greedy(hf, turn, ANSWER)
        sent = stack.prefill_server.sender.stats()
        tail = window.tail_pages(len(turn))
        # decode's tree held 14 pages (56 tokens computed); it reuses those before the tail
        pages = pages_for(len(turn), PAGE)
        assert tail == range(13, 16)
        assert sent["pages_decode_had"] - sent_before["pages_decode_had"] == tail.start
        assert sent["window_pages_sent"] - sent_before["window_pages_sent"] == len(tail)
        geometry = gpt_oss[0].config.kv_geometry
        all_layers = 2 * geometry.slab_page_bytes(PAGE) * len(geometry.layer_kinds)
        assert sent["bytes_sent"] - sent_before["bytes_sent"] == (pages - tail.start) * all_layers
        assert_window_idle(stack)
    finally:
        stack.close()


@pytest.mark.parametrize("window_tiers", [False, True], ids=["one-space", "window-tiers"])
def test_decode_offload_with_window_pages_writes_what_the_next_turns_reuse(
        gpt_oss, checkpoint, tmp_path, window_tiers: bool) -> None:
    """Decode offload on a decode node with window pages: it receives the sliding layers of
    each prompt's window tail only (decode offload used to turn window pages off: every
    prompt page's sliding layers sent and kept), stages the answer's pages from both page
    spaces as stored pages of every layer, leaves the prompt pages it has no sliding layers
    of to prefill, and frees the answer's sliding pages behind the window once copied.
    Turns 2 and 3 on prefill reuse the answers decode wrote (`storage_from_decode`) and every
    turn equals transformers' greedy tokens."""
    hf = checkpoint[1]
    stack = start(tmp_path, gpt_oss, offload=True, window_tiers=window_tiers)
    try:
        window = stack.decode_server.engine.window
        assert window is not None and stack.decode_server_app.state.offload is not None
        messages = [MESSAGE, [m + 1 for m in MESSAGE]]
        turns = run_session(stack, PROMPT, messages, ANSWER,
                            reference=lambda prompt, n: hf_greedy(hf, prompt, n))
        assert_answers_reused(turns, messages, PAGE)
        sent = stack.prefill_server.sender.stats()
        assert sent["window_pages_sent"] == sum(len(window.tail_pages(len(t.prompt)))
                                                for t in turns)
        offload = stack.decode_server_app.state.offload.snapshot()
        # prompt pages: stored by prefill before decode's lookup, or left to it (a race)
        assert offload["pages_offloaded"] > 0 and offload["pages_dropped"] == 0, offload
        assert stack.decode_server.engine.stats()["window_pages_freed_total"] > 0
        if not window_tiers:  # every layer of every page, staged from both page spaces
            assert offload["states_offloaded"] == 0
            assert_window_idle(stack)
            return
        # stored as prefill's tiers store them: full-layer pages plus each answer's window
        # tail (the next turn's prefill restores it with the pages it reads)
        hicache = stack.prefill_server.tiered.hicache
        tail_bytes = hicache.host_states.slot_nbytes
        assert offload["states_offloaded"] == len(turns) and offload["pages_left_to_prefill"] == 0
        assert offload["state_bytes_offloaded"] == len(turns) * tail_bytes
        assert hicache.stats.load_storage_states >= len(messages)
        assert hicache.host_pool.page_nbytes * 2 == gpt_oss[0].config.kv_geometry.page_bytes(PAGE)
        assert_window_idle(stack)
    finally:
        stack.close()
