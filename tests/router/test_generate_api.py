"""SGLang's native /generate through the router (two real unified nodes): batches and n > 1
routed per sequence, cumulative chunks built from the nodes' incremental events (or
incremental on request), stop strings applied by the node, refusals passed on."""

from __future__ import annotations

import json

import pytest

from tests.router.test_app import generate, router_client
from tests.router_support import GREEDY, UnifiedNode, prompt


def chunks_of(text: str) -> list[dict]:
    datas = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", text[-300:]
    return [json.loads(d) for d in datas[:-1]]


def test_batch_and_n_through_the_router(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        prompts = [prompt(30, seed=61), prompt(24, seed=62)]
        singles = [generate(client, p, 5) for p in prompts]
        r = client.post("/generate", json={"input_ids": prompts, "sampling_params": {
            "max_new_tokens": 5, "n": 2, **GREEDY}})
        assert r.status_code == 200, r.text
        answers = r.json()
        assert [a["output_ids"] for a in answers] == [
            singles[0]["output_ids"]] * 2 + [singles[1]["output_ids"]] * 2
        assert all(a["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
                   for a in answers)


def test_router_streams_cumulative_or_incremental(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        ids = prompt(28, seed=63)
        plain = generate(client, ids, 6)
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": 6, **GREEDY}}
        cumulative = chunks_of(client.post("/generate", json=body).text)
        assert [c["output_ids"] for c in cumulative] == [
            plain["output_ids"][: i + 1] for i in range(6)]
        assert cumulative[-1]["text"] == plain["text"]
        assert cumulative[0]["meta_info"]["prompt_tokens"] == 28
        incremental = chunks_of(client.post("/generate", json={
            **body, "incremental_streaming_output": True}).text)
        assert [t for c in incremental for t in c["output_ids"]] == plain["output_ids"]
        assert "".join(c["text"] for c in incremental) == plain["text"]
        batch = chunks_of(client.post("/generate", json={
            **body, "input_ids": [ids, prompt(20, seed=64)]}).text)
        assert {c["index"] for c in batch} == {0, 1}
        last0 = [c for c in batch if c["index"] == 0][-1]
        assert last0["output_ids"] == plain["output_ids"]


def test_stop_string_and_refusals_through_the_router(nodes: list[UnifiedNode]) -> None:
    with router_client(nodes) as client:
        ids = prompt(26, seed=65)
        text = generate(client, ids, 12)["text"]
        stop = text[3:5]
        cut = text.index(stop)
        out = client.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 12, "stop": stop, **GREEDY}}).json()
        assert out["text"] == text[:cut]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        for field, value in (("lora_path", "adapter"), ("bootstrap_room", 5)):
            r = client.post("/generate", json={"input_ids": ids, field: value})
            assert r.status_code == 400
            assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (
                field, "unsupported_parameter")
        assert generate(client, ids, 2)["meta_info"]["completion_tokens"] == 2


def test_logprobs_through_the_router(nodes: list[UnifiedNode]) -> None:
    """The router forwards the logprob fields; its cumulative chunks concatenate the node's
    incremental slices into the node's own non-streaming answer."""
    import httpx

    ids = prompt(24, seed=66)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 12, "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    direct = httpx.post(f"{nodes[0].url}/generate", json=body, timeout=60,
                        trust_env=False).json()["meta_info"]
    with router_client(nodes) as client:
        routed = client.post("/generate", json=body).json()["meta_info"]
        last = chunks_of(client.post("/generate", json={**body, "stream": True}).text)[-1]
    keys = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs",
            "output_token_logprobs_length")
    for key in keys:  # ids exact; logprobs within fp32 noise (another batch, another node)
        for got in (routed[key], last["meta_info"][key]):
            assert flat(got) == pytest.approx(flat(direct[key]), abs=1e-4), key


def flat(value: object) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in flat(v)]
    return [] if value is None else [float(value)]  # type: ignore[arg-type]
