"""The `session` eviction policy on a decode node: a P/D request's `session_id` reaches the
decode engine (`Bridge.submit_prefilled`), each turn counts once in its tracker, and the
prompt's nodes in its tree belong to the session once the turn finishes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
from collections.abc import Iterator

import pytest

from pdcache.engine.config import CacheConfig
from pdcache.engine.loader import load_model
from tests.pd_harness import PDStack, node_setups, start_stack

PAGE = 4
TURN1 = [(3 * i + 5) % 250 for i in range(13)]
TURN2 = TURN1 + [(11 * i + 7) % 250 for i in range(9)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[PDStack]:
    model = load_model("tiny", seed=0)[0]
    prefill, decode = node_setups(tmp_path_factory.mktemp("pd_sess"), model, PAGE, "zmq", False)
    cache = CacheConfig(PAGE, 256, enable_prefix_cache=True, device_eviction="session")
    decode = dataclasses.replace(decode, engine=dataclasses.replace(decode.engine, cache=cache))
    stack = start_stack(prefill, decode)
    try:
        yield stack
    finally:
        stack.close()


def turn(stack: PDStack, input_ids: list[int], session: str) -> None:
    room = secrets.randbits(63)
    base = {
        "input_ids": input_ids,
        "session_id": session,
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
    }
    p_body = {**base, "pd": {"room": room, "role": "prefill", "decode_node": "d0"}}
    d_body = {
        **base,
        "pd": {"room": room, "role": "decode", "bootstrap": stack.bootstrap, "prefill_node": "p0"},
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(stack.client.post, f"{stack.prefill.url}/generate", json=p_body)
        d = pool.submit(stack.client.post, f"{stack.decode.url}/generate", json=d_body)
        assert p.result().status_code == d.result().status_code == 200, d.result().text


def test_a_decode_nodes_tree_learns_the_turns(stack) -> None:
    engine = stack.decode_server.engine
    tree = engine.tree
    assert tree is not None and tree.sessions is not None
    turn(stack, TURN1, "chat")
    turn(stack, TURN2, "chat")
    assert tree.sessions.num_turns("chat") == 2
    engine.check_accounting()  # on the engine thread: the last release has run
    match = tree.match_prefix(TURN2[: len(TURN2) // PAGE * PAGE])
    assert match.last_node is not None and match.last_node.session_id == "chat"
    assert tree.sessions.num_turns("other") == 0
