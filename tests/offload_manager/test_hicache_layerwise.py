"""Layer-streamed prefetch (HiCacheConfig.layerwise_prefetch, topology key
`cache.prefetch_layerwise`) inside the real engine, tiny preset, a prompt of 40 pages over 4
layers:

- exact: the tokens equal a no-cache run's, and the prompt's device K/V after the storage hit
  is byte-identical with layer streaming on, off, and on the engine that computed it;
- overlap: with a storage backend (registered in the public backend registry) whose read stops
  after layer 0 until the forward asks for layer 1, layer 0's attention runs before layer 1 is
  read, and the result is still exact;
- a page that fails verification after its layers were consumed (the read held after layer 0
  until the forward asks for layer 1, so nothing is verified at admission): the request is
  requeued and recomputed (exact tokens, counted); with the requeue disabled the corrupt K/V
  reaches the output (so the protection is what keeps it exact);
- accounting: a request aborted while its streamed read is held gives every host staging page
  back once the read ends (not before: the read still writes into them), and the read stops
  early;
- a request retracted while holding a streamed load that then fails verification caches
  nothing and writes nothing to host or storage (then recomputes exactly);
- a read that hangs after layer 0: the forward stops waiting at the prefetch's deadline, the
  request recomputes (exact, bounded time) and the read is cancelled;
- a stream none of whose pages continue the match at admission (prefetch restarts off) is
  cancelled (reads stop).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from pdcache.engine.api import GenerateRequest
from pdcache.offload_manager.layer_loads import LayerLoad
from pdcache.offload_manager.storage import BACKENDS
from pdcache.offload_manager.storage.file import FileBackend
from pdcache.offload_manager.storage.layer_reads import LayerStream
from pdcache.offload_manager.storage.page_format import HEADER_BYTES
from tests.hicache_support import (
    PAGE,
    PARAMS,
    check_every_tier,
    generate,
    prompt_keys,
    reference_tokens,
    run_to_end,
    storage_config,
    tiered,
)
from tests.polling import wait_until

PROMPT = [(13 * i + 5) % 250 for i in range(161)]  # 40 full pages + 1 token
PAGES = 40
GATED = "gated-file"


class GatedFileBackend(FileBackend):
    """File storage whose layer-major reads stop at a gate: after the header pass
    (`hold="headers"`) or after reporting layer 0 (`hold="layer0"`), until `gate` is set
    (bounded wait); `hold="both"` stops at both, after layer 0 until `layer0_gate` is set
    (`layer0_held` tells it got there). `events` records ("read", layer) as layers are
    reported."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.hold = ""
        self.gate = threading.Event()
        self.held = threading.Event()
        self.layer0_gate = threading.Event()
        self.layer0_held = threading.Event()
        self.events: list[tuple[str, int]] = []

    def read_layers(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor],
                    stream: LayerStream, origins: list[str | None] | None = None) -> list[bool]:
        return super().read_layers(keys, host_pages, _Gate(stream, self), origins)  # type: ignore[arg-type]


class _Gate:
    """The reporting side of a LayerStream (what the layer-major read calls) seen through the
    backend's gate: each report goes on to `stream`, held at `backend`'s gates."""

    def __init__(self, stream: LayerStream, backend: GatedFileBackend) -> None:
        self.stream = stream
        self.backend = backend
        self.layers_per_read = stream.layers_per_read
        self.cancelled = stream.cancelled

    def _stop(self, gate: threading.Event, held: threading.Event) -> None:
        held.set()
        assert gate.wait(30), "the test never opened the gate"

    def headers_read(self, ok_prefix: int, origins: list[str | None]) -> None:
        if self.backend.hold in ("headers", "both"):
            self._stop(self.backend.gate, self.backend.held)
        self.stream.headers_read(ok_prefix, origins)

    def layer_read(self, layer: int) -> None:
        backend = self.backend
        backend.events.append(("read", layer))
        self.stream.layer_read(layer)
        if layer == 0 and backend.hold == "layer0":
            self._stop(backend.gate, backend.held)
        elif layer == 0 and backend.hold == "both":
            self._stop(backend.layer0_gate, backend.layer0_held)

    def finish(self, ok: Sequence[bool]) -> None:
        self.stream.finish(ok)


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    return reference_tokens(tiny, PROMPT)


@pytest.fixture
def gated_backend() -> Iterator[str]:
    BACKENDS.register(GATED, f"{__name__}:GatedFileBackend")
    try:
        yield GATED
    finally:
        BACKENDS.unregister(GATED)


def _seeded_storage(tiny, tmp_path, backend: str = "file"):
    """Storage holding PROMPT's pages (written through by an engine that computed them), and
    that engine's device K/V of the prompt pages."""
    cfg = storage_config(tiny[0], backend=backend, path=str(tmp_path / "store"))
    seeder = tiered(tiny, cfg)
    try:
        generate(seeder.engine, "seed", PROMPT)
        assert seeder.hicache.wait_idle(20)
        kv = _prompt_kv(seeder)
    finally:
        seeder.close()
    return cfg, kv


def _prompt_kv(built) -> torch.Tensor:
    """Device K/V of PROMPT's full pages, read through the tree (idle engine)."""
    match = built.hicache.tree.match_prefix(PROMPT[: PAGES * PAGE], "")
    assert len(match.page_ids) == PAGES
    return built.hicache.device_kv[:, :, match.page_ids].clone()


def _fresh(tiny, cfg, **hicache: Any):
    """An engine with empty device and host tiers over `cfg`'s storage (device pool zeroed:
    nothing it serves can come from an earlier run)."""
    hicache.setdefault("layerwise_prefetch", True)
    built = tiered(tiny, cfg, host_pages=64, write_policy="write_back",
                   prefetch_policy="wait_complete", **hicache)
    built.hicache.device_kv.zero_()
    return built


@pytest.mark.parametrize("backend", ["file", "hf3fs"])
def test_streamed_storage_hit_is_exact_and_byte_identical(tiny, expected, tmp_path, backend):
    cfg, seeded_kv = _seeded_storage(tiny, tmp_path, backend)
    results = {}
    for layerwise in (True, False):
        built = _fresh(tiny, cfg, layerwise_prefetch=layerwise)
        try:
            tokens, out = generate(built.engine, f"hit-{layerwise}", PROMPT)
            stats = built.hicache.stats
            results[layerwise] = (tokens, out.cached.storage, stats.prefetch_streamed_pages,
                                  _prompt_kv(built))
            check_every_tier(built)
            assert built.hicache.host_pool.num_free == built.hicache.host_pool.capacity
        finally:
            built.close()
    for layerwise, (tokens, storage_tokens, streamed, kv) in results.items():
        assert tokens == expected, layerwise
        assert storage_tokens == PAGES * PAGE
        assert streamed == (PAGES if layerwise else 0)
        assert torch.equal(kv.view(torch.uint8), seeded_kv.view(torch.uint8)), layerwise


def _recording_load(events: list[tuple[str, int]], backend: GatedFileBackend) -> type[LayerLoad]:
    class RecordingLayerLoad(LayerLoad):
        """Logs ("wait", layer, layers read so far) and opens the backend's gate when the
        forward asks for layer 1."""

        def wait(self, layer: int) -> None:
            if self.streamed is not None and layer >= self.layers_loaded:
                events.append(("wait", layer, self.streamed.stream.layers_read))
                if layer == 1:
                    backend.gate.set()
            super().wait(layer)

    return RecordingLayerLoad


def test_layer_zero_computes_before_layer_one_is_read(tiny, expected, tmp_path, gated_backend):
    from tests.offload_manager.test_hicache_engine_policies import attention_recorded

    cfg, _ = _seeded_storage(tiny, tmp_path)
    built = _fresh(tiny, cfg.replace(backend=gated_backend))
    backend = built.storage
    assert isinstance(backend, GatedFileBackend)
    backend.hold = "layer0"
    events: list = backend.events
    built.hicache.layer_load_cls = _recording_load(events, backend)
    try:
        with attention_recorded(tiny[0], events):
            tokens, out = generate(built.engine, "slow", PROMPT)
        assert tokens == expected and out.cached.storage == PAGES * PAGE
        assert backend.held.is_set()
        order = [e[:2] for e in events]
        # layer 0 was read, the forward waited for it and attended with it, then asked for
        # layer 1 while only layer 0 was read; layer 1's read came after that
        assert order.index(("read", 0)) < order.index(("attn", 0)) < order.index(("read", 1))
        assert ("wait", 1, 1) in events
        assert order.index(("wait", 1)) < order.index(("read", 1)) < order.index(("attn", 1))
        check_every_tier(built)
    finally:
        backend.gate.set()
        built.close()


@pytest.mark.parametrize("protected", [True, False])
def test_page_failing_verification_after_use_is_recomputed(tiny, expected, tmp_path, protected,
                                                           gated_backend):
    cfg, _ = _seeded_storage(tiny, tmp_path)
    store = FileBackend(cfg)
    floats = (cfg.page_bytes) // 4
    for key in prompt_keys(cfg, PROMPT)[2:]:  # pages 2.. : a valid header, a wrong payload
        blob = store.read_object(key)
        assert blob is not None
        store.write_object(key, blob[:HEADER_BYTES] + struct.pack(f"<{floats}f", *[30.0] * floats))
    built = tiered(tiny, cfg.replace(backend=gated_backend), host_pages=64,
                   write_policy="write_back", prefetch_policy="wait_complete",
                   layerwise_prefetch=True)
    if not protected:  # the protection off: a load that failed verification is kept
        built.engine.scheduler.requeue_failed_loads = lambda batch: None
    backend = built.storage
    assert isinstance(backend, GatedFileBackend)
    backend.hold = "layer0"  # the forward starts before any page could be verified
    built.hicache.layer_load_cls = _recording_load([], backend)
    try:
        tokens, out = generate(built.engine, "corrupt", PROMPT)
        stats = built.hicache.stats
        assert stats.prefetch_streamed_pages == PAGES  # headers were valid: all 40 admitted
        assert stats.stream_failed_loads == 1
        if protected:
            assert tokens == expected
            assert out.cached.storage == 0  # recomputed: nothing of the failed load counted
            assert built.storage.stats()["rejected_checksum_pages"] == PAGES - 2
        else:
            assert tokens != expected  # the corrupt K/V reached the output
        check_every_tier(built)
        assert built.hicache.host_pool.num_free == built.hicache.host_pool.capacity
    finally:
        backend.gate.set()
        built.close()


def test_abort_during_streamed_read_returns_staging_pages(tiny, tmp_path, gated_backend):
    cfg, _ = _seeded_storage(tiny, tmp_path)
    built = _fresh(tiny, cfg.replace(backend=gated_backend))
    backend = built.storage
    assert isinstance(backend, GatedFileBackend)
    backend.hold = "headers"
    pool = built.hicache.host_pool
    finals: list = []
    done = threading.Event()

    def on_output(out) -> None:
        if out.finished:
            finals.append(out)
            done.set()

    try:
        built.engine.submit(GenerateRequest("gone", PROMPT, PARAMS), on_output)
        assert backend.held.wait(20), "the streamed read never started"
        assert pool.num_in_flight == PAGES  # the staging pages, taken for the read
        built.engine.abort("gone")
        assert done.wait(20) and finals[-1].finish_reason == "abort"
        built.engine.check_accounting()  # a step of the engine thread since the abort (reap)
        assert pool.num_in_flight == PAGES  # the held read still owns them: not freed yet
        backend.gate.set()
        check_every_tier(built)
        assert pool.num_free == pool.capacity
        assert built.hicache.stats.prefetch_abandoned_pages == PAGES
        assert ("read", 1) not in backend.events  # cancelled: the layers after 0 not read
        assert backend.stats().get("pages_read", 0) == 0
    finally:
        backend.gate.set()
        built.close()


def test_streamed_prefetch_offers_headers_then_only_verified_pages() -> None:
    """Before the read ends, admission may take every page whose header is valid (its layers
    are still arriving); once it ended, only the consecutive verified pages."""
    from pdcache.offload_manager.prefetch_ops import PrefetchOp

    stream = LayerStream(6, 4)
    op = PrefetchOp("r", 0, [b"k"] * 6, list(range(6)), [], deadline=0.0, stream=stream)
    assert not op.ready and op.ready_prefix() == (0, [])
    stream.headers_read(5, ["prefill"] * 4 + ["decode"])
    assert op.ready and not op.complete
    assert op.ready_prefix() == (5, ["prefill"] * 4 + ["decode"])
    stream.finish([True, True, False, True, True])
    assert op.complete and op.ready_prefix() == (2, ["prefill"] * 2)


def _corrupt_payloads(cfg, first_page: int) -> None:
    """Pages `first_page..` of PROMPT in storage: a valid header, a payload that fails
    verification."""
    store = FileBackend(cfg)
    floats = cfg.page_bytes // 4
    for key in prompt_keys(cfg, PROMPT)[first_page:]:
        blob = store.read_object(key)
        assert blob is not None
        store.write_object(key, blob[:HEADER_BYTES] + struct.pack(f"<{floats}f", *[30.0] * floats))


def _driven(tiny, storage, **hicache: Any):
    """A tiered engine the test drives with `engine.step()` (no engine thread), its device
    pool zeroed."""
    from pdcache.offload_manager.builder import TierConfig, build_tiered_engine
    from pdcache.offload_manager.hicache import HiCacheConfig
    from tests.hicache_support import engine_config

    model, tokenizer = tiny
    tiers = TierConfig(64, HiCacheConfig(layerwise_prefetch=True, **hicache), storage)
    built = build_tiered_engine(engine_config(model), model, tokenizer, tiers)
    built.engine.start(thread=False)
    built.hicache.device_kv.zero_()
    return built


def _submit(built, rid: str, prompt: list[int]) -> list:
    outputs: list = []
    built.engine.submit(GenerateRequest(rid, prompt, PARAMS), outputs.append)
    return outputs


def test_retracted_request_holding_a_failed_stream_caches_and_writes_nothing(
        tiny, expected, tmp_path, gated_backend):
    """A request retracted (the decode side short of a page retracts the newest request)
    after its admission took streamed pages, before any forward consumed them: finishing its
    load finds pages that fail verification, so none of its pages may enter the device tree
    (where write_through would back them up to host and re-write them to storage with a
    fresh checksum/MAC). It then recomputes: exact tokens."""
    cfg, _ = _seeded_storage(tiny, tmp_path)
    _corrupt_payloads(cfg, first_page=2)
    built = _driven(tiny, cfg.replace(backend=gated_backend), write_policy="write_through",
                    prefetch_policy="wait_complete")
    backend = built.storage
    assert isinstance(backend, GatedFileBackend)
    backend.hold = "both"  # admission happens when the test says, before any verification
    sched, stats = built.engine.scheduler, built.hicache.stats
    try:
        outputs = _submit(built, "retracted", PROMPT)
        assert built.engine.step()  # queued, prefetching; not ready
        assert backend.held.wait(20)
        req = sched.waiting[0]
        backend.gate.set()
        assert backend.layer0_held.wait(20)
        wait_until(lambda: sched.tiers.admission_ready(req))
        assert sched.schedule() is not None  # admitted; its forward has not run
        assert req in sched.running and req.kv_len == PAGES * PAGE and req.kv_load is not None
        backend.layer0_gate.set()
        sched._retract(req)  # what _ensure_decode_page does to the newest running request
        assert req in sched.waiting and stats.stream_failed_loads == 1
        assert built.hicache.tree.match_prefix(PROMPT, "").page_ids == []
        assert built.hicache.wait_idle(20)
        assert (stats.backup_host_pages, stats.backup_storage_pages) == (0, 0)
        assert backend.stats().get("pages_written", 0) == 0
        run_to_end(built)
        assert [t for o in outputs for t in o.new_token_ids] == expected
        assert outputs[-1].cached.storage == 0
        check_every_tier(built)
    finally:
        backend.gate.set()
        backend.layer0_gate.set()
        built.close()


def test_hung_layer_read_times_out_and_the_request_recomputes(tiny, expected, tmp_path,
                                                             gated_backend):
    """The read stops after layer 0 and does not go on for 30 s (the gate's own bound): the
    forward, waiting for layer 1 on the engine thread, gives up at the prefetch's deadline
    (1 s here), the load fails and the request recomputes: exact tokens, in far less than
    the read's hang, and the read is cancelled (layer 1 never read)."""
    cfg, _ = _seeded_storage(tiny, tmp_path)
    built = tiered(tiny, cfg.replace(backend=gated_backend), host_pages=64,
                   write_policy="write_back", prefetch_policy="timeout", layerwise_prefetch=True,
                   prefetch_timeout_base_s=1.0, prefetch_timeout_per_1k_tokens_s=0.0)
    built.hicache.device_kv.zero_()
    backend = built.storage
    assert isinstance(backend, GatedFileBackend)
    backend.hold = "layer0"  # nobody opens the gate while the request runs
    try:
        started = time.monotonic()
        tokens, out = generate(built.engine, "hung", PROMPT)
        elapsed = time.monotonic() - started
        assert backend.held.is_set() and elapsed < 20, elapsed  # unbounded: the gate's 30 s
        assert tokens == expected and out.cached.storage == 0
        stats = built.hicache.stats
        assert (stats.stream_failed_loads, stats.stream_timed_out_loads) == (1, 1)
        backend.gate.set()  # the read ends now: its staging pages come back
        check_every_tier(built)
        assert built.hicache.host_pool.num_free == built.hicache.host_pool.capacity
        assert ("read", 1) not in backend.events
        assert backend.stats().get("pages_read", 0) == 0
    finally:
        backend.gate.set()
        built.close()


def test_stream_none_of_whose_pages_fit_is_cancelled(tiny, tmp_path, gated_backend):
    """The match moved between the prefetch's start and the admission (here the first 10
    pages, on device when the request queued, are dropped) and prefetch restarts are off, so
    no prefetched page continues it: the pages are given back and the still running read is
    cancelled (layer 1 never read, nothing verified). (With restarts on, the prefetch would
    start again at page 0: tests/offload_manager/test_prefetch_restart.py.)"""
    cfg, _ = _seeded_storage(tiny, tmp_path)
    built = _driven(tiny, cfg.replace(backend=gated_backend), write_policy="write_back",
                    prefetch_policy="wait_complete", prefetch_restarts=0)
    backend = built.storage
    assert isinstance(backend, GatedFileBackend)
    sched = built.engine.scheduler
    try:
        first = _submit(built, "first", PROMPT[:41])  # puts pages 0..9 on device
        run_to_end(built)
        assert first[-1].finished and built.hicache.wait_idle(20)
        read_before = backend.stats()["pages_read"]
        streamed_before = built.hicache.stats.prefetch_streamed_pages
        backend.events.clear()
        backend.hold = "both"
        outputs = _submit(built, "moved", PROMPT)
        assert built.engine.step()  # queued: prefetching pages 10..39, held before headers
        assert built.hicache.prefetch_first_page("moved") == 10
        assert backend.held.wait(20)
        sched.tiers.drop()  # pages 0..9 leave device and host
        backend.gate.set()
        assert backend.layer0_held.wait(20)  # headers and layer 0 read, the rest to come
        wait_until(lambda: built.hicache.prefetch_ready("moved"))
        assert built.engine.step()  # admitted: the match is now 0 pages, before the prefetch
        # taken (headers valid), then given back
        assert built.hicache.stats.prefetch_streamed_pages - streamed_before == 30
        backend.layer0_gate.set()
        run_to_end(built)
        assert outputs[-1].finished and outputs[-1].cached.storage == 0
        check_every_tier(built)
        assert ("read", 0) in backend.events and ("read", 1) not in backend.events
        assert backend.stats()["pages_read"] == read_before  # nothing of it verified
        assert built.hicache.host_pool.num_free == built.hicache.host_pool.capacity
    finally:
        backend.gate.set()
        backend.layer0_gate.set()
        built.close()
