"""HiCache policies inside the real engine (tiny preset), not just the controller:

- per-layer load: the forward waits for layer i's host → device copy right before layer i's
  attention, and layer i+1 is still not on device at that moment (recorded by a LayerLoad
  subclass and a hook on each layer's attention output), for host hits and prefetched pages;
  with `copy_ahead` the copies run on the copier thread, ahead of the forward, and layer i's
  attention still never runs before layer i's copy ended (a copy held back is waited for);
- write_back: nothing is backed up while a node is on device; device eviction writes it to
  host and storage, and both serve it back exactly;
- write_through_selective: a node is backed up only once it was hit `threshold` times.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pdcache.engine.api import GenerateRequest
from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
from pdcache.offload_manager.hicache import HiCacheConfig
from pdcache.offload_manager.layer_loads import LayerLoad
from tests.hicache_support import (
    PARAMS,
    PROMPT,
    check_every_tier,
    engine_config,
    generate,
    reference_tokens,
    run_to_end,
    storage_config,
    tiered,
)

Event = tuple[str, int]


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    return reference_tokens(tiny, PROMPT)


def recording_load(events: list[Event], checks: list[tuple[int, bool, bool]]) -> type[LayerLoad]:
    class RecordingLayerLoad(LayerLoad):
        """Logs each wait; after it, whether layer i is on device and layer i+1 not yet."""

        def wait(self, layer: int) -> None:
            if self.done:  # the runner's finish() after the forward: nothing left to copy
                return
            events.append(("wait", layer))
            super().wait(layer)
            pages = self.device_kv[:, :, self.device_ids]
            loaded = bool(pages[layer].abs().sum() > 0)
            ahead = layer + 1 < self.num_layers and bool(pages[layer + 1].abs().sum() > 0)
            checks.append((layer, loaded, ahead))

    return RecordingLayerLoad


@contextmanager
def attention_recorded(model, events: list[Event]) -> Iterator[None]:
    """Logs ("attn", layer) as each layer's attention has run: a forward pre-hook on the
    layer's output projection, which takes the attention's result (and runs after the
    layer's load wait)."""

    def recorder(layer: int):
        def record(_module, _inputs) -> None:
            events.append(("attn", layer))

        return record

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(recorder(layer.self_attn.layer_id))
               for layer in model.model.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def assert_layer_by_layer(events: list[Event], checks: list, num_layers: int) -> None:
    loaded_forward = events[: 2 * num_layers]  # the forward that consumed the load
    assert loaded_forward == [e for i in range(num_layers) for e in (("wait", i), ("attn", i))]
    assert not any(kind == "wait" for kind, _ in events[2 * num_layers:])  # done: no more waits
    assert [c[0] for c in checks] == list(range(num_layers))
    assert all(loaded for _, loaded, _ in checks), checks
    assert not any(ahead for _, _, ahead in checks), "a later layer was loaded early"


def test_forward_waits_for_each_layer_of_host_and_storage_loads(tiny, expected, tmp_path):
    model = tiny[0]
    layers = model.config.num_hidden_layers
    cfg = storage_config(model, backend="hf3fs", path=str(tmp_path))
    first = tiered(tiny, cfg, copy_ahead=False)
    try:
        generate(first.engine, "cold", PROMPT)
        first.engine.flush_cache()  # demoted to host
        check_every_tier(first)
        first.hicache.device_kv.zero_()  # idle engine, every device page free: mark "not loaded"
        events: list[Event] = []
        checks: list = []
        first.hicache.layer_load_cls = recording_load(events, checks)
        with attention_recorded(model, events):
            tokens, out = generate(first.engine, "host", PROMPT)
        assert tokens == expected and out.cached.host == 40
        assert_layer_by_layer(events, checks, layers)
        check_every_tier(first)
    finally:
        first.close()
    second = tiered(tiny, cfg, prefetch_policy="wait_complete",  # zeroed device pool
                    copy_ahead=False)
    try:
        events, checks = [], []
        second.hicache.layer_load_cls = recording_load(events, checks)
        with attention_recorded(model, events):
            tokens, out = generate(second.engine, "storage", PROMPT)
        assert tokens == expected and out.cached.storage == 40
        assert_layer_by_layer(events, checks, layers)
        check_every_tier(second)
    finally:
        second.close()


def failing_load(layer: int, times: list[int]) -> type[LayerLoad]:
    """A load whose copy of `layer` raises, while `times` holds a count (a copy fault)."""

    class FailingLayerLoad(LayerLoad):
        def copy_layer(self, at: int) -> None:
            if at == layer and times and times[0] > 0:
                times[0] -= 1
                raise RuntimeError("injected host → device copy fault")
            super().copy_layer(at)

    return FailingLayerLoad


@pytest.mark.parametrize("copy_ahead", [False, True], ids=["inline", "copy_ahead"])
def test_a_failed_host_load_is_recomputed_and_leaves_no_junk_in_the_tree(
        tiny, expected, copy_ahead) -> None:
    """A host hit's copy raises at layer 1 (layers 1+ of the restored nodes' device pages
    keep what they held). The step failed with the request (an error to the client), and
    the restored nodes stayed on device over those pages: the next request hit them and
    read junk. Now the load fails, not the step: the request recomputes (no lower tier this
    time) and the nodes' device copies are dropped (`RadixTree.drop_suspects`; with them
    kept, the recompute itself hits them: other tokens); the next request is exact."""
    built = tiered(tiny, None, copy_ahead=copy_ahead)
    try:
        generate(built.engine, "cold", PROMPT)
        built.engine.flush_cache()  # demoted to host
        junk = torch.Generator().manual_seed(0)  # what a page held before (any other K/V)
        built.hicache.device_kv.copy_(torch.randn(built.hicache.device_kv.shape, generator=junk))
        built.hicache.layer_load_cls = failing_load(1, [1])
        tokens, out = generate(built.engine, "host", PROMPT)
        assert tokens == expected and out.error is None
        assert (out.cached.device, out.cached.host) == (0, 0)  # recomputed
        assert built.hicache.stats.load_failed_copies == 1
        assert built.engine.scheduler.tree.num_dropped_suspect_pages == 10
        built.hicache.layer_load_cls = LayerLoad
        tokens, out = generate(built.engine, "again", PROMPT)
        assert tokens == expected and out.cached.device == 40
        check_every_tier(built)
    finally:
        built.close()


def test_a_request_that_read_a_failed_load_beside_it_is_recomputed_too(tiny, expected) -> None:
    """Two requests admitted in one step: the first restores the host hit onto device, the
    second matches those nodes there and reads them in the same forward. The first's copy
    fails at layer 1: both are recomputed (with only the loader requeued, the other kept
    what it computed from the pages' old contents: other tokens)."""
    model, tokenizer = tiny
    longer = PROMPT + [7, 8, 9, 10, 11, 12]
    want_longer = reference_tokens(tiny, longer)
    built = build_tiered_engine(engine_config(model), model, tokenizer,
                                TierConfig(host_pages=64, hicache=HiCacheConfig()))
    built.engine.start(thread=False)
    try:
        outs: dict[str, list] = {"cold": []}
        built.engine.submit(GenerateRequest("cold", PROMPT, PARAMS), outs["cold"].append)
        run_to_end(built)
        built.engine.flush_cache()
        junk = torch.Generator().manual_seed(0)  # what a page held before (any other K/V)
        built.hicache.device_kv.copy_(torch.randn(built.hicache.device_kv.shape, generator=junk))
        built.hicache.layer_load_cls = failing_load(1, [1])
        for rid, prompt in (("a", PROMPT), ("b", longer)):
            outs[rid] = []
            built.engine.submit(GenerateRequest(rid, prompt, PARAMS), outs[rid].append)
        run_to_end(built)
        tokens = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in ("a", "b")}
        assert tokens == {"a": expected, "b": want_longer}
        assert built.hicache.stats.load_failed_copies == 1
        check_every_tier(built)
    finally:
        built.close()


class HeldEvents(list):
    """The events list; `attended` is set once the held layer's attention ran."""

    def __init__(self, held_layer: int) -> None:
        super().__init__()
        self.held_layer = held_layer
        self.attended = threading.Event()

    def append(self, item) -> None:
        super().append(item)
        if item == ("attn", self.held_layer):
            self.attended.set()


def copy_ahead_load(events: HeldEvents) -> type[LayerLoad]:
    """Records ("wait", i) on the engine thread and ("copied", i, thread name) when the copier
    ended layer i. The held layer's copy starts only once the forward waits for it, and then
    gives a forward that did not wait 0.5 s to run that layer's attention first."""
    forward_waits = threading.Event()
    held_layer = events.held_layer

    class HeldLayerLoad(LayerLoad):
        def wait(self, layer: int) -> None:
            if not self.done:
                events.append(("wait", layer))
                if layer == held_layer:
                    forward_waits.set()
            super().wait(layer)

        def copy_layer(self, layer: int) -> None:
            if layer == held_layer:
                assert forward_waits.wait(30), "the forward never waited for the held layer"
                events.attended.wait(0.5)  # set only if attention ran ahead of this copy
            super().copy_layer(layer)
            events.append(("copied", layer, threading.current_thread().name))

    return HeldLayerLoad


def test_copy_ahead_copies_on_its_thread_and_attention_waits_for_each_layer(
        tiny, expected, tmp_path) -> None:
    model = tiny[0]
    layers = model.config.num_hidden_layers
    held = layers - 1
    cfg = storage_config(model, backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, cfg, copy_ahead=True)
    try:
        generate(built.engine, "cold", PROMPT)
        built.engine.flush_cache()  # demoted to host
        built.hicache.device_kv.zero_()
        events = HeldEvents(held)
        built.hicache.layer_load_cls = copy_ahead_load(events)
        with attention_recorded(model, events):
            tokens, out = generate(built.engine, "host", PROMPT)
        assert tokens == expected and out.cached.host == 40
        copied = [e for e in events if e[0] == "copied"]
        assert [e[1] for e in copied] == list(range(layers))
        assert {e[2] for e in copied} == {"pdcache-h2d"}
        attn = [e for e in events if e[0] == "attn"]
        for layer in range(layers):  # no attention before its layer's copy ended
            assert events.index(("copied", layer, "pdcache-h2d")) < events.index(attn[layer])
        # the held layer: the forward waited for it, and its copy ended only after that
        assert events.index(("wait", held)) < events.index(("copied", held, "pdcache-h2d"))
        stats = built.hicache.snapshot()
        assert stats["load_copy_us"] > 0 and stats["load_copy_wait_us"] > 0
        check_every_tier(built)
    finally:
        built.close()


def test_write_back_backs_up_on_device_eviction(tiny, expected, tmp_path) -> None:
    cfg = storage_config(tiny[0], backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, cfg, write_policy="write_back")
    try:
        generate(built.engine, "a", PROMPT)
        assert built.hicache.wait_idle(10)
        stats = built.hicache.stats
        assert stats.backup_host_pages == 0 and built.storage.stats()["used_pages"] == 0
        tokens, out = generate(built.engine, "b", PROMPT)
        assert tokens == expected and out.cached.device == 40
        assert stats.backup_host_pages == 0
        built.engine.flush_cache()  # eviction: the last moment to keep the KV
        check_every_tier(built)
        stored = (len(PROMPT) + 8 - 1) // 4
        assert stats.backup_host_pages == stored
        assert stats.backup_storage_pages == stored
        assert built.storage.stats()["used_pages"] == stored
        tokens, out = generate(built.engine, "c", PROMPT)
        assert tokens == expected and (out.cached.device, out.cached.host) == (0, 40)
        check_every_tier(built)
    finally:
        built.close()
    fresh = tiered(tiny, cfg, write_policy="write_back", prefetch_policy="wait_complete")
    try:
        tokens, out = generate(fresh.engine, "d", PROMPT)
        assert tokens == expected and out.cached.storage == 40
        check_every_tier(fresh)
    finally:
        fresh.close()


def test_an_exact_repeat_applies_the_write_policy(tiny, tmp_path) -> None:
    """A prompt repeated exactly inserts nothing (a prefill node's every request: one output
    token), and only an insert applied the write policy: under write_through_selective a hot
    prompt was never backed up, however often it was hit."""
    from pdcache.engine.api import GenerateRequest, SamplingParams

    cfg = storage_config(tiny[0], backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, cfg, write_policy="write_through_selective", write_through_threshold=2)
    one_token = SamplingParams(max_new_tokens=1, ignore_eos=True)
    try:
        for i in range(3):  # inserted, then hit twice
            built.engine.generate(GenerateRequest(f"r{i}", PROMPT, one_token, ""), timeout=120)
        assert built.hicache.wait_idle(10)
        stats = built.hicache.stats
        assert stats.backup_host_pages == 10 and stats.backup_storage_pages == 10
        check_every_tier(built)
    finally:
        built.close()


def test_write_through_selective_waits_for_hits(tiny, expected, tmp_path) -> None:
    cfg = storage_config(tiny[0], backend="hf3fs", path=str(tmp_path))
    built = tiered(tiny, cfg, write_policy="write_through_selective", write_through_threshold=2)
    try:
        stats = built.hicache.stats
        generate(built.engine, "a", PROMPT)
        assert built.hicache.wait_idle(10)
        assert stats.backup_host_pages == 0  # inserted, never hit
        hits = 0
        while stats.backup_host_pages == 0 and hits < 4:
            tokens, out = generate(built.engine, f"hit{hits}", PROMPT)
            assert tokens == expected and out.cached.device == 40
            hits += 1
        assert hits == 2, f"backed up after {hits} hits, threshold 2"
        check_every_tier(built)
        assert stats.backup_host_pages >= 10 and stats.backup_storage_pages >= 10
        shorter = PROMPT[:21] + [1, 2, 3]  # a different continuation: its new node is not hit
        generate(built.engine, "other", shorter)
        check_every_tier(built)
        backed = stats.backup_host_pages
        generate(built.engine, "other2", [9] * 21)
        check_every_tier(built)
        assert stats.backup_host_pages == backed  # a new prompt is not backed up
    finally:
        built.close()
    fresh = tiered(tiny, cfg, prefetch_policy="wait_complete")
    try:
        tokens, out = generate(fresh.engine, "d", PROMPT)
        assert tokens == expected and out.cached.storage == 40
        check_every_tier(fresh)
    finally:
        fresh.close()


def test_recording_load_sees_zeroed_pages_as_not_loaded() -> None:
    """The checks above rely on a zeroed device page reading as "not loaded"."""
    from pdcache.engine.kv_geometry import KVGeometry
    from pdcache.offload_manager.host_pool import HostKVPool

    host = HostKVPool(2, KVGeometry.mha(2, 1, 2, "float32"), 4)
    page = host.alloc(1)
    host.commit(page)
    host.host_kv[page[0]] = 1.0
    device_kv = torch.zeros(2, 2, 3, 4, 1, 2)
    events: list[Event] = []
    checks: list = []
    load = recording_load(events, checks)(host, device_kv, page, [2])
    load.wait(0)
    assert checks == [(0, True, False)] and not load.done
    load.finish()
    assert checks[-1] == (1, True, False) and load.done and not host.is_pinned(page[0])
