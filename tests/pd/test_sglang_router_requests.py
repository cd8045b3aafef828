"""A pdcache prefill/decode pair driven with the requests SGLang's router (sglang-router 0.3.2,
`--pd-disaggregation`) sends: the same body to P and D, `bootstrap_host`/`bootstrap_port`/
`bootstrap_room` injected, plus its own defaults (`model: null`, `log_metrics`, ...). The
bodies below are what that router sent, captured from its HTTP requests; the live router is
driven in tests/integrations/test_sglang_clients.py. Also what it reads: /server_info's
`disaggregation_bootstrap_port` and `disaggregation_mode`, /model_info, /health."""

from __future__ import annotations

import concurrent.futures
import json
import secrets

import pytest

from pdcache.engine.loader import load_model
from tests.pd.test_nodes import unified_tokens
from tests.pd_harness import PDStack, node_setups, start_stack

PAGE = 4


def sglang_router_body(stack: PDStack, room: int, **request: object) -> dict:
    """sglang-router's PD body: the client's request, its defaults, the bootstrap fields."""
    host, port = stack.bootstrap.rsplit(":", 1)
    return {"model": None, **request, "return_text_in_logprobs": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False, "bootstrap_host": host,
            "bootstrap_port": int(port), "bootstrap_room": room}


def send_pair(stack: PDStack, body: dict) -> tuple[object, object]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(stack.client.post, f"{stack.prefill.url}/generate", json=body)
        d = pool.submit(stack.client.post, f"{stack.decode.url}/generate", json=body)
        return p.result(), d.result()


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def stack(tiny, tmp_path_factory):
    prefill, decode = node_setups(tmp_path_factory.mktemp("pd"), tiny[0], PAGE, "zmq",
                                  offload=False)
    pair = start_stack(prefill, decode)
    yield pair
    pair.close()


def test_what_sglang_router_reads_from_the_nodes(stack: PDStack) -> None:
    p_info = stack.client.get(f"{stack.prefill.url}/server_info").json()
    d_info = stack.client.get(f"{stack.decode.url}/get_server_info").json()
    assert p_info["disaggregation_mode"] == "prefill" and d_info["disaggregation_mode"] == "decode"
    assert p_info["disaggregation_bootstrap_port"] == int(stack.bootstrap.rsplit(":", 1)[1])
    for url in (stack.prefill.url, stack.decode.url):
        assert stack.client.get(f"{url}/health").status_code == 200
        info = stack.client.get(f"{url}/model_info").json()
        assert info["is_generation"] is True and info["model_path"]


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_router_pd_body_is_served(stack: PDStack, tiny, stream: bool) -> None:
    ids = [(7 * i + 3) % 250 for i in range(26)]
    body = sglang_router_body(stack, secrets.randbits(63), input_ids=ids, stream=stream,
                              sampling_params={"temperature": 0.0, "max_new_tokens": 6,
                                               "ignore_eos": True})
    p, d = send_pair(stack, body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    expected = unified_tokens(tiny, ids, 6)
    p_answer = p.json()
    assert p_answer["output_ids"] == expected[:1] and "meta_info" in p_answer
    if stream:
        datas = [line[6:] for line in d.text.split("\n") if line.startswith("data: ")]
        assert datas[-1] == "[DONE]"
        answer = json.loads(datas[-2])  # cumulative: the last chunk holds everything
    else:
        answer = d.json()
    assert answer["output_ids"] == expected
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert answer["meta_info"]["prompt_tokens"] == len(ids)
    stack.prefill_server.engine.check_accounting()
    stack.decode_server.engine.check_accounting()


def test_bootstrap_fields_are_checked(stack: PDStack) -> None:
    body = sglang_router_body(stack, 5, input_ids=[1, 2, 3],
                              sampling_params={"max_new_tokens": 2})
    del body["bootstrap_port"]
    r = stack.client.post(f"{stack.decode.url}/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_bootstrap"
    batch = sglang_router_body(stack, 6, input_ids=[[1, 2, 3], [4, 5, 6]],
                               sampling_params={"max_new_tokens": 2})
    r = stack.client.post(f"{stack.prefill.url}/generate", json=batch)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_across_the_pair(stack: PDStack, tiny, stream: bool) -> None:
    """sglang-router's body with return_logprob: D's answer carries SGLang's logprob keys for
    every output token (the first one's from P's report) and the prompt's from P."""
    ids = [(11 * i + 1) % 250 for i in range(22)]
    body = sglang_router_body(stack, secrets.randbits(63), input_ids=ids, stream=stream,
                              return_logprob=True, top_logprobs_num=2, logprob_start_len=10,
                              sampling_params={"temperature": 0.0, "max_new_tokens": 4,
                                               "ignore_eos": True})
    p, d = send_pair(stack, body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    if stream:
        datas = [line[6:] for line in d.text.split("\n") if line.startswith("data: ")]
        answer = json.loads(datas[-2])
    else:
        answer = d.json()
    meta = answer["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == answer["output_ids"]
    assert answer["output_ids"] == unified_tokens(tiny, ids, 4)
    assert all(top[0][1] == e[1] for e, top in zip(meta["output_token_logprobs"],
                                                   meta["output_top_logprobs"], strict=True))
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[10:]
