"""Decode's prefix cache over real HTTP and a real KV transfer (docs/design.md §4.12): a next
turn's request finds the previous turn's pages (the prompt prefill wrote, the answer decode
computed) in decode's tree, so prefill sends only the pages after them. Tokens equal the
unified no-cache engine's; another tenant's salt reuses nothing; with the cache off every page
travels (the same assertions fail)."""

from __future__ import annotations

import pytest

from tests.pd_harness import (
    UnifiedReference,
    metric_value,
    node_setups,
    run_session,
    start_stack,
)

PAGE = 4
ANSWER = 13
MESSAGES = [[9, 8, 7, 6, 5], [21, 22, 23, 24, 25, 26, 27]]


@pytest.fixture(scope="module")
def tiny():
    from pdcache.engine.loader import load_model

    return load_model("tiny", seed=0)


def _sender_counts(stack) -> tuple[int, int]:
    counters = stack.prefill_server.sender.stats()
    return counters["pages_sent"], counters["pages_decode_had"]


@pytest.mark.parametrize("decode_cache", [True, False], ids=["cache-on", "cache-off"])
def test_next_turns_send_only_the_pages_decode_lacks(tiny, tmp_path, decode_cache) -> None:
    model, tokenizer = tiny
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=True,
                                  decode_prefix_cache=decode_cache)
    stack = start_stack(prefill, decode)
    reference = UnifiedReference(model, tokenizer, PAGE)
    try:
        prompt = [(5 * i + 1) % 250 for i in range(30)]
        turns = run_session(stack, prompt, MESSAGES, ANSWER, reference=reference)
        sent, had = _sender_counts(stack)
        pages = [-(-len(t.prompt) // PAGE) for t in turns]
        # turn t's K/V on decode: every token of prompt + answer but the last answer token
        kept = [(len(t.prompt) + len(t.answer) - 1) // PAGE for t in turns[:-1]]
        expected_had = sum(kept) if decode_cache else 0
        assert had == expected_had and sent == sum(pages) - expected_had, (sent, had, pages)
        metrics = stack.client.get(f"{stack.decode.url}/metrics").text
        cached = metric_value(metrics, "pdcache_decode_admission_prompt_tokens_total",
                              source="cache")
        assert cached == expected_had * PAGE
        engine = stack.decode_server.engine
        numbers = engine.check_accounting()
        assert numbers["requests"] == 0  # nothing reserved or held once offload is done
        if decode_cache:  # the last turn's pages wait in the tree for a next turn
            assert numbers["tree"] == numbers["used"] == (
                len(turns[-1].prompt) + len(turns[-1].answer) - 1) // PAGE
            assert engine.stats()["pages_evictable"] == numbers["tree"]  # every lock let go
        else:
            assert numbers["used"] == 0
    finally:
        reference.close()
        stack.close()


def test_another_tenant_reuses_nothing_of_decode_cache(tiny, tmp_path) -> None:
    model, _ = tiny
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=False,
                                  decode_prefix_cache=True)
    stack = start_stack(prefill, decode)
    try:
        prompt = [(7 * i + 3) % 250 for i in range(33)]
        _, first = stack.generate(prompt, ANSWER, salt="tenant/a")
        turn2 = prompt + first["output_ids"] + [4, 4, 4, 4]
        _, theirs = stack.generate(turn2, 4, salt="tenant/b")
        assert _sender_counts(stack)[1] == 0  # tenant b's pages all came from prefill
        _, ours = stack.generate(turn2, 4, salt="tenant/a")
        assert _sender_counts(stack)[1] == (len(prompt) + ANSWER - 1) // PAGE
        assert ours["output_ids"] == theirs["output_ids"]
    finally:
        stack.close()
