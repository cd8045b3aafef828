"""The node HTTP credential on REAL prefill and decode nodes (tiny preset, zmq transfer): with
a cluster secret, a request straight to a node without the credential is a 401 in the OpenAI
error shape (generate, flush, server info), `/health` stays open, `/metrics` is open unless
`metrics_auth`; with the credential it is served, and the router (which sends it) serves
end to end. Without a secret (the protection off) the same direct requests are served."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from pdcache.config.security import SecuritySettings
from pdcache.engine.loader import load_model
from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from pdcache.utils.secret import derive_key
from tests.pd_harness import PDStack, node_setups, start_stack
from tests.router_support import RouterUnderTest

pytestmark = pytest.mark.slow

PAGE = 4
SECRET = b"0123456789abcdef0123456789abcdef"
PROMPT = [(5 * i + 1) % 250 for i in range(21)]


def secured_stack(tmp_path: Any, security: SecuritySettings) -> PDStack:
    model, _ = load_model("tiny", seed=0)
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=False)
    return start_stack(dataclasses.replace(prefill, security=security),
                       dataclasses.replace(decode, security=security))


def plain_generate(url: str, headers: dict[str, str]) -> httpx.Response:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    return httpx.post(f"{url}/generate", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("metrics_auth", [False, True])
def test_nodes_refuse_requests_without_the_credential(tmp_path, metrics_auth: bool) -> None:
    security = SecuritySettings.from_secret(SECRET, metrics_auth=metrics_auth)
    token = derive_key(SECRET, "node-http").hex()
    assert security.node_http_token == token
    good = {"Authorization": f"Bearer {token}"}
    wrong = {"Authorization": f"Bearer {derive_key(b'another-secret-16b', 'node-http').hex()}"}
    stack = secured_stack(tmp_path, security)
    try:
        for url in (stack.prefill.url, stack.decode.url):
            for headers in ({}, wrong):
                refused = [plain_generate(url, headers),
                           httpx.post(f"{url}/flush_cache", headers=headers, timeout=30),
                           httpx.get(f"{url}/server_info", headers=headers, timeout=30),
                           httpx.get(f"{url}/v1/models", headers=headers, timeout=30)]
                for r in refused:
                    assert r.status_code == 401, r.text
                    assert r.json()["error"]["type"] == "authentication_error"
                    assert r.json()["error"]["code"] == "invalid_node_credential"
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            metrics = httpx.get(f"{url}/metrics", timeout=30).status_code
            assert metrics == (401 if metrics_auth else 200)
            assert httpx.get(f"{url}/metrics", headers=good, timeout=30).status_code == 200
            assert httpx.get(f"{url}/server_info", headers=good, timeout=30).status_code == 200
        served = plain_generate(stack.prefill.url, good)
        assert served.status_code == 200 and len(served.json()["output_ids"]) == 3
        nodes = (NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
                 NodeEndpoint("d0", "decode", stack.decode.url))
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        with RouterUnderTest(create_app(RouterConfig(nodes=nodes, page_size=PAGE,
                                                     node_token=token))) as client:
            routed = client.post("/generate", json=body)
            assert routed.status_code == 200, routed.text
            assert len(routed.json()["output_ids"]) == 4
        # a router without the credential is refused by the nodes: the router's own
        # misconfiguration, a 502 naming it (the node's 401 reached the client as if its
        # own key were wrong: SDKs raise AuthenticationError)
        with RouterUnderTest(create_app(RouterConfig(nodes=nodes, page_size=PAGE))) as client:
            refused = client.post("/generate", json=body)
            assert refused.status_code == 502, refused.text
            assert "refused the router's credential" in refused.json()["error"]["message"]
    finally:
        stack.close()


def test_without_a_secret_the_same_direct_requests_are_served(tmp_path) -> None:
    stack = secured_stack(tmp_path, SecuritySettings())  # the protection off
    try:
        for url in (stack.prefill.url, stack.decode.url):
            assert httpx.get(f"{url}/server_info", timeout=30).status_code == 200
            assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
        assert plain_generate(stack.prefill.url, {}).status_code == 200
    finally:
        stack.close()
