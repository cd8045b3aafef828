"""Each data engine, used directly: batched writes land byte-exact, bad writes fail loudly."""

from __future__ import annotations

import os
import time
import weakref

import numpy as np
import pytest
import torch

from pdcache.transfer.engines.base import ENGINES, EngineError, create_engine
from pdcache.transfer.layout import KVLayout, WriteBatch, page_copy_batch
from pdcache.utils.registry import MissingDependencyError, Registry
from tests.transfer_support import engine_params, fast_config, make_pool


@pytest.fixture
def engine_pair(request):
    config = fast_config(request.param, max_batch_entries=64)
    initiator, target = create_engine(config), create_engine(config)
    try:
        yield initiator, target
    finally:
        initiator.close()
        target.close()


@pytest.mark.parametrize("engine_pair", engine_params(), indirect=True)
def test_batched_write_is_byte_identical_for_random_pages(engine_pair) -> None:
    initiator, target = engine_pair
    src, dst = make_pool(64, seed=1), make_pool(96, seed=None)
    target.register_target(dst.data_ptr(), dst.numel() * dst.element_size())
    initiator.register_source(src.data_ptr(), src.numel() * src.element_size())
    peer = initiator.add_peer(target.session())
    rng = np.random.default_rng(7)
    src_pages = rng.choice(64, 40, replace=False)
    dst_pages = rng.choice(96, 40, replace=False)
    batch = page_copy_batch(KVLayout.from_tensor(src), KVLayout.from_tensor(dst), src_pages,
                            dst_pages)
    tickets = [initiator.submit(peer, part) for part in batch.split(64, 1 << 20)]
    assert len(tickets) == 5  # 4 layers × K/V × 40 pages = 320 entries in batches of 64
    for ticket in tickets:
        initiator.wait(ticket, 10.0)
    assert torch.equal(dst[:, :, dst_pages], src[:, :, src_pages])
    untouched = np.setdiff1d(np.arange(96), dst_pages)
    assert not dst[:, :, untouched].any()


@pytest.mark.parametrize("engine_pair", engine_params(("zmq", "mooncake")), indirect=True)
def test_write_outside_registered_memory_fails_and_engine_keeps_working(engine_pair) -> None:
    initiator, target = engine_pair
    src, dst = make_pool(8, seed=2), make_pool(8, seed=None)
    target.register_target(dst.data_ptr(), dst.numel() * dst.element_size())
    initiator.register_source(src.data_ptr(), src.numel() * src.element_size())
    peer = initiator.add_peer(target.session())
    outside = dst.data_ptr() + dst.numel() * dst.element_size() + (1 << 20)
    bad = WriteBatch(np.array([src.data_ptr()]), np.array([outside]), np.array([512]))
    with pytest.raises(EngineError):
        initiator.write(peer, bad, 10.0)
    good = WriteBatch(np.array([src.data_ptr()]), np.array([dst.data_ptr()]), np.array([512]))
    initiator.write(peer, good, 10.0)
    assert torch.equal(dst.view(-1)[:128], src.view(-1)[:128])


def test_registry_names_engines_and_reports_missing_packages() -> None:
    assert ENGINES.names() == ["mooncake", "nixl", "zmq"]
    with pytest.raises(KeyError, match="choose one of"):
        ENGINES.get("carrier-pigeon")
    # An engine whose module cannot import is reported with the package to install (in a
    # registry of its own: the shared one stays clean).
    ghosts: Registry[object] = Registry("transfer engine")
    ghosts.register("ghost", "pdcache.transfer.engines.no_such_module:Ghost", package="ghost-pkg")
    with pytest.raises(MissingDependencyError, match="pip install ghost-pkg"):
        ghosts.get("ghost")


def test_mooncake_rate_estimate_sleeps_only_once_measured_and_never_past_the_batch() -> None:
    from pdcache.transfer.engines.mooncake_engine import _RateEstimate

    rate = _RateEstimate()
    big = 8 << 20
    assert rate.sleep_s(big, 0.0, 0.0) == 0.0  # nothing measured: spin at once
    rate.observe(4096, 0.0, 1.0)  # a small batch measures the round trip, not the rate
    assert rate.sleep_s(big, 1.0, 1.0) == 0.0
    rate.observe(big, 10.0, 10.1)  # 80 MiB/s
    assert rate.sleep_s(big, 20.0, 20.0) == pytest.approx(0.8 * 0.1)
    assert rate.sleep_s(big, 20.0, 20.05) == pytest.approx(0.03)  # time on the link counts
    assert rate.sleep_s(big, 20.0, 21.0) == 0.0
    assert rate.sleep_s(4096, 20.0, 20.0) == 0.0  # small batches are always spun for
    # a batch queued behind another is timed from when the link was free for it
    rate.observe(big, 30.0, 30.1)
    rate.observe(big, 30.0, 30.2)  # submitted with the first, done 0.1 s after it: 80 MiB/s
    assert rate.sleep_s(big, 40.0, 40.0) == pytest.approx(0.8 * 0.1)
    rate.observe(big, 50.0, 50.4)  # slower (a stall): only a fifth of the way
    expected_rate = big / 0.1 + 0.2 * (big / 0.4 - big / 0.1)
    assert rate.sleep_s(big, 60.0, 60.0) == pytest.approx(0.8 * big / expected_rate)
    rate.observe(big, 70.0, 70.05)  # faster: believed at once
    assert rate.sleep_s(big, 80.0, 80.0) == pytest.approx(0.8 * 0.05)


@pytest.mark.parametrize("engine_pair", engine_params(("mooncake",)), indirect=True)
def test_mooncake_waits_that_sleep_first_still_return_complete_pages(engine_pair) -> None:
    """Once the engine has measured a rate, `wait` sleeps before it spins: every batch must
    still be whole when it returns (the sleep is a share of the expected time, the rest is
    Mooncake's own blocking wait)."""
    initiator, target = engine_pair
    pages = 1024  # 512 KiB a page pool of 4 layers: batches of 512 KiB+ teach the rate
    src, dst = make_pool(pages, seed=3), make_pool(pages, seed=None)
    target.register_target(dst.data_ptr(), dst.numel() * dst.element_size())
    initiator.register_source(src.data_ptr(), src.numel() * src.element_size())
    peer = initiator.add_peer(target.session())
    layout_src, layout_dst = KVLayout.from_tensor(src), KVLayout.from_tensor(dst)
    for round_ in range(4):
        ids = np.arange(round_ * 256, (round_ + 1) * 256)
        batch = page_copy_batch(layout_src, layout_dst, ids, ids)
        assert batch.nbytes >= 256 << 10
        initiator.wait(initiator.submit(peer, batch), 10.0)
        assert torch.equal(dst[:, :, ids], src[:, :, ids])
    assert initiator._rate_of(peer).sleep_s(batch.nbytes, 0.0, 0.0) > 0.0  # it learned a rate


def _one_page_written(initiator, target) -> tuple[str, WriteBatch, tuple[torch.Tensor, ...]]:
    """One 512-byte write from `initiator` into `target`, done: (its peer, that batch, the two
    registered pools), the state the close tests start from. The caller holds the pools until
    the engines are closed: their memory is registered with them."""
    src, dst = make_pool(4, seed=3), make_pool(4, seed=None)
    target.register_target(dst.data_ptr(), dst.numel() * dst.element_size())
    initiator.register_source(src.data_ptr(), src.numel() * src.element_size())
    peer = initiator.add_peer(target.session())
    good = WriteBatch(np.array([src.data_ptr()]), np.array([dst.data_ptr()]), np.array([512]))
    initiator.write(peer, good, 10.0)
    return peer, good, (src, dst)


def _process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


@pytest.mark.parametrize("engine_pair", engine_params(("nixl",)), indirect=True)
def test_a_closed_nixl_engine_stops_its_progress_thread_while_still_referenced(engine_pair) -> None:
    """NIXL's UCX progress thread polls with no delay; an agent kept alive past close() (a test
    framework holding the fixture, a node object not yet collected) spun a core each until the
    process exited, and two of them starved the 2-core CI machine into transfer timeouts.
    close() drops the agent, so the process stops using CPU while the engine objects are still
    referenced (the fixture holds both, and closes them again at teardown: idempotent) — and
    while NIXL's own agent objects are (a failed test's traceback keeps the frames that used
    them: ten such agents spun a CI run's 2 cores into a cascade of timeouts)."""
    initiator, target = engine_pair
    peer, good, _pools = _one_page_written(initiator, target)
    kept = [initiator._agent, target._agent]  # what a kept traceback's frames hold
    initiator.close()
    target.close()
    assert all(wrapper is not None for wrapper in kept)
    cpu_before, wall_before = _process_cpu_s(), time.monotonic()
    time.sleep(0.5)
    # Idle, the process uses almost none of the wall time; one spinning thread uses all of it.
    assert _process_cpu_s() - cpu_before < 0.25 * (time.monotonic() - wall_before)
    with pytest.raises(EngineError, match="closed"):
        initiator.write(peer, good, 1.0)


@pytest.mark.parametrize("engine_pair", engine_params(("mooncake",)), indirect=True)
def test_a_closed_mooncake_engine_is_destroyed_by_close_not_by_a_later_collection(
        engine_pair) -> None:
    """Mooncake's TransferEngine destructor holds the GIL about a second. Left to the garbage
    collector it ran inside whatever later code triggered a collection: in the suite, a later
    test's every control thread stalled past its heartbeat deadline at once. close() destroys
    it while the engine objects are still referenced (the fixture holds both)."""
    initiator, target = engine_pair
    peer, good, _pools = _one_page_written(initiator, target)
    mooncake_objects = [weakref.ref(side._engine) for side in (initiator, target)]
    initiator.close()
    target.close()
    assert [ref() is None for ref in mooncake_objects] == [True, True]
    with pytest.raises(EngineError, match="closed"):
        initiator.write(peer, good, 1.0)
    # a worker that outlived close() cancels its unfinished batch: quietly, nothing to reap
    from pdcache.transfer.engines.mooncake_engine import _Ticket

    initiator.cancel(_Ticket(peer, [1], 512))
