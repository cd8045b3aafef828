"""The agent API through the router over real prefill + decode nodes (zmq KV transfer): the
tools reach the chat template the P/D pair computes, and n choices are n P/D requests whose
prompt prefill computes once (choice 1 finds choice 0's pages in prefill's tree)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pdcache.prefill_node.runtime", reason="the prefill node is not in this build")

from pdcache.engine.api import GenerateRequest, LogprobRequest, SamplingParams  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.router.app import create_app  # noqa: E402
from pdcache.router.config import RouterConfig  # noqa: E402
from pdcache.router.nodes import NodeEndpoint  # noqa: E402
from tests.agent_support import TOOLS  # noqa: E402
from tests.pd_harness import PDStack, node_setups, start_stack  # noqa: E402
from tests.router_support import RouterUnderTest  # noqa: E402

pytestmark = pytest.mark.slow
PAGE = 4
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny: Any) -> Iterator[PDStack]:
    prefill, decode = node_setups(
        tmp_path_factory.mktemp("pd"), tiny[0], PAGE, "zmq", offload=False
    )
    pd = start_stack(prefill, decode)
    try:
        yield pd
    finally:
        pd.close()


def test_tools_and_n_through_the_router_and_pd(stack: PDStack, tiny: Any) -> None:
    nodes = (
        NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
        NodeEndpoint("d0", "decode", stack.decode.url),
    )
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60, health_interval_s=30)
    _, tokenizer = tiny
    ids = tokenizer.apply_chat_template(ASK, tools=TOOLS)
    assert len(ids) % PAGE != 0
    with RouterUnderTest(create_app(config)) as client:
        body = {
            "messages": ASK,
            "tools": TOOLS,
            "n": 2,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        out = client.post("/v1/chat/completions", json=body).json()
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(ids)  # the tools block is in the prompt P computed
    assert usage["completion_tokens"] == 12
    assert usage["computed_tokens"] == len(ids) + len(ids) % PAGE  # the prompt once
    reference = stack.prefill_server.engine.generate(
        GenerateRequest("ref", ids, SamplingParams(max_new_tokens=6, ignore_eos=True)), timeout=60
    )
    text = tokenizer.decode([t for o in reference for t in o.new_token_ids])
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["content"] == text for c in out["choices"])


def routed_logprobs(stack: PDStack, tiny: Any) -> tuple[list[dict], list]:
    nodes = (
        NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
        NodeEndpoint("d0", "decode", stack.decode.url),
    )
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60, health_interval_s=30)
    _, tokenizer = tiny
    with RouterUnderTest(create_app(config)) as client:
        out = client.post(
            "/v1/chat/completions",
            json={
                "messages": ASK,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ).json()
    ids = tokenizer.apply_chat_template(ASK)
    reference = stack.prefill_server.engine.generate(
        GenerateRequest(
            f"ref-lp-{len(ids)}",
            ids,
            SamplingParams(max_new_tokens=5, ignore_eos=True),
            logprobs=LogprobRequest(top_n=2),
        ),
        timeout=60,
    )
    return out["choices"][0]["logprobs"]["content"], [
        lp for o in reference for lp in o.new_logprobs
    ]


def test_logprobs_through_the_router_and_pd(stack: PDStack, tiny: Any) -> None:
    """Every output token's logprob reaches the client through the router, the first one's
    (sampled on prefill, carried by the PrefillReport) included, equal to the engine's."""
    content, ref = routed_logprobs(stack, tiny)
    assert len(content) == 5
    assert [e["logprob"] for e in content] == pytest.approx([r.logprob for r in ref], abs=1e-4)
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in content] == [
        pytest.approx([lp for _, lp in r.top], abs=1e-4) for r in ref
    ]


def test_json_schema_through_the_router_and_pd(stack: PDStack) -> None:
    """Prefill samples the first token under the grammar; decode rebuilds it from the request
    and advances it past that token: the whole output validates."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["city", "ok"],
        "additionalProperties": False,
    }
    nodes = (
        NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
        NodeEndpoint("d0", "decode", stack.decode.url),
    )
    config = RouterConfig(nodes=nodes, page_size=PAGE, request_timeout_s=60, health_interval_s=30)
    with RouterUnderTest(create_app(config)) as client:
        for seed in (1, 2):
            out = client.post(
                "/v1/chat/completions",
                json={
                    "messages": ASK,
                    "temperature": 1.0,
                    "seed": seed,
                    "max_tokens": 200,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "w", "schema": schema},
                    },
                },
            ).json()
            choice = out["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
