"""Tenants on the router, over a REAL unified node (tiny preset): the key names the tenant; a
tenant's cache namespace and sessions are its own (B replaying A's session_id, cache_salt and
prompt gets no cached token and only its own tokens); missing/wrong keys are 401 JSON; the
in-flight limit is a 429 with Retry-After; metrics and errors name no tenant. Each protection
is shown failing with it off (the same requests on a router without tenants)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from pdcache.router.tenants import Tenant, parse_tenant_flag
from tests.polling import wait_until
from tests.router_support import GREEDY, PAGE, RouterUnderTest, UnifiedNode, page_floor, prompt

ALICE = Tenant("alice-corp", "key-alice-0123456789", max_inflight=1)
BOB = Tenant("bob-corp", "key-bob-0123456789")


def router(nodes: list[UnifiedNode], **overrides: Any) -> RouterUnderTest:
    endpoints = (NodeEndpoint(nodes[0].name, "unified", nodes[0].url),)  # one node: hits are its
    config = RouterConfig(nodes=endpoints, page_size=PAGE, request_timeout_s=60,
                          health_interval_s=30, **overrides)
    return RouterUnderTest(create_app(config))


def auth(tenant: Tenant | None) -> dict[str, str]:
    return {} if tenant is None else {"Authorization": f"Bearer {tenant.api_key}"}


def generate(client: httpx.Client, tenant: Tenant | None, ids: list[int], n: int,
             **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    r = client.post("/generate", json=body, headers=auth(tenant))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("tenants", [True, False], ids=["tenants", "protection-off"])
def test_b_replaying_a_session_and_salt_gets_nothing_of_a(nodes: list[UnifiedNode],
                                                          tenants: bool) -> None:
    a, b = (ALICE, BOB) if tenants else (None, None)
    overrides = {"tenants": (ALICE, BOB)} if tenants else {}
    a_prompt = prompt(70, seed=1400 + tenants)  # its own prompt per case: no hit from the other
    with router(nodes, **overrides) as client:
        first = generate(client, a, a_prompt, 6, session_id="s1", cache_salt="salty")
        assert first["meta_info"]["cached_tokens"] == 0
        replay = generate(client, b, a_prompt, 6, session_id="s1", cache_salt="salty")
        core = client.app.state.router  # type: ignore[attr-defined]
        if tenants:
            # B's s1 is not A's s1: its prompt holds only B's tokens, and A's pages are not
            # B's (another namespace): nothing cached although the node holds A's prompt
            assert replay["meta_info"]["prompt_tokens"] == len(a_prompt)
            assert replay["meta_info"]["cached_tokens"] == 0
            assert core.sessions.history(("bob-corp", "s1")) == a_prompt + replay["output_ids"]
            assert core.sessions.history(("alice-corp", "s1")) == a_prompt + first["output_ids"]
            # A's own next turn still continues A's session, from A's cached pages
            again = generate(client, a, [7, 8, 9], 2, session_id="s1", cache_salt="salty")
            assert again["meta_info"]["prompt_tokens"] == len(a_prompt) + 6 + 3
            assert again["meta_info"]["cached_tokens"] >= page_floor(len(a_prompt)) - PAGE > 0
        else:
            # without tenants the "other" client continues the session: A's whole history
            # (prompt + answer) is prepended, and it is served from A's cached pages
            assert replay["meta_info"]["prompt_tokens"] == 2 * len(a_prompt) + 6
            assert replay["meta_info"]["cached_tokens"] >= page_floor(len(a_prompt)) - PAGE > 0


def test_same_salt_hits_within_a_tenant_only(nodes: list[UnifiedNode]) -> None:
    ids = prompt(66, seed=1410)
    with router(nodes, tenants=(ALICE, BOB)) as client:
        generate(client, ALICE, ids, 2, cache_salt="x")
        own = generate(client, ALICE, ids, 2, cache_salt="x")
        assert own["meta_info"]["cached_tokens"] == page_floor(len(ids))  # same tenant, same salt
        assert generate(client, ALICE, ids, 2, cache_salt="y")["meta_info"]["cached_tokens"] == 0
        assert generate(client, BOB, ids, 2, cache_salt="x")["meta_info"]["cached_tokens"] == 0
        assert generate(client, BOB, ids, 2)["meta_info"]["cached_tokens"] == 0  # bare namespace


def test_missing_or_wrong_key_is_401_json(nodes: list[UnifiedNode]) -> None:
    body = {"input_ids": prompt(10, 1420), "sampling_params": {"max_new_tokens": 2}}
    with router(nodes, tenants=(ALICE, BOB), api_key="legacy-key-0123") as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"},
                        {"Authorization": f"Bearer {ALICE.api_key}x"}):
            for r in (client.post("/generate", json=body, headers=headers),
                      client.post("/v1/completions", json={"prompt": "hi"}, headers=headers),
                      client.get("/v1/models", headers=headers),
                      client.get("/server_info", headers=headers)):
                assert r.status_code == 401, r.text
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("authentication_error",
                                                          "invalid_api_key")
                assert "alice" not in r.text and "bob" not in r.text  # names no tenant
                assert r.headers["www-authenticate"] == "Bearer"
        open_health = client.get("/health")
        assert open_health.status_code == 200
        # open to probes, but the nodes (internal addresses, their last errors) only with a key
        assert "nodes" not in open_health.json() and "127.0.0.1" not in open_health.text
        # ... nor what tells of the traffic (other tenants' sessions, the queue)
        assert not {"sessions", "queue_depth"} & set(open_health.json())
        keyed = client.get("/health", headers=auth(BOB)).json()
        assert keyed["nodes"] and {"sessions", "queue_depth"} <= set(keyed)
        for tenant in (ALICE, BOB, Tenant("default", "legacy-key-0123")):  # api_key: a tenant
            assert client.post("/generate", json=body, headers=auth(tenant)).status_code == 200
        models = client.get("/v1/models", headers=auth(BOB)).json()
        assert "alice" not in str(models)
        # flushing every tenant's cache is not a tenant's call
        flushed = client.post("/flush_cache", headers=auth(BOB))
        assert flushed.status_code == 403 and flushed.json()["error"]["code"] == "forbidden"
        metrics = client.get("/metrics").text
        assert "alice" not in metrics and "bob" not in metrics
        refused = [line for line in metrics.splitlines() if line.startswith(
            "pdcache_router_requests_total{") and 'status="401"' in line and '"/generate"' in line]
        assert len(refused) == 1 and refused[0].endswith(" 4.0"), refused  # counted, no tenant
    # the protection off: the same unauthenticated request is served
    with router(nodes) as client:
        assert client.post("/generate", json=body).status_code == 200


@contextlib.contextmanager
def held_request(client: httpx.Client, tenant: Tenant, path: str) -> Iterator[None]:
    """A request of `tenant` to `path` in flight whatever the machine's speed: its headers
    are in (the gate admitted it), its body never completes while the socket stays open."""
    port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as held:
        held.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{tenant.api_key}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 1000\r\n\r\n{{".encode())
        yield


@pytest.mark.parametrize("limit", [1, 0], ids=["limited", "protection-off"])
def test_inflight_limit_is_429_with_retry_after(nodes: list[UnifiedNode], limit: int) -> None:
    alice = Tenant(ALICE.name, ALICE.api_key, max_inflight=limit)
    short = {"input_ids": prompt(8, 1431), "sampling_params": {"max_new_tokens": 1, **GREEDY}}
    with router(nodes, tenants=(alice, BOB)) as client:
        core = client.app.state.router  # type: ignore[attr-defined]
        with held_request(client, alice, "/generate"):
            wait_until(lambda: core.tenant_limits.inflight(alice) == 1)
            second = client.post("/generate", json=short, headers=auth(alice))
            other = client.post("/generate", json=short, headers=auth(BOB))
            assert other.status_code == 200  # another tenant's limit is its own
            if limit:
                assert second.status_code == 429, second.text
                assert int(second.headers["retry-after"]) >= 1
                assert second.json()["error"]["code"] == "rate_limit_exceeded"
            else:
                assert second.status_code == 200
        # the client went away: its slot frees once the handler unwinds
        wait_until(lambda: core.tenant_limits.inflight(alice) == 0)
        assert client.post("/generate", json=short, headers=auth(alice)).status_code == 200


@pytest.mark.parametrize("limit", [3, 0], ids=["limited", "protection-off"])
def test_the_limit_counts_sequences_and_fan_out_calls(nodes: list[UnifiedNode],
                                                      limit: int) -> None:
    """`max_inflight` counts sequences: a batch of 4 prompts (or n = 4 choices) is 4 units,
    over a limit of 3 a 429 before any node is asked, 3 fit and are released; a call that
    goes to every node (/close_session) is a unit too. Off (0), all are served."""
    alice = Tenant(ALICE.name, ALICE.api_key, max_inflight=limit)
    sampling = {"max_new_tokens": 1, **GREEDY}
    batch = {"input_ids": [prompt(8, 1500 + i) for i in range(4)], "sampling_params": sampling}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 4,
            "temperature": 0}
    with router(nodes, tenants=(alice, BOB)) as client:
        core = client.app.state.router  # type: ignore[attr-defined]
        over = [client.post("/generate", json=batch, headers=auth(alice)),
                client.post("/v1/chat/completions", json=chat, headers=auth(alice))]
        fits = [client.post("/generate", json={**batch, "input_ids": batch["input_ids"][:3]},
                            headers=auth(alice)),
                client.post("/v1/chat/completions", json={**chat, "n": 3}, headers=auth(alice))]
        assert core.tenant_limits.inflight(alice) == 0  # every unit given back
        with held_request(client, alice, "/close_session"):
            wait_until(lambda: core.tenant_limits.inflight(alice) == 1)
            three = client.post("/v1/chat/completions", json={**chat, "n": 3}, headers=auth(alice))
    assert all(r.status_code == 200 for r in fits), [r.text for r in fits]
    if limit:
        assert [r.status_code for r in over] == [429, 429], [r.text for r in over]
        assert over[0].json()["error"]["code"] == "rate_limit_exceeded"
        assert three.status_code == 429  # 1 held by the fan-out call + 3 > 3
    else:
        assert [r.status_code for r in over] == [200, 200] and three.status_code == 200


def test_tenant_flag_parsing() -> None:
    assert parse_tenant_flag("acme=k3y=with=equals") == ("acme", "k3y=with=equals")
    for bad in ("acme", "=key", "acme="):
        with pytest.raises(ValueError, match="NAME=KEY"):
            parse_tenant_flag(bad)
    # `acme/x`'s salt and session ids were acme's with the client's salt or id "x": its key
    # read and timed acme's pages and spent acme's storage quota
    assert Tenant("acme", "a").cache_salt("x") == "tenant/acme/x"
    with pytest.raises(ValueError, match="tenant name 'acme/x'"):
        Tenant(*parse_tenant_flag("acme/x=k2"))
    with pytest.raises(ValueError, match="unique"):
        RouterConfig(nodes=(NodeEndpoint("u0", "unified", "http://127.0.0.1:1"),),
                     tenants=(ALICE, Tenant("x", ALICE.api_key)))
    assert "key-alice" not in repr(ALICE)
