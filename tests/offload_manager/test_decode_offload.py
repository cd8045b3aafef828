from __future__ import annotations

import threading

import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from tests.storage_doubles import DictBackend

LAYERS, PAGES, PAGE, HEADS, DIM = 2, 32, 4, 2, 8
FP = "test-fingerprint"


def device_kv() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, 2, PAGES, PAGE, HEADS, DIM, generator=gen)


def page_payload(kv: torch.Tensor, page: int) -> bytes:
    return kv[:, :, page].contiguous().numpy().tobytes()  # [L, 2, S, H, D]: page-first order


def released_event() -> tuple[threading.Event, callable]:
    event = threading.Event()
    return event, event.set


def test_answer_pages_continue_the_prompt_chain_byte_exact() -> None:
    kv, storage = device_kv(), DictBackend()
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=16, stride_pages=1).start()
    tokens = list(range(100, 100 + 4 * PAGE + 2))  # 4 full pages + a partial one
    pages = [7, 3, 11, 5, 9]
    mgr.track("r", cache_salt="tenant")
    for n in range(1, len(tokens) + 1):  # decode grows the KV one token at a time
        mgr.on_step("r", tokens[:n], pages[: (n + PAGE - 1) // PAGE])
    done, release = released_event()
    mgr.finish("r", tokens, pages, release)
    assert done.wait(10) and mgr.wait_idle(10)
    keys = chain_page_keys(tokens, PAGE, make_salt(FP, "tenant"))
    assert len(keys) == 4
    for key, page in zip(keys, pages):
        assert storage.pages[key] == page_payload(kv, page)
        assert storage.origin[key] == "decode"
    assert mgr.stats.pages_offloaded == 4 and mgr.stats.pages_dropped == 0
    mgr.check()
    mgr.close()


def test_pages_already_stored_are_skipped() -> None:
    kv, storage = device_kv(), DictBackend()
    tokens = list(range(3 * PAGE))
    keys = chain_page_keys(tokens, PAGE, make_salt(FP))
    storage.pages[keys[0]] = b"prefill-wrote-this"
    storage.origin[keys[0]] = "prefill"
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=8).start()
    mgr.track("r")
    done, release = released_event()
    mgr.finish("r", tokens, [0, 1, 2], release)
    assert done.wait(10) and mgr.wait_idle(10)
    assert storage.pages[keys[0]] == b"prefill-wrote-this"  # untouched
    assert storage.origin[keys[1]] == storage.origin[keys[2]] == "decode"
    assert (mgr.stats.pages_skipped, mgr.stats.pages_offloaded) == (1, 2)
    mgr.close()


def test_full_staging_drops_and_counts_without_leaking() -> None:
    kv, storage = device_kv(), DictBackend()
    storage.gate.clear()  # storage stalls: staging pages stay in use
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=2, stride_pages=1).start()
    mgr.track("r")
    tokens = list(range(6 * PAGE))
    for n in range(PAGE, len(tokens) + 1, PAGE):
        mgr.on_step("r", tokens[:n], list(range(n // PAGE)))
    done, release = released_event()
    mgr.finish("r", tokens, list(range(6)), release)
    assert done.wait(10)  # device pages are released although storage is stuck
    storage.gate.set()
    assert mgr.wait_idle(10)
    stats = mgr.stats
    assert stats.pages_dropped >= 1
    assert stats.pages_offloaded + stats.pages_dropped == 6
    mgr.check()  # every staging page returned
    mgr.close()


def test_storage_down_counts_failures_and_recovers() -> None:
    kv, storage = device_kv(), DictBackend()
    storage.down = True
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=8).start()
    tokens = list(range(2 * PAGE))
    mgr.track("a")
    done, release = released_event()
    mgr.finish("a", tokens, [0, 1], release)
    assert done.wait(10) and mgr.wait_idle(10)
    assert mgr.stats.pages_failed == 2 and not storage.pages
    storage.down = False
    mgr.track("b")
    done, release = released_event()
    mgr.finish("b", tokens, [0, 1], release)
    assert done.wait(10) and mgr.wait_idle(10)
    assert mgr.stats.pages_offloaded == 2 and len(storage.pages) == 2
    mgr.check()
    mgr.close()


def test_abort_and_untracked_release() -> None:
    kv, storage = device_kv(), DictBackend()
    mgr = DecodeOffloadManager(kv, storage, FP, staging_pages=8).start()
    done, release = released_event()
    mgr.finish("never-tracked", [1, 2, 3], [0], release)
    assert done.is_set()
    mgr.track("r")
    mgr.on_step("r", list(range(PAGE)), [4])
    done, release = released_event()
    mgr.abort("r", release)
    assert done.wait(10) and mgr.wait_idle(10)
    mgr.check()
    mgr.close()
