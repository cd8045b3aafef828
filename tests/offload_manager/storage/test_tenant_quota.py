"""Tenant storage quotas (file backend): a tenant at its quota evicts only its own least
recently used pages, never another tenant's, both at the backend and end to end through a
tiered engine whose requests carry the router's tenant salts (`tenant/NAME/...`). Without a
quota (the protection off) the same writes keep every page."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig, tenant_namespace
from pdcache.offload_manager.storage.page_format import HEADER_BYTES
from tests.hicache_support import generate, prompt_keys, storage_config, tiered

PAGE_BYTES = 4096
SLOT = HEADER_BYTES + PAGE_BYTES


def keys(n: int, salt: str) -> list[bytes]:
    return chain_page_keys(list(range(7, 7 + 4 * n)), 4, make_salt("fp", salt))


def pages(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen))


def test_tenant_namespace_of_router_salts() -> None:
    assert tenant_namespace("tenant/alice") == "tenant/alice"
    assert tenant_namespace("tenant/alice/conv-7") == "tenant/alice"
    for other in ("", None, "alice", "tenant/", "tenants/alice"):
        assert tenant_namespace(other) == ""


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "protection-off"])
def test_a_tenant_over_quota_evicts_only_its_own_pages(tmp_path, quota: bool) -> None:
    quotas = {"tenant/a": 3 * SLOT + SLOT // 2} if quota else {}  # room for 3 pages
    backend = create_backend(StorageConfig(backend="file", path=str(tmp_path), page_bytes=PAGE_BYTES,
                                           capacity_pages=100, fingerprint="fp",
                                           namespace_quotas=quotas))
    b_keys, a_keys = keys(4, "tenant/b"), keys(5, "tenant/a/x")
    assert all(backend.put_from(b_keys, pages(4, 1), namespace="tenant/b"))
    assert all(backend.put_from(a_keys[:3], pages(3, 2)[:3], namespace="tenant/a"))
    probe = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert backend.get_into([a_keys[0]], [probe]) == [True]  # a read: a_keys[0] is recent
    assert all(backend.put_from(a_keys[3:], pages(5, 2)[3:], namespace="tenant/a"))
    stored = set(backend.keys())  # type: ignore[attr-defined]
    assert set(b_keys) <= stored  # the other tenant's pages are never the victims
    if quota:
        # A's two least recently used pages made room: a1, then a2 (a0 was read since)
        assert stored & set(a_keys) == {a_keys[0], a_keys[3], a_keys[4]}
        assert backend.stats()["quota_evictions"] == 2
    else:
        assert set(a_keys) <= stored and backend.stats()["quota_evictions"] == 0
    assert backend.stats()["evictions"] == 0  # the global capacity was never the reason
    backend.close()


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "protection-off"])
def test_quota_holds_through_the_engine_write_path(tiny: Any, tmp_path, quota: bool) -> None:
    probe = storage_config(tiny[0], backend="file", path=str(tmp_path))
    slot = HEADER_BYTES + probe.page_bytes
    quotas = {"tenant/a": 6 * slot} if quota else {}
    storage = probe.replace(namespace_quotas=quotas)
    built = tiered(tiny, storage)
    try:
        b_prompt = [(13 * i + 1) % 250 for i in range(41)]
        b_out, _ = generate(built.engine, "b0", b_prompt, "tenant/b/x")
        a_seqs = []  # prompt + answer: 12 full pages each (the answer's pages are stored too)
        for j in range(3):
            a_prompt = [(17 * i + 3 * j + 2) % 250 for i in range(41)]
            a_out, _ = generate(built.engine, f"a{j}", a_prompt, "tenant/a/x")
            a_seqs.append(a_prompt + a_out)
        assert built.hicache.wait_idle(30)
        stored = set(built.storage.keys())  # type: ignore[union-attr]
        b_keys = set(prompt_keys(storage, b_prompt + b_out, "tenant/b/x"))
        a_keys = {k for seq in a_seqs for k in prompt_keys(storage, seq, "tenant/a/x")}
        assert len(b_keys) == 12 and len(a_keys) == 36  # A wrote 6x its quota
        assert b_keys <= stored and stored <= b_keys | a_keys  # B untouched
        if quota:
            assert len(stored & a_keys) == 6  # A holds exactly its quota ...
            last = prompt_keys(storage, a_seqs[-1], "tenant/a/x")
            assert set(last[-6:]) <= stored  # ... its most recent pages
            assert built.storage.stats()["quota_evictions"] == 30  # type: ignore[union-attr]
        else:
            assert a_keys <= stored
    finally:
        built.close()


def test_the_reject_reasons_table_is_read_only() -> None:
    from pdcache.offload_manager.storage.stats import REJECT_REASONS

    with pytest.raises(TypeError):
        REJECT_REASONS[next(iter(REJECT_REASONS))] = "other"  # type: ignore[index]


@pytest.mark.parametrize("backend", ["hf3fs", "mooncake"])
def test_quotas_on_a_backend_that_cannot_enforce_them_are_refused(tmp_path, backend: str) -> None:
    """Built without a topology (the topology check: tests/config/test_security.py)."""
    config: dict[str, Any] = dict(backend=backend, path=str(tmp_path), page_bytes=PAGE_BYTES,
                                  capacity_pages=8)
    with pytest.raises(ValueError, match=rf"storage\.namespace_quotas = .*: the {backend} "
                                         r"backend does not enforce tenant quotas"):
        StorageConfig(**config, namespace_quotas={"tenant/a": SLOT})
    assert StorageConfig(**config).namespace_quotas == {}  # no quota: accepted
