"""`/close_session` end to end: router (with tenants) -> every node -> HiCache -> the storage
session lifecycle's `end_session`. A real tiny unified node with a host tier and file storage
under `eviction = "session"`: after B closes its `s1`, B's stored pages are the closed ones
(the store's first victims) while A's `s1`, the same client id, stays an active session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdcache.engine.loader import load_model
from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from pdcache.router.tenants import Tenant
from pdcache.server.app import ServerConfig
from pdcache.server.app import create_app as create_node_app
from tests.hicache_support import PAGE, check_every_tier, storage_config, tiered
from tests.router_support import GREEDY, RouterUnderTest, ThreadedServer, prompt

ALICE = Tenant("alice-corp", "key-alice-0123456789")
BOB = Tenant("bob-corp", "key-bob-0123456789")


@pytest.fixture
def node(tmp_path) -> Iterator[tuple[Any, str]]:
    tiny = load_model("tiny", seed=0)
    storage = storage_config(tiny[0], backend="file", path=str(tmp_path), eviction="session")
    built = tiered(tiny, storage, host_pages=64)
    server = ThreadedServer(
        create_node_app(
            built.engine, ServerConfig(name="u0", manage_engine=False, request_timeout_s=60)
        )
    )
    try:
        yield built, server.url
    finally:
        server.stop()
        built.close()


def auth(tenant: Tenant) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant.api_key}"}


def generate(client: httpx.Client, tenant: Tenant, ids: list[int]) -> None:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "session_id": "s1",
    }
    r = client.post("/generate", json=body, headers=auth(tenant))
    assert r.status_code == 200, r.text


def lifecycle(built: Any) -> dict[str, int]:
    stats = built.storage.stats()
    return {k[len("lifecycle_") :]: int(v) for k, v in stats.items() if k.startswith("lifecycle_")}


def test_a_closed_session_goes_first_and_only_the_tenants_own(node) -> None:
    built, url = node
    config = RouterConfig(
        nodes=(NodeEndpoint("u0", "unified", url),),
        page_size=PAGE,
        request_timeout_s=60,
        health_interval_s=30,
        tenants=(ALICE, BOB),
    )
    with RouterUnderTest(create_app(config)) as client:
        generate(client, ALICE, prompt(40, seed=1))
        generate(client, BOB, prompt(40, seed=2))
        check_every_tier(built)
        before = lifecycle(built)
        assert (before["active_sessions"], before["closed_pages"]) == (2, 0), before
        bob_pages = before["protected_pages"] // 2
        assert bob_pages > 0 and before["protected_pages"] == 2 * bob_pages

        r = client.post("/close_session", json={"session_id": "s1"}, headers=auth(BOB))
        assert r.status_code == 200, r.text
        assert r.json()["nodes"] == [
            {"name": "u0", "role": "unified", "status": 200, "closed": True}
        ]
        assert r.json()["router_history_dropped"] is True
        after = lifecycle(built)
        assert after["active_sessions"] == 1 and after["closed_sessions"] == 1
        assert after["closed_pages"] == bob_pages  # B's pages: evicted before any other
        assert after["protected_pages"] == bob_pages  # A's `s1` keeps its protection

        bad = client.post("/close_session", json={"session_id": ""}, headers=auth(BOB))
        assert bad.status_code == 400
        assert client.post("/close_session", json={"session_id": "s1"}).status_code == 401
