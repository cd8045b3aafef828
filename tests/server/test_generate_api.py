"""SGLang's native /generate on the unified server (real `tiny` engine, in-process): the
request model against the installed SGLang's `GenerateReqInput` and `SamplingParams`, every
unimplemented field refused when set, batches and n > 1, stop strings, finish_reason objects,
and the stream byte-compared with what SGLang's own HTTP server writes."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdcache.engine.engine import Engine
from pdcache.wire.generate_api import (
    TRACKING_FIELDS,
    UNSUPPORTED_FIELDS,
    UNSUPPORTED_SAMPLING,
    GenerateRequestBody,
    GenerateSamplingParams,
    _is_neutral,
)
from tests.numeric_support import nested_close

sglang_sampling = pytest.importorskip("sglang.srt.sampling.sampling_params")
api_types = pytest.importorskip("sglang.api.v1.api_types")
json_response = pytest.importorskip("sglang.srt.utils.json_response")

PAGE = 16  # the page size of conftest.py's engine
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# SamplingParams fields SGLang fills in itself (normalize()), not API parameters
SGLANG_INTERNAL_SAMPLING = {"stop_strs", "stop_regex_strs", "stop_str_max_len",
                            "stop_regex_max_len", "is_normalized", "ebnf_full_assistant"}
# a value for each unimplemented field that is not its neutral one
NOT_NEUTRAL: dict[str, Any] = {"decode_tp_size": 2, "routed_dp_rank": 1,
                               "data_parallel_rank": 1, "disagg_prefill_dp_rank": 1,
                               "priority": 5, "max_thinking_tokens": 4,
                               "routed_experts_start_len": 3, "max_dynamic_patch": 2,
                               "min_dynamic_patch": 2, "image_max_dynamic_patch": 2,
                               "video_max_dynamic_patch": 2}
NOT_NEUTRAL_SAMPLING: dict[str, Any] = {"beam_width": 4, "stream_interval": 2,
                                        "spaces_between_special_tokens": False,
                                        "logit_bias": {"5": 1.0}, "choice": ["a", "b"]}


def ids_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 for i in range(n)]


def post(client: TestClient, body: dict[str, Any]) -> Any:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def generate_req_input_defaults() -> dict[str, Any]:
    """SGLang's `GenerateReqInput` fields and their defaults, read from its source (importing
    io_struct needs torchvision, which has no CPU build for this torch here)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    source = Path(spec.submodule_search_locations[0], "srt", "managers", "io_struct.py")
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fields: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                value = next(k.value for k in value.keywords if k.arg == "default")
            fields[node.target.id] = ast.literal_eval(value) if value is not None else None
    assert len(fields) > 60, sorted(fields)  # the parse found the class's fields
    return fields


def raw_events(body: bytes) -> list[bytes]:
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]", body[-200:]
    return [e + b"\n\n" for e in events[:-1]]


# --------------------------------------------------------------------------- the field lists


def test_every_generate_req_input_field_is_in_our_model() -> None:
    """A field SGLang adds to GenerateReqInput fails here until our model accepts it."""
    sglang_fields = set(generate_req_input_defaults())
    ours = set(GenerateRequestBody.model_fields)
    assert sglang_fields - ours == set()
    assert set(UNSUPPORTED_FIELDS).isdisjoint(TRACKING_FIELDS)


def test_every_sampling_param_is_in_our_model() -> None:
    sglang_fields = set(sglang_sampling.SamplingParams.__struct_fields__)
    assert sglang_fields - SGLANG_INTERNAL_SAMPLING - set(GenerateSamplingParams.model_fields) \
        == set()


def test_sglang_defaults_of_unimplemented_fields_are_neutral() -> None:
    """What SGLang's own clients send when they do not use a field is accepted."""
    defaults = generate_req_input_defaults()
    for name, neutral in UNSUPPORTED_FIELDS.items():
        assert _is_neutral(defaults[name], neutral), name
    sampling, contract = sglang_sampling.SamplingParams(), api_types.SamplingParams()
    for name, neutral in UNSUPPORTED_SAMPLING.items():
        default = getattr(sampling, name) if hasattr(sampling, name) else getattr(contract, name)
        assert _is_neutral(default, neutral), name


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unimplemented_field_set_is_refused_naming_it(client: TestClient, name: str) -> None:
    value = NOT_NEUTRAL.get(name, True if UNSUPPORTED_FIELDS[name] == (False,) else "x")
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, name: value}
    r = client.post("/generate", json=body)
    assert r.status_code == 400, (name, r.text)
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (name, "unsupported_parameter")
    neutral = {**body, name: UNSUPPORTED_FIELDS[name][0]}
    assert post(client, neutral)["meta_info"]["completion_tokens"] == 1  # still serving


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_SAMPLING))
def test_unimplemented_sampling_param_is_refused(client: TestClient, name: str) -> None:
    value = NOT_NEUTRAL_SAMPLING.get(name, "x")
    r = client.post("/generate", json={"input_ids": [1, 2, 3],
                                       "sampling_params": {"max_new_tokens": 1, name: value}})
    assert r.status_code == 400, (name, r.text)
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (f"sampling_params.{name}",
                                               "unsupported_parameter")


def test_what_sglang_clients_send_is_accepted(client: TestClient) -> None:
    """bench_serving's and cache_hit_kit's bodies, and sglang-router's injected fields."""
    body = {"input_ids": ids_of(20, 1), "stream": False, "lora_path": None,
            "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1,
            "stream_options": {"include_usage": True}, "model": None, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False,
            "return_bytes": False, "return_entropy": False, "return_text_in_logprobs": False,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True,
                                "top_k": 1 << 30, "top_p": None, "n": 1,
                                "spaces_between_special_tokens": True}}
    out = post(client, body)
    assert out["output_ids"] == post(client, {"input_ids": ids_of(20, 1), "sampling_params": {
        "max_new_tokens": 3, **GREEDY}})["output_ids"]


# --------------------------------------------------------------------------- answers


def test_answer_matches_sglangs_schema_and_finish_reasons(client: TestClient) -> None:
    ids = ids_of(30, 2)
    out = post(client, {"input_ids": ids, "rid": "req-1",
                        "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    api_types.GenerateResponse.from_json_value(out)  # SGLang's own decoder of the contract
    meta = out["meta_info"]
    assert list(out) == ["text", "output_ids", "meta_info"]
    assert meta["id"] == "req-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (30, 6)
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] == meta["prompt_tokens"] - \
        meta["computed_tokens"]
    stop_at = out["output_ids"][2]
    stopped = post(client, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 6, "stop_token_ids": [stop_at], "temperature": 0.0}})
    first = out["output_ids"].index(stop_at)
    assert stopped["output_ids"] == out["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_strings_trim_unless_no_stop_trim(client: TestClient) -> None:
    ids = ids_of(25, 3)
    full = post(client, {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, **GREEDY}})
    text = full["text"]
    stop = next((text[i:i + 2] for i in range(1, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2] and text[i:i + 2] not in text[:i]), None)
    assert stop, text
    cut = text.index(stop)
    for keep in (False, True):
        out = post(client, {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 16, "stop": [stop], "no_stop_trim": keep, **GREEDY}})
        assert out["text"] == text[: cut + (len(stop) if keep else 0)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_batch_answers_a_list_in_order(client: TestClient, engine: Engine) -> None:
    prompts = [ids_of(20, 4), ids_of(33, 5), ids_of(18, 6)]
    one = [post(client, {"input_ids": p, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
           for p in prompts]
    batch = post(client, {"input_ids": prompts, "rid": "b",
                          "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    assert [b["output_ids"] for b in batch] == [o["output_ids"] for o in one]
    assert [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1", "b_2"]
    texts = [engine.tokenizer.decode(p) for p in prompts]
    per_item = post(client, {"text": texts, "sampling_params": [
        {"max_new_tokens": n, **GREEDY} for n in (1, 2, 3)]})
    assert [len(b["output_ids"]) for b in per_item] == [1, 2, 3]
    r = client.post("/generate", json={"text": texts, "sampling_params": [{}, {}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"


def test_n_samples_share_the_prompt(client: TestClient) -> None:
    ids = ids_of(40, 7)
    outs = post(client, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 5, "n": 3, "temperature": 1.0, "seed": 11, "ignore_eos": True}})
    assert len(outs) == 3 and all(len(o["output_ids"]) == 5 for o in outs)
    assert len({o["meta_info"]["id"] for o in outs}) == 3


# --------------------------------------------------------------------------- streams


def test_stream_bytes_are_sglangs_cumulative_chunks(client: TestClient) -> None:
    ids = ids_of(35, 8)
    plain = post(client, {"input_ids": ids, "sampling_params": {"max_new_tokens": 7, **GREEDY}})
    r = client.post("/generate", json={"input_ids": ids, "stream": True,
                                       "sampling_params": {"max_new_tokens": 7, **GREEDY}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = raw_events(r.content)
    chunks = []
    for event in events[:-1]:
        assert event.startswith(b"data: ")
        chunk = json.loads(event[6:])
        # what SGLang's http_server writes for this chunk, byte for byte
        assert event == b"data: " + json_response.dumps_json(chunk) + b"\n\n"
        api_types.GenerateResponse.from_json_value(chunk)
        chunks.append(chunk)
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 8))
    for i, chunk in enumerate(chunks):
        assert chunk["output_ids"] == plain["output_ids"][: i + 1]
        assert plain["text"].startswith(chunk["text"])
        assert chunk["meta_info"]["completion_tokens"] == i + 1
        assert chunk["meta_info"]["prompt_tokens"] == 35  # known from the first chunk on
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["text"] == plain["text"] and "e2e_latency" in last["meta_info"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_incremental_stream_on_request(client: TestClient) -> None:
    ids = ids_of(28, 9)
    plain = post(client, {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    r = client.post("/generate", json={"input_ids": ids, "stream": True,
                                       "incremental_streaming_output": True,
                                       "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    chunks = [json.loads(e[6:]) for e in raw_events(r.content)[:-1]]
    assert [t for c in chunks for t in c["output_ids"]] == plain["output_ids"]
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert all(len(c["output_ids"]) == 1 for c in chunks)


def test_batch_stream_interleaves_indexed_chunks(client: TestClient) -> None:
    prompts = [ids_of(20, 10), ids_of(22, 11)]
    r = client.post("/generate", json={"input_ids": prompts, "stream": True,
                                       "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    chunks = [json.loads(e[6:]) for e in raw_events(r.content)[:-1]]
    assert {c["index"] for c in chunks} == {0, 1} and len(chunks) == 8
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    plain = [post(client, {"input_ids": p, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
             for p in prompts]
    assert [finals[i]["output_ids"] for i in (0, 1)] == [p["output_ids"] for p in plain]


def test_pd_fields_are_refused_on_a_unified_server(client: TestClient) -> None:
    for field, value in (("bootstrap_room", 7), ("bootstrap_host", "127.0.0.1"),
                         ("pd", {"room": 1, "role": "prefill"})):
        r = client.post("/generate", json={"input_ids": [1, 2, 3], field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field


def test_logprobs_in_meta_info_json_and_streams(client: TestClient) -> None:
    """SGLang's logprob keys: the greedy token is its position's top alternative, a
    cumulative stream's last chunk equals the JSON answer, an incremental one's slices add
    up to it, and the prompt's logprobs start at logprob_start_len."""
    ids = ids_of(30, 12)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
            "logprob_start_len": 20, "token_ids_logprob": [5, 6],
            "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    out = post(client, body)
    api_types.GenerateResponse.from_json_value(out)
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"] and meta["output_token_logprobs_length"] == 5
    for entry, top in zip(entries, meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == entry[1] and top[0][0] == pytest.approx(entry[0])
        assert entry[0] <= 0.0 and top[0][0] >= top[1][0] >= top[2][0]
    assert [[t[1] for t in pos] for pos in meta["output_token_ids_logprobs"]] == [[5, 6]] * 5
    assert len(meta["input_token_logprobs"]) == 30 - 20
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[20:]
    r = client.post("/generate", json={**body, "stream": True})
    chunks = [json.loads(e[6:]) for e in raw_events(r.content)[:-1]]
    last = chunks[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                "input_token_logprobs", "output_token_logprobs_length"):
        # the stream's request reuses the first one's cached pages (tests/numeric_support.py)
        assert nested_close(last[key], meta[key]), key
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks] == [1, 2, 3, 4, 5]
    r = client.post("/generate", json={**body, "stream": True, "incremental_streaming_output": True})
    pieces = [json.loads(e[6:]) for e in raw_events(r.content)[:-1]]
    assert nested_close([e for c in pieces for e in c["meta_info"]["output_token_logprobs"]], entries)


def test_n_samples_compute_the_prompt_once(client: TestClient) -> None:
    ids = ids_of(53, 13)  # fresh: nothing cached before
    outs = post(client, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 3, "n": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True}})
    metas = [o["meta_info"] for o in outs]
    assert len(outs) == 4 and metas[0]["cached_tokens"] == 0
    assert metas[0]["computed_tokens"] == 53
    full_pages = (53 - 1) // PAGE * PAGE  # followers reuse the leader's full prompt pages
    assert [m["cached_tokens"] for m in metas[1:]] == [full_pages] * 3
    assert [m["computed_tokens"] for m in metas[1:]] == [53 - full_pages] * 3


def test_min_new_tokens_above_max_new_tokens_is_a_400_naming_it(client: TestClient) -> None:
    sampling = {"max_new_tokens": 3, "min_new_tokens": 4}
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": sampling})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "sampling_params.min_new_tokens"
    assert "max_new_tokens" in r.json()["error"]["message"]
    sampling["min_new_tokens"] = 3  # equal is fine
    ok = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": sampling})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


@pytest.mark.parametrize("table", [UNSUPPORTED_FIELDS, UNSUPPORTED_SAMPLING])
def test_the_unsupported_tables_are_read_only(table) -> None:
    with pytest.raises(TypeError):
        table["stream"] = (None,)  # a module-level table no request can change


def test_a_request_s_logprobs_are_bounded(client: TestClient) -> None:
    """`top_logprobs_num` is at most MAX_TOP_LOGPROBS, and one request's logprobs at most
    LOGPROB_ENTRY_BUDGET entries over its sequences (checked before any is submitted): a
    batch asking every prompt position's alternatives took the server's memory. Just under
    the budget is served."""
    from pdcache.wire.generate_api import LOGPROB_ENTRY_BUDGET, MAX_TOP_LOGPROBS

    top = MAX_TOP_LOGPROBS
    per_prompt = LOGPROB_ENTRY_BUDGET // (16 * (1 + top))  # positions each of 16 prompts may ask
    over = {"input_ids": [[i % 200 + 1] * per_prompt for i in range(16)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top}
    r = client.post("/generate", json=over)
    assert r.status_code == 400 and r.json()["error"]["code"] == "logprobs_too_large", r.text
    under = {**over, "input_ids": over["input_ids"][:1], "top_logprobs_num": 5}
    r = client.post("/generate", json=under)
    assert r.status_code == 200, r.text
    assert len(r.json()[0]["meta_info"]["input_top_logprobs"]) == per_prompt
    too_wide = {**under, "top_logprobs_num": top + 1}
    r = client.post("/generate", json=too_wide)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num"
