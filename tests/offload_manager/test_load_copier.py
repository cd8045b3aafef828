"""`LoadCopier`: layer-major order across loads, failures handed to the waiter, close."""

from __future__ import annotations

import threading
import time

import pytest

from pdcache.offload_manager.load_copier import CopyJob, LoadCopier


def _recording(log: list[tuple[str, int]], name: str, fail_at: int | None = None):
    def copy_layer(layer: int) -> None:
        if layer == fail_at:
            raise OSError(f"{name} layer {layer}")
        log.append((name, layer))

    return copy_layer


def _gate(release: threading.Event) -> CopyJob:
    """A one-layer job that holds the copier until `release`, so the next jobs queue up."""
    return CopyJob(lambda _layer: None if release.wait(10) else pytest.fail("gate"), 1)


@pytest.fixture
def copier():
    copier = LoadCopier().start()
    yield copier
    copier.close()


def test_queued_loads_are_copied_layer_major(copier: LoadCopier) -> None:
    log: list[tuple[str, int]] = []
    release = threading.Event()
    assert copier.submit(_gate(release))
    a, b = CopyJob(_recording(log, "a"), 3), CopyJob(_recording(log, "b"), 3)
    assert copier.submit(a) and copier.submit(b)
    release.set()
    for job in (a, b):
        assert all(event.wait(10) for event in job.ready)
    # the forward consumes layer 0 of every load before layer 1 of any
    assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert a.error is None and b.error is None


def test_a_failed_copy_wakes_its_waiters_and_the_copier_goes_on(copier: LoadCopier) -> None:
    log: list[tuple[str, int]] = []
    bad, good = CopyJob(_recording(log, "bad", fail_at=1), 3), CopyJob(_recording(log, "ok"), 2)
    assert copier.submit(bad) and copier.submit(good)
    assert all(event.wait(10) for event in bad.ready)  # every layer's waiter wakes
    assert isinstance(bad.error, OSError)
    assert all(event.wait(10) for event in good.ready) and good.error is None
    assert ("ok", 0) in log and ("ok", 1) in log and ("bad", 2) not in log


def _wait_stopping(copier: LoadCopier) -> None:
    deadline = time.monotonic() + 10.0
    while copier.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not copier.running, "close() did not start"


def test_close_fails_queued_jobs_and_refuses_new_ones() -> None:
    copier = LoadCopier().start()
    release = threading.Event()
    assert copier.submit(_gate(release))
    queued = CopyJob(lambda _layer: None, 2)
    assert copier.submit(queued)
    closer = threading.Thread(target=copier.close)
    closer.start()
    _wait_stopping(copier)  # the copier is told to stop while the gate's copy runs
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert all(event.is_set() for event in queued.ready)
    assert isinstance(queued.error, RuntimeError) and "closed" in str(queued.error)
    assert not copier.submit(CopyJob(lambda _layer: None, 1))
    assert not copier.running


def test_a_copier_that_was_never_started_takes_nothing() -> None:
    # LayerLoad then copies on the engine thread (HiCache before start())
    assert not LoadCopier().submit(CopyJob(lambda _layer: None, 1))


def test_a_finished_load_is_freed_by_reference_counting_alone(copier: LoadCopier) -> None:
    """A LayerLoad and its CopyJob reference each other while the copy runs; once done, no
    cycle may keep the load (and the pools it holds) alive until a garbage collection: the
    copy-ahead bench grew to 24 GB of fresh engines' pools before the cycle was broken."""
    import gc
    import weakref

    import torch

    from pdcache.engine.kv_geometry import KVGeometry
    from pdcache.offload_manager.host_pool import HostKVPool
    from pdcache.offload_manager.layer_loads import LayerLoad

    pool = HostKVPool(4, KVGeometry.mha(3, 1, 4, "float32"), page_size=2)
    host_ids = pool.alloc(2)
    assert host_ids is not None
    pool.commit(host_ids)
    pool.host_kv[host_ids] = torch.arange(2.0).view(2, 1, 1, 1, 1, 1) + 1
    device_kv = torch.zeros(3, 2, 5, 2, 1, 4)
    gc.disable()
    try:
        load = LayerLoad(pool, device_kv, host_ids, [3, 1], copier=copier)
        load.wait(2)
        assert load.done and not pool.any_pinned
        assert torch.equal(device_kv[:, :, 3], torch.ones(3, 2, 2, 1, 4))
        assert torch.equal(device_kv[:, :, 1], torch.full((3, 2, 2, 1, 4), 2.0))
        ref = weakref.ref(load)
        del load
        # the copier thread's frame may hold the job a moment after the last event: bounded
        deadline = time.monotonic() + 5.0
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ref() is None, "a reference cycle keeps the finished load alive"
    finally:
        gc.enable()


def test_close_never_reports_a_layer_whose_copy_is_still_running() -> None:
    """A waiter woken for a layer frees its pages: close() must not wake it mid-copy."""
    copier = LoadCopier().start()
    entered, release, log = threading.Event(), threading.Event(), []

    def copy_layer(layer: int) -> None:
        if layer == 0:
            entered.set()
            assert release.wait(10)
        log.append(("copied", layer))

    job = CopyJob(copy_layer, 3)
    assert copier.submit(job)
    assert entered.wait(10)  # layer 0's copy is running
    closer = threading.Thread(target=copier.close)
    closer.start()
    _wait_stopping(copier)
    assert not job.ready[0].is_set(), "layer 0 reported while its copy runs"
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert log == [("copied", 0)]  # the layer in flight ended; the rest were not started
    assert all(event.is_set() for event in job.ready)
    assert isinstance(job.error, RuntimeError) and "closed" in str(job.error)


def _layer_load(copier: LoadCopier, copy_layer, copy_timeout_s: float | None = None):
    import torch

    from pdcache.engine.kv_geometry import KVGeometry
    from pdcache.offload_manager.host_pool import HostKVPool
    from pdcache.offload_manager.layer_loads import COPY_WAIT_S, LayerLoad

    class Load(LayerLoad):
        def copy_layer(self, layer: int) -> None:
            copy_layer(layer)
            super().copy_layer(layer)

    pool = HostKVPool(4, KVGeometry.mha(3, 1, 4, "float32"), page_size=2)
    host_ids = pool.alloc(2)
    assert host_ids is not None
    pool.commit(host_ids)
    return pool, Load(pool, torch.zeros(3, 2, 5, 2, 1, 4), host_ids, [3, 1], copier=copier,
                      copy_timeout_s=copy_timeout_s or COPY_WAIT_S)


def test_a_copy_that_raises_fails_the_load_and_releases_it(copier: LoadCopier) -> None:
    def copy_layer(layer: int) -> None:
        if layer == 1:
            raise OSError("bad page")

    pool, load = _layer_load(copier, copy_layer)
    load.wait(2)  # the load fails, not the forward (the scheduler requeues its readers)
    # failed: the scheduler recomputes the request and caches none of its pages
    assert load.done and load.failed and not pool.any_pinned
    assert isinstance(load.copy_error, OSError) and str(load.copy_error) == "bad page"
    load.finish()  # the runner's finish() after the forward: nothing left to do


def test_a_copy_past_its_bound_keeps_the_pages_and_wedges_the_copier() -> None:
    copier, stuck = LoadCopier().start(), threading.Event()
    try:
        pool, load = _layer_load(copier, lambda layer: stuck.wait(10) if layer == 0 else None,
                                 copy_timeout_s=0.2)
        with pytest.raises(RuntimeError, match="did not end in"):
            load.wait(0)
        with pytest.raises(RuntimeError, match="timed out earlier"):  # no second 0.2 s wait
            load.finish()
        assert not load.done and pool.any_pinned  # the copy may still write: nothing freed
        assert not copier.submit(CopyJob(lambda _layer: None, 1))  # later loads copy inline
    finally:
        stuck.set()
        copier.close()
