"""Any role with any tiers: a node composes its scheduler (`Scheduler(tiers=, role=)`) instead of
subclassing it, so a decode node's role runs over HiCache tiers and a prefill node's role over
the device-only cache. A prompt prefilled by the one and decoded by the other equals a unified
run, and every tier's accounting stays exact."""

from __future__ import annotations

import functools
import random
import threading
from typing import Any

import pytest

from pdcache.decode_node.scheduler import DecodeRole
from pdcache.engine.api import GenerateRequest, RequestOutput, SamplingParams
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.tiers import DeviceOnly
from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.hicache_tiers import HiCacheTiers
from pdcache.prefill_node.scheduler import PrefillRole
from pdcache.transfer.messages import PrefillReport
from tests.hicache_support import PAGE, check_every_tier, engine_config

DECODE = SamplingParams(max_new_tokens=12, ignore_eos=True)


class TakeEverything:
    """A prefill controller that takes every finished request's prompt pages at once."""

    def __init__(self) -> None:
        self.taken: dict[str, tuple[list[int], PrefillReport]] = {}

    def take_prefilled(self, rid: str, page_ids: list[int], report: PrefillReport) -> bool:
        self.taken[rid] = (page_ids, report)
        return True

    def decode_ready(self, rid: str) -> bool:
        return True


class NoHolds:
    """Decode's offload holds, never asked without an offload manager."""

    def hold_for_offload(self, rid: str) -> Any:
        raise AssertionError("no offload: nothing is held for it")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def test_decode_role_over_hicache_tiers_after_a_device_only_prefill(tiny) -> None:
    model, tokenizer = tiny
    rng = random.Random(11)
    prompt = [rng.randrange(3, 250) for _ in range(29)]  # 7 full pages + a partial one
    sink = TakeEverything()
    unified = Engine(engine_config(model), model, tokenizer).start()
    prefill = Engine(engine_config(model), model, tokenizer,
                     make_scheduler=functools.partial(Scheduler, role=PrefillRole(sink))).start()
    decode = build_tiered_engine(engine_config(model), model, tokenizer,
                                 TierConfig(64, HiCacheConfig()), role=DecodeRole(None, NoHolds()))
    decode.engine.start()
    try:
        assert isinstance(prefill.scheduler.tiers, DeviceOnly)
        assert prefill.scheduler.reservations is None  # the prefill role takes none
        with pytest.raises(ValueError, match="takes no reservations"):
            prefill.reserve("x", 4)
        assert isinstance(decode.engine.scheduler.tiers, HiCacheTiers)
        assert isinstance(decode.engine.scheduler.role, DecodeRole)

        expected = [t for o in unified.generate(GenerateRequest("r", prompt, DECODE), 60)
                    for t in o.new_token_ids]
        first = prefill.generate(GenerateRequest("r", prompt, SamplingParams(1)), 60)
        src_pages, report = sink.taken["r"]
        assert report.prompt_tokens == len(prompt) and len(src_pages) == 8
        dst_pages = decode.engine.reserve("r", len(prompt))
        decode.engine.pool.device_kv[:, :, dst_pages] = prefill.pool.device_kv[:, :, src_pages]
        prefill.release_held("r")

        outputs: list[RequestOutput] = []
        done = threading.Event()

        def on_output(out: RequestOutput) -> None:
            outputs.append(out)
            if out.finished:
                done.set()

        decode.engine.submit_prefilled(GenerateRequest("r", prompt, DECODE),
                                       first[-1].new_token_ids[0], on_output)
        assert done.wait(60)
        assert [t for o in outputs for t in o.new_token_ids] == expected
        # the decoded request's pages entered decode's tree, and its HiCache backed them up
        check_every_tier(decode)
        assert decode.hicache.host_pool.num_used >= (len(prompt) + DECODE.max_new_tokens) // PAGE
        assert prefill.check_accounting()["requests"] == 0
    finally:
        unified.shutdown()
        prefill.shutdown()
        decode.close()
