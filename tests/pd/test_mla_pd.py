"""MLA + MoE (the tiny-mla preset: DeepSeek-V3's shape scaled down) through 1 prefill + 1
decode on every transfer engine, with decode offload over three turns: each answer equals a
no-cache unified run, latent pages cross P→D byte for byte (one slab per layer), and turn t+1
reuses the answer pages decode wrote in turn t (`storage_from_decode`)."""

from __future__ import annotations

import pytest

from pdcache.engine.loader import load_model
from tests.pd_harness import (
    MetadataService,
    UnifiedReference,
    assert_answers_reused,
    assert_stack_idle,
    node_setups,
    run_session,
    start_stack,
)
from tests.transfer_support import engine_params

PAGE = 4
ANSWER = 16  # 4 pages per answer
FIRST = [(7 * i + 3) % 250 for i in range(30)]
MESSAGES = [[(11 * t + j) % 250 + 1 for j in range(5)] for t in range(2)]  # three turns


@pytest.fixture(scope="module")
def tiny_mla():
    return load_model("tiny-mla", seed=0)


@pytest.fixture(scope="module")
def reference(tiny_mla):
    ref = UnifiedReference(*tiny_mla, PAGE)
    yield ref
    ref.close()


@pytest.mark.parametrize("engine", engine_params())
def test_three_turns_reuse_decode_written_latent_pages(engine, tiny_mla, reference,
                                                       tmp_path) -> None:
    service = MetadataService(tmp_path / "metadata")
    settings = {"path": str(tmp_path / "storage"), "capacity_pages": 4096,
                "metadata": service.address}
    prefill, decode = node_setups(tmp_path, tiny_mla[0], PAGE, engine, offload=True,
                                  storage_settings=settings)
    stack = start_stack(prefill, decode, preset="tiny-mla")
    try:
        assert stack.prefill_server.engine.pool.device_kv.shape[1] == 1  # one latent slab
        turns = run_session(stack, FIRST, MESSAGES, ANSWER, reference)
        assert len(turns) == 3
        assert_answers_reused(turns, MESSAGES, PAGE)
        snap = stack.decode_server_app.state.offload.snapshot()
        assert snap["pages_offloaded"] >= 2 * ANSWER // PAGE
        assert snap["pages_dropped"] == snap["pages_failed"] == 0
        assert_stack_idle(stack)
    finally:
        stack.close()
        service.stop()
