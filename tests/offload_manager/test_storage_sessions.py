"""Storage lifecycle session ids are tenant-scoped (`storage_session`): the session a HiCache
backup writes with is the client's id inside the write's tenant namespace, so tenant A reusing
tenant B's `session_id` neither spends B's per-session protection nor keeps B's session open
(docs/design.md §4.4). Real HiCache over a recording backend; real `SessionLifecycle`."""

from __future__ import annotations

import pytest

from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.storage.config import storage_session
from pdcache.offload_manager.storage.lifecycle import LifecycleConfig, SessionLifecycle
from tests.offload_manager.test_decode_offload import FP, PAGE, device_kv, released_event
from tests.offload_manager.test_hicache import S, Stack
from tests.storage_doubles import DictBackend


class SessionRecorder(DictBackend):
    """A dict store that remembers the (namespace, session) of every page it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[tuple[str, str]] = []
        self.ended: list[str] = []

    def end_session(self, session: str) -> None:
        self.ended.append(session)

    def put_from(self, keys, host_pages, origin="prefill", namespace="", session="") -> list[bool]:
        self.sessions.extend((namespace, session) for _ in keys)
        return super().put_from(keys, host_pages, origin, namespace, session)


def backed_up_session(salt: str, session_id: str, first_token: int) -> tuple[str, str]:
    storage = SessionRecorder()
    st = Stack(storage)
    tokens = list(range(first_token, first_token + 2 * S))
    pages = st.alloc.alloc(2)
    last = st.tree.insert(tokens, pages, salt).last_node
    st.tree.note_session(last, session_id, new_turn=True)
    st.cache.backup(tokens, salt, last)
    st.close()
    assert len(set(storage.sessions)) == 1 and len(storage.sessions) == 2
    return storage.sessions[0]


@pytest.mark.parametrize(
    "salt,session_id,expected",
    [
        ("tenant/A", "s1", ("tenant/A", "tenant/A/s1")),  # a client's raw id
        ("tenant/B", "s1", ("tenant/B", "tenant/B/s1")),  # B's s1 is another session
        ("tenant/B/alice", "tenant/B/s1", ("tenant/B", "tenant/B/s1")),  # router-scoped: kept
        ("tenant/A", "tenant/B/s1", ("tenant/A", "tenant/A/tenant/B/s1")),  # A forging B's id
        ("", "tenant/B/s1", ("", "-/tenant/B/s1")),  # no tenant may claim a tenant's id
        ("", "s1", ("", "s1")),  # no tenants at all: the client's id
    ],
)
def test_backups_write_with_the_tenant_scoped_session(salt, session_id, expected) -> None:
    assert backed_up_session(salt, session_id, 100) == expected


@pytest.mark.parametrize("scoped", [True, False], ids=["scoped", "raw-ids"])
def test_another_tenant_reusing_a_session_id_does_not_spend_its_protection(scoped) -> None:
    """Per-session cap 2: B writes a page of s1, A writes two with the same id, B writes one
    more. Scoped, B's two pages are protected; with raw client ids A's writes spent B's cap."""
    lifecycle = SessionLifecycle(LifecycleConfig(protect_pages=10, session_cap_pages=2))

    def write(key: bytes, tenant: str) -> None:
        session = storage_session(tenant, "s1") if scoped else "s1"
        lifecycle.stored(key, session)

    write(b"b0", "tenant/B")
    write(b"a0", "tenant/A")
    write(b"a1", "tenant/A")
    write(b"b1", "tenant/B")
    lifecycle.check()
    stats = lifecycle.stats()
    assert stats["active_sessions"] == (2 if scoped else 1)
    assert stats["protected_pages"] == (4 if scoped else 2)
    lifecycle.end_session(storage_session("tenant/A", "s1") if scoped else "s1")
    assert lifecycle.stats()["protected_pages"] == (2 if scoped else 0)  # B's stay protected


def test_decode_offload_and_hicache_close_the_session_they_wrote_with() -> None:
    storage = SessionRecorder()
    mgr = DecodeOffloadManager(device_kv(), storage, FP, staging_pages=8).start()
    mgr.track("r", cache_salt="tenant/A", session_id="s1")
    done, release = released_event()
    mgr.finish("r", list(range(2 * PAGE)), [0, 1], release)
    assert done.wait(10) and mgr.wait_idle(10)
    assert set(storage.sessions) == {("tenant/A", "tenant/A/s1")}
    assert mgr.end_session("s1", "tenant/A") and not mgr.end_session("", "tenant/A")
    mgr.close()
    st = Stack(storage)
    assert st.cache.end_session("s1", "tenant/A")
    st.close()
    assert storage.ended == ["tenant/A/s1", "tenant/A/s1"]
