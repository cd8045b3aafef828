"""Conversation-scoped storage lifecycle (`[storage] eviction = "session"`, storage.lifecycle):
the order itself (fake clock), then every backend that owns its eviction (file, hf3fs with
the in-process index, hf3fs with `pdcache metadata-server`) on a cyclic multi-session
pattern that overflows the store: LRU keeps nothing of it, the session policy keeps the
protected sessions' pages; closed sessions' pages go first; accounting exact."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.lifecycle import (
    LifecycleConfig,
    SessionLifecycle,
    StorageEviction,
)
from pdcache.offload_manager.storage.metadata import SlotIndex
from pdcache.offload_manager.storage.metadata_service import LocalMetadataService

PAGE_BYTES = 4096 - 128  # header (128 B) + payload: exactly one 4 KiB slot
FINGERPRINT = "model=test;dtype=uint8;page=4"
CAPACITY = 12
SESSIONS, PAGES_PER_SESSION, ROUNDS = 4, 4, 4  # 16 pages cycled through 12 slots


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lifecycle(
    protect: int, cap: int = 0, idle_s: float = 10.0
) -> tuple[SessionLifecycle, FakeClock]:
    clock = FakeClock()
    return SessionLifecycle(LifecycleConfig(protect, cap, idle_s), clock), clock


def _drain(lc: SessionLifecycle) -> list[bytes]:
    order = []
    while (key := lc.evict()) is not None:
        order.append(key)
    return order


# ---- the order ------------------------------------------------------------------------------


def test_closed_first_then_unprotected_then_protected_each_lru() -> None:
    lc, clock = _lifecycle(protect=3)
    lc.stored(b"a1", "a")
    lc.stored(b"a2", "a")
    lc.stored(b"n1")  # no session
    lc.stored(b"b1", "b")
    lc.stored(b"b2", "b")  # over the bound (3 protected): unprotected
    lc.touched(b"n1")  # LRU refresh within its group
    lc.end_session("a")
    lc.check()
    stats = lc.stats()
    assert (stats["closed_pages"], stats["unprotected_pages"], stats["protected_pages"]) == (
        2,
        2,
        1,
    )
    assert _drain(lc) == [b"a1", b"a2", b"b2", b"n1", b"b1"]
    assert lc.evicted == {"protected": 1, "unprotected": 2, "closed": 2}
    assert len(lc) == 0
    lc.check()


def test_per_session_cap_and_release_on_close() -> None:
    lc, clock = _lifecycle(protect=4, cap=2)
    for i in range(3):
        lc.stored(b"a%d" % i, "a")
    assert lc.stats()["protected_pages"] == 2  # a's third page is over its own cap
    lc.end_session("a")
    lc.stored(b"b0", "b")
    lc.stored(b"b1", "b")
    assert lc.stats()["protected_pages"] == 2  # a's closure gave its protection back
    lc.check()


def test_idle_sessions_close_after_idle_s_without_a_write() -> None:
    lc, clock = _lifecycle(protect=8, idle_s=10.0)
    lc.stored(b"a0", "a")
    clock.now = 5.0
    lc.stored(b"b0", "b")
    lc.touched(b"a0")  # a read is no activity: only writes keep a session open
    clock.now = 12.0  # a idle for 12 s, b for 7 s
    assert lc.victim() == b"a0"
    stats = lc.stats()
    assert (stats["closed_pages"], stats["active_sessions"], stats["closed_sessions"]) == (1, 1, 1)
    lc.touched(b"a0")  # another conversation still reads a's page: plain LRU now
    assert lc.stats()["unprotected_pages"] == 1 and lc.victim() == b"a0"
    lc.check()


def test_a_page_found_present_joins_the_writing_session() -> None:
    lc, _ = _lifecycle(protect=2)
    lc.stored(b"shared")  # written without a session
    lc.stored(b"shared", "a")  # re-put (present) for a: protected now
    assert lc.stats()["protected_pages"] == 1
    lc.removed(b"shared")
    assert len(lc) == 0 and lc.stats()["protected_pages"] == 0
    lc.check()


def test_storage_eviction_builds_bounds_from_capacity() -> None:
    assert StorageEviction().build(100, 4096) is None  # lru: the backends' own order
    lc = StorageEviction("session", 0.25, 3 * 4096 + 1, 60.0).build(100, 4096)
    assert lc is not None
    assert (lc.config.protect_pages, lc.config.session_cap_pages) == (25, 3)
    with pytest.raises(ValueError, match="eviction"):
        StorageEviction("fifo")
    assert StorageEviction("session").server_argv()[:2] == ["--eviction", "session"]


def test_slot_index_evicts_by_lifecycle_with_exact_accounting() -> None:
    clock = FakeClock()
    lc = SessionLifecycle(LifecycleConfig(2, 0, 10.0), clock)
    index = SlotIndex(3, lifecycle=lc)
    for key, sid in ((b"a0", "a"), (b"b0", "b"), (b"n0", "")):
        [(status, slot)] = index.reserve([key], sid)
        assert index.commit([key], [slot], sid) == [True]
    index.lookup([b"a0", b"b0", b"n0"])
    index.end_session("b")
    [(status, slot)] = index.reserve([b"x"], "x")  # full: b's closed page goes, not a0 (LRU)
    assert status == "new" and index.commit([b"x"], [slot], "x") == [True]
    assert index.exists_prefix([b"b0"]) == 0 and index.exists_prefix([b"a0"]) == 1
    stats = index.stats()
    assert stats["free_pages"] + stats["used_pages"] + stats["reserved_pages"] == 3
    groups = sum(stats[f"lifecycle_{g}_pages"] for g in ("protected", "unprotected", "closed"))
    assert groups == stats["used_pages"] == 3
    lc.check()


# ---- backends -------------------------------------------------------------------------------

KINDS = ["file", "hf3fs", "hf3fs_service", "mooncake"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _keys(session: int, n: int) -> list[bytes]:
    tokens = list(range(10_000 * (session + 1), 10_000 * (session + 1) + 4 * n))
    return chain_page_keys(tokens, 4, make_salt(FINGERPRINT, ""))


@pytest.fixture
def open_backend(kind: str, tmp_path, request: pytest.FixtureRequest) -> Iterator:
    """open(eviction) -> a backend of `kind` with CAPACITY pages and that eviction (a
    metadata service of its own for hf3fs_service, since the service owns the policy)."""
    opened: list[StorageBackend] = []
    services: list[LocalMetadataService] = []

    def open_(eviction: str) -> StorageBackend:
        rule = StorageEviction(eviction, protect_share=0.75, protect_bytes=4 * 4096)
        base = StorageConfig(
            backend={"file": "file", "mooncake": "mooncake"}.get(kind, "hf3fs"),
            path=str(tmp_path / eviction),
            page_bytes=PAGE_BYTES,
            capacity_pages=CAPACITY,
            fingerprint=FINGERPRINT,
            namespace=f"t{uuid.uuid4().hex[:8]}",
            num_layers=2,
            page_size=4,
            num_data_files=1,
            eviction=eviction,
            session_protect_share=0.75,
            session_protect_bytes=4 * 4096,
            timeout_s=5.0,
        )
        if kind == "hf3fs_service":
            service = LocalMetadataService(tmp_path / f"meta-{eviction}", eviction=rule).start()
            services.append(service)
            base = base.replace(metadata=service.address)
        if kind == "mooncake":  # this client evicts its own view; the master is the backstop
            base = base.replace(
                mooncake_master=request.getfixturevalue("mooncake_master"),
                mooncake_segment_bytes=16 << 20,
                mooncake_local_buffer_bytes=16 << 20,
            )
        backend = create_backend(base)
        opened.append(backend)
        return backend

    try:
        yield open_
    finally:
        for backend in opened:
            backend.close()
        for service in services:
            service.stop()


def _cyclic_hits(backend: StorageBackend) -> list[int]:
    """Round robin over SESSIONS conversations: each turn reads its session's pages (hits)
    then writes them back for its session, page by page (the misses are stored anew; a batch
    would reserve every slot before committing any). Hits per session."""
    pages = torch.randint(
        0,
        256,
        (PAGES_PER_SESSION, PAGE_BYTES),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(0),
    )
    out = torch.zeros_like(pages)
    hits = [0] * SESSIONS
    for _ in range(ROUNDS):
        for s in range(SESSIONS):
            keys = _keys(s, PAGES_PER_SESSION)
            found = backend.get_into(keys, list(out))
            hits[s] += sum(found)
            for i, ok in enumerate(found):
                if ok:
                    assert torch.equal(out[i], pages[i])
            for key, page in zip(keys, pages):  # page by page, as a turn completes them
                assert backend.put_from([key], [page], session=f"s{s}") == [True]
    return hits


def _accounting(backend: StorageBackend) -> dict[str, int | float]:
    stats = backend.stats()
    assert stats["used_pages"] == CAPACITY
    assert stats["free_pages"] + stats["used_pages"] + stats["reserved_pages"] == CAPACITY
    return stats


def test_session_policy_keeps_active_sessions_where_lru_keeps_nothing(open_backend) -> None:
    lru = open_backend("lru")
    assert _cyclic_hits(lru) == [0, 0, 0, 0]  # cyclic reuse larger than the store: LRU's worst
    _accounting(lru)

    session = open_backend("session")
    hits = _cyclic_hits(session)
    # 9 protected slots (0.75 x 12), at most 4 per session: s0 and s1 keep all 4 pages, s2
    # keeps 1; the 3 unprotected slots cycle LRU and never serve a returning session.
    later_rounds = ROUNDS - 1
    assert hits == [4 * later_rounds, 4 * later_rounds, 1 * later_rounds, 0]
    stats = _accounting(session)
    assert (stats["lifecycle_protected_pages"], stats["lifecycle_unprotected_pages"]) == (9, 3)
    assert stats["lifecycle_closed_pages"] == 0


def test_a_closed_sessions_pages_go_first(open_backend) -> None:
    backend = open_backend("session")
    _cyclic_hits(backend)
    backend.end_session("s0")  # the most protected session ends
    stats = backend.stats()
    assert (stats["lifecycle_closed_pages"], stats["lifecycle_protected_pages"]) == (4, 5)
    newcomer = _keys(9, 4)
    pages = torch.zeros((4, PAGE_BYTES), dtype=torch.uint8)
    for key, page in zip(newcomer, pages):
        assert backend.put_from([key], [page], session="s9") == [True]
    # s0's four pages were evicted, every other session's page is still there
    assert backend.exists_prefix(_keys(0, 4)) == 0
    assert backend.exists_prefix(_keys(1, 4)) == 4
    assert backend.exists_prefix(newcomer) == 4
    stats = _accounting(backend)
    assert stats["lifecycle_closed_pages"] == 0
    assert stats["lifecycle_evicted_closed_pages"] == 4
    # s9 took the protection s0 gave back
    assert stats["lifecycle_protected_pages"] == 9


# ---- through the engine's write path ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from pdcache.engine.loader import load_model

    return load_model("tiny", seed=0)


@pytest.mark.parametrize("session_id", ["conv-a", ""], ids=["session", "no-session"])
def test_the_requests_session_reaches_storage(tiny, tmp_path, session_id: str) -> None:
    """HiCache writes a request's pages with its `session_id`: protected while it is active
    (without one, the same pages are unprotected)."""
    from pdcache.engine.api import GenerateRequest
    from tests.hicache_support import PARAMS, storage_config, tiered

    storage = storage_config(tiny[0], backend="file", path=str(tmp_path), eviction="session")
    built = tiered(tiny, storage)
    try:
        prompt = [(13 * i + 1) % 250 for i in range(41)]
        built.engine.generate(GenerateRequest("r0", prompt, PARAMS, session_id=session_id), 120)
        assert built.hicache.wait_idle(30)
        stats = built.storage.stats()  # type: ignore[union-attr]
        written = int(stats["pages_written"])
        assert written >= 10  # the prompt's full pages at least
        protected = written if session_id else 0
        assert stats["lifecycle_protected_pages"] == protected
        assert stats["lifecycle_unprotected_pages"] == written - protected
        assert stats["lifecycle_active_sessions"] == (1 if session_id else 0)
    finally:
        built.close()


@pytest.mark.parametrize("session_id", ["conv-a", ""], ids=["session", "no-session"])
def test_decode_offload_writes_carry_the_session(tmp_path, session_id: str) -> None:
    """The answer pages decode offloads are written for the request's session."""
    import threading

    from pdcache.offload_manager.decode_offload import DecodeOffloadManager

    layers, pages, page, heads, dim = 2, 16, 4, 2, 8
    kv = torch.randn(layers, 2, pages, page, heads, dim, generator=torch.Generator().manual_seed(0))
    page_bytes = kv[:, :, 0].numel() * kv.element_size()
    storage = create_backend(
        StorageConfig(
            backend="file",
            path=str(tmp_path),
            page_bytes=page_bytes,
            capacity_pages=64,
            fingerprint="fp",
            eviction="session",
        )
    )
    mgr = DecodeOffloadManager(kv, storage, "fp", staging_pages=8).start()
    try:
        mgr.track("r", session_id=session_id)
        released = threading.Event()
        mgr.finish("r", list(range(3 * page)), [4, 5, 6], released.set)
        assert released.wait(10) and mgr.wait_idle(10)
        stats = storage.stats()
        assert stats["pages_written"] == 3
        assert stats["lifecycle_protected_pages"] == (3 if session_id else 0)
        assert stats["lifecycle_unprotected_pages"] == (0 if session_id else 3)
    finally:
        mgr.close()
        storage.close()
