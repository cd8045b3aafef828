"""The decode-offload session on the Mooncake Store backend (a real `mooncake_master` on
loopback, mooncake transfer): tokens equal the unified no-cache run, turn t+1 reuses the
answer pages decode put into the store, accounting returns to idle."""

from __future__ import annotations

import uuid

import pytest

from pdcache.engine.loader import load_model
from tests.pd_harness import (
    UnifiedReference,
    assert_answers_reused,
    assert_stack_idle,
    node_setups,
    run_session,
    start_stack,
)

pytest.importorskip("mooncake.store", reason="mooncake wheel not installed")

PAGE = 4
ANSWER = 16
FIRST = [(13 * i + 5) % 250 for i in range(26)]
MESSAGES = [[(17 * t + j) % 250 + 1 for j in range(6)] for t in range(4)]


@pytest.fixture()
def master(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

    server = LocalMooncakeMaster().start()
    try:
        yield server.address
    finally:
        server.stop()


def test_five_turn_session_on_mooncake_store(master, tmp_path) -> None:
    model, tokenizer = load_model("tiny", seed=0)
    settings = {"path": str(tmp_path / "unused"), "capacity_pages": 4096,
                "namespace": f"t{uuid.uuid4().hex[:10]}", "mooncake_master": master,
                "mooncake_segment_bytes": 16 << 20, "mooncake_local_buffer_bytes": 16 << 20}
    prefill, decode = node_setups(tmp_path, model, PAGE, "mooncake", offload=True,
                                  backend="mooncake", storage_settings=settings)
    reference = UnifiedReference(model, tokenizer, PAGE)
    stack = start_stack(prefill, decode)
    try:
        turns = run_session(stack, FIRST, MESSAGES, ANSWER, reference)
        assert_answers_reused(turns, MESSAGES, PAGE)
        snap = stack.decode_server_app.state.offload.snapshot()
        assert snap["pages_offloaded"] >= 4 * 4 and snap["pages_failed"] == 0, snap
        assert_stack_idle(stack)
    finally:
        stack.close()
        reference.close()
