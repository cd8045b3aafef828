from __future__ import annotations

import threading

import torch

from pdcache.offload_manager.io_worker import IoKind, IoResult, IoTask, IoWorker
from tests.storage_doubles import DictBackend


def run_task(worker: IoWorker, kind: IoKind, keys, pages) -> IoResult:
    done = threading.Event()
    box: list[IoResult] = []

    def on_done(result: IoResult) -> None:
        box.append(result)
        done.set()

    assert worker.submit(IoTask(kind, keys, pages, on_done))
    assert done.wait(10)
    return box[0]


def test_write_then_read_round_trip() -> None:
    backend = DictBackend()
    worker = IoWorker(backend, "t").start()
    src = [torch.randint(0, 256, (64,), dtype=torch.uint8) for _ in range(3)]
    keys = [bytes([i]) * 32 for i in range(3)]
    assert run_task(worker, IoKind.WRITE, keys, src).ok == [True] * 3
    dst = [torch.zeros(64, dtype=torch.uint8) for _ in range(4)]
    result = run_task(worker, IoKind.READ, keys + [b"x" * 32], dst)
    assert result.ok == [True, True, True, False]
    assert result.origins[:3] == ["prefill"] * 3 and result.origins[3] is None
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    assert (worker.stats.pages_written, worker.stats.pages_read, worker.stats.pages_failed) == (3, 3, 1)
    worker.close()


def test_backend_exception_is_counted_and_worker_survives() -> None:
    backend = DictBackend()
    worker = IoWorker(backend, "t").start()
    page = [torch.ones(8, dtype=torch.uint8)]
    backend.down = True
    failed = run_task(worker, IoKind.WRITE, [b"k" * 32], page)
    assert failed.ok == [False] and "storage down" in (failed.error or "")
    assert worker.stats.tasks_failed == 1
    backend.down = False  # storage returns: the same worker serves again
    assert run_task(worker, IoKind.WRITE, [b"k" * 32], page).ok == [True]
    assert worker.stats.tasks_done == 1
    worker.close()


def test_full_queue_rejects_without_blocking_and_callback_errors_survive() -> None:
    backend = DictBackend()
    backend.gate.clear()  # hold the worker inside the first task
    worker = IoWorker(backend, "t", max_queued=2).start()

    def explode(_: IoResult) -> None:
        raise RuntimeError("bad callback")

    page = [torch.zeros(4, dtype=torch.uint8)]
    accepted = [worker.submit(IoTask(IoKind.WRITE, [bytes([i]) * 32], page, explode)) for i in range(6)]
    # one task is being run (blocked), two wait in the queue, the rest are rejected at once
    assert accepted.count(True) in (2, 3) and worker.stats.tasks_rejected == accepted.count(False)
    backend.gate.set()
    worker.close()
    assert worker.stats.callback_errors == accepted.count(True)
    assert worker.stats.pages_written == accepted.count(True)


def test_no_thread_before_start_and_queued_tasks_run_after() -> None:
    """The worker's thread is started by `start()` (its owner's), not by the constructor: a
    task submitted before waits in the queue and runs once the worker starts."""
    before = {t.name for t in threading.enumerate()}
    worker = IoWorker(DictBackend(), "lazy")
    assert "pdcache-io-lazy" not in {t.name for t in threading.enumerate()} - before
    done = threading.Event()
    page = [torch.zeros(4, dtype=torch.uint8)]
    assert worker.submit(IoTask(IoKind.WRITE, [b"k" * 32], page, lambda _: done.set()))
    assert not done.wait(0.2)  # nothing runs it yet
    worker.start()
    assert done.wait(10)
    worker.close()
    assert worker.stats.pages_written == 1
    IoWorker(DictBackend(), "never").close()  # never started: close returns at once
