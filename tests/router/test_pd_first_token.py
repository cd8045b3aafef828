"""The client's first token in PD comes from prefill (`[router] first_token_from_prefill`,
docs/pd-protocol.md "First token from prefill"), through the router on a REAL 1P1D stack (tiny
preset, zmq KV transfer): every streamed answer (/generate cumulative and incremental, with
logprobs, a batch, chat completions, completions with n = 2, answers that end at the first
token) is the same with the setting on and off, and with it on the client's first event
arrives while decode's handler is still held before the K/V receipt (off: only after).

The router always asks the nodes for incremental events and renders the client's cumulative
chunks itself: the "cumulative" cases here test that rendering, not the decode node's
cumulative branch of `FirstTokenSkip`, which tests/prefill_node/test_pd_stream.py
(`test_decode_after_a_streamed_first_token_cumulative_and_one_token`) drives directly, and
tests/decode_node/test_first_token.py at the unit level. Decode refusing
after P streamed token 1, a client leaving before D's stream opened and nodes that do not
advertise `first_token_stream` (a rolling upgrade) are tested at the end."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("pdcache.prefill_node.runtime", reason="the prefill node is not in this build")
pytest.importorskip("pdcache.decode_node.runtime", reason="the decode node is not in this build")

from pdcache.decode_node.app import DecodeHooks  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.prefill_node.app import PrefillHooks  # noqa: E402
from tests.pd_harness import PDStack  # noqa: E402
from tests.router.test_pd import pd_router, start_pd, wait_idle  # noqa: E402
from tests.router_support import sse_events  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [(7 + 3 * i) % 250 for i in range(30)]
COUNTS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "finish_reason",
    "prefill_node",
    "decode_node",
)
LOGPROBS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_logprobs_length",
    "input_top_logprobs",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    pd = start_pd(tmp_path_factory.mktemp("pd"), load_model("tiny", seed=0))
    try:
        yield pd
    finally:
        pd.close()


def first_token(stack: PDStack) -> int:
    with pd_router(stack) as client:
        r = client.post(
            "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, **GREEDY}},
        )
        assert r.status_code == 200, r.text
        return int(r.json()["output_ids"][0])


def assembled(events: list[dict[str, Any]], incremental: bool) -> dict[str, Any]:
    """What a client makes of a /generate stream: the whole text and ids, the final
    meta_info's counts and the output logprobs of every chunk (incremental: concatenated)."""
    final = events[-1]["meta_info"]
    assert final["finish_reason"] is not None
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    if not incremental:
        meta = final
        return {
            "text": events[-1]["text"],
            "ids": events[-1]["output_ids"],
            **{k: meta.get(k) for k in COUNTS + LOGPROBS},
        }
    out: dict[str, Any] = {
        "text": "".join(e["text"] for e in events),
        "ids": [i for e in events for i in e["output_ids"]],
    }
    out.update({k: final.get(k) for k in COUNTS})
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in final:
            out[key] = [x for e in events for x in e["meta_info"][key]]
    return out


def stream_both_ways(
    stack: PDStack, body: dict[str, Any], path: str = "/generate"
) -> dict[bool, list[dict[str, Any]]]:
    """The same streamed request with first_token_from_prefill on and off: its events. Each
    in its own cache namespace (a fresh salt), so both compute the prompt alike."""
    events: dict[bool, list[dict[str, Any]]] = {}
    for on in (True, False):
        with pd_router(stack, first_token_from_prefill=on) as client:
            r = client.post(path, json={**body, "cache_salt": f"ft-{uuid.uuid4().hex}"})
            assert r.status_code == 200, r.text
            events[on] = sse_events(r.text)
    return events


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("case", ["logprobs", "max_new_tokens_1", "stop_at_token_1"])
def test_generate_stream_is_the_same_on_and_off(
    stack: PDStack, incremental: bool, case: str
) -> None:
    sampling: dict[str, Any] = {"max_new_tokens": 9, **GREEDY}
    extra: dict[str, Any] = {}
    if case == "logprobs":
        extra = {"return_logprob": True, "top_logprobs_num": 2}
    elif case == "max_new_tokens_1":
        sampling["max_new_tokens"] = 1
    else:  # the first token is a stop token: the answer ends there
        sampling = {**sampling, "ignore_eos": False, "stop_token_ids": [first_token(stack)]}
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": sampling,
        "incremental_streaming_output": incremental,
        **extra,
    }
    events = stream_both_ways(stack, body)
    on, off = assembled(events[True], incremental), assembled(events[False], incremental)
    assert on == off
    assert events[True][0]["output_ids"] == on["ids"][:1]  # P's chunk: the first token alone
    expected = {
        "logprobs": ("length", 9),
        "max_new_tokens_1": ("length", 1),
        "stop_at_token_1": ("stop", 1),
    }[case]
    assert (on["finish_reason"]["type"], on["completion_tokens"]) == expected
    assert len(on["ids"]) == expected[1]
    if case == "logprobs":
        assert len(on["output_token_logprobs"]) == 9 and len(on["output_top_logprobs"]) == 9
    with pd_router(stack) as client:  # and the JSON answer agrees
        plain = client.post("/generate", json={**body, "stream": False}).json()
    assert plain["output_ids"] == on["ids"] and plain["text"] == on["text"]


def test_batch_stream_is_the_same_on_and_off(stack: PDStack) -> None:
    body = {
        "input_ids": [PROMPT, PROMPT[5:]],
        "stream": True,
        "incremental_streaming_output": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, **GREEDY},
    }
    events = stream_both_ways(stack, body)
    for index in (0, 1):
        on = assembled([e for e in events[True] if e["index"] == index], True)
        off = assembled([e for e in events[False] if e["index"] == index], True)
        # two sequences decode in one batch, whose make-up per step is timing's: the
        # logprob values may differ in the last float32 digits, their tokens may not
        on_lp, off_lp = on.pop("output_token_logprobs"), off.pop("output_token_logprobs")
        assert [t for _, t, _ in on_lp] == [t for _, t, _ in off_lp] == on["ids"]
        assert [v for v, _, _ in on_lp] == pytest.approx([v for v, _, _ in off_lp], abs=1e-4)
        assert on == off and len(on["ids"]) == 6


def openai_result(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per choice: the whole content / text, the output logprobs and the finish; the usage."""
    out: dict[str, Any] = {"usage": events[-1]["usage"]}
    for event in events[:-1]:
        for choice in event["choices"]:
            slot = out.setdefault(choice["index"], {"text": "", "logprobs": [], "finish": None})
            slot["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            logprobs = choice.get("logprobs") or {}
            slot["logprobs"] += logprobs.get("content") or logprobs.get("token_logprobs") or []
            slot["finish"] = choice.get("finish_reason") or slot["finish"]
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_streams_are_the_same_on_and_off(stack: PDStack, path: str) -> None:
    common = {
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True if path.endswith("chat/completions") else 2,
        **GREEDY,
    }
    if path.endswith("chat/completions"):
        body = {
            "messages": [{"role": "user", "content": "hi there " * 4}],
            "top_logprobs": 2,
            **common,
        }
    else:
        body = {"prompt": "once upon a time", "n": 2, **common}
    events = stream_both_ways(stack, body, path)
    on, off = openai_result(events[True]), openai_result(events[False])
    n = body.get("n", 1)
    if n > 1:  # the choices decode in one batch, whose make-up per step is timing's: the
        # logprob values may differ in the last float32 digits (not the tokens or the text)
        for i in range(n):
            on_lp, off_lp = on[i].pop("logprobs"), off[i].pop("logprobs")
            assert on_lp == pytest.approx(off_lp, abs=1e-4) and len(on_lp) == 7
    assert on == off
    assert on["usage"]["completion_tokens"] == 7 * n
    assert all(len(on[i].get("logprobs", [0] * 7)) == 7 for i in range(n))


class GatedReceipt(DecodeHooks):
    """Holds the decode node's handler before it learns that the K/V arrived (a slow
    transfer, as decode sees it): `arrived` once a request waits there, `opened_at` once
    the test lets it through. The running node's hooks (`DecodeApp.hooks`) for the test."""

    def __init__(self, stack: PDStack, monkeypatch: pytest.MonkeyPatch) -> None:
        self.arrived = threading.Event()
        self.gate = threading.Event()
        self.opened_at = 0.0
        monkeypatch.setattr(stack.decode_server.pd, "hooks", self)

    async def awaiting_kv(self, room: int) -> None:
        self.arrived.set()
        await asyncio.to_thread(self.gate.wait, 60)

    def open(self) -> None:
        self.opened_at = time.monotonic()
        self.gate.set()


def read_events(
    client: httpx.Client,
    body: dict[str, Any],
    first_at: list[float],
    first_seen: threading.Event,
    lines: list[str],
) -> None:
    with client.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                if not first_at:
                    first_at.append(time.monotonic())
                    first_seen.set()
                lines.append(line[len("data: ") :])


@pytest.mark.parametrize("on", [True, False], ids=["from_prefill", "from_decode"])
def test_first_event_comes_before_decode_has_the_kv(
    stack: PDStack, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode's handler is held before the K/V receipt until the client's first event came,
    or for a bound scaled from this stack's measured time to a first event: with the first
    token from prefill the event comes while decode is held; without, only after."""
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "incremental_streaming_output": True,
        "sampling_params": {"max_new_tokens": 5, **GREEDY},
    }
    with pd_router(stack, first_token_from_prefill=on) as client:
        start = time.monotonic()
        expected = sse_events(client.post("/generate", json=body).text)
        bound_s = max(2.0, 20 * (time.monotonic() - start))
        gate = GatedReceipt(stack, monkeypatch)
        first_at: list[float] = []
        first_seen = threading.Event()
        lines: list[str] = []
        reader = threading.Thread(
            target=read_events, args=(client, body, first_at, first_seen, lines)
        )
        reader.start()
        try:
            assert gate.arrived.wait(30), "decode never reached the K/V wait"
            first_seen.wait(bound_s)
        finally:
            gate.open()
            reader.join(60)
        assert not reader.is_alive()
    assert lines[-1] == "[DONE]"
    assert [json.loads(x) for x in lines[:-1]][-1]["meta_info"]["finish_reason"] is not None
    got = [json.loads(x) for x in lines[:-1]]
    assert [i for e in got for i in e["output_ids"]] == [
        i for e in expected for i in e["output_ids"]
    ]
    if on:
        assert first_at[0] < gate.opened_at  # the client had token 1 before decode had the K/V
    else:
        assert first_at[0] > gate.opened_at


def test_topology_key_and_flag_set_first_token_from_prefill() -> None:
    """`[router] first_token_from_prefill` (default true) reaches the router `pdcache launch`
    starts; `--no-first-token-from-prefill` wins; a non-bool is a topology error."""
    import argparse
    from pathlib import Path

    from pdcache.config.schema import TopologyError
    from pdcache.router.cli import add_arguments, build_config

    config_path = Path(__file__).resolve().parents[2] / "configs" / "local-1p1d.toml"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--config", str(config_path), "--node", "router"]
    assert build_config(parser.parse_args(base))[0].first_token_from_prefill is True
    off = ["--set", "router.first_token_from_prefill=false"]
    assert build_config(parser.parse_args(base + off))[0].first_token_from_prefill is False
    flag = parser.parse_args([*base, "--no-first-token-from-prefill"])
    assert build_config(flag)[0].first_token_from_prefill is False
    with pytest.raises(TopologyError, match="first_token_from_prefill"):
        build_config(parser.parse_args([*base, "--set", "router.first_token_from_prefill=3"]))


@pytest.mark.parametrize("on", [True, False], ids=["from_prefill", "from_decode"])
def test_decode_failing_after_token_1_is_a_mid_stream_error(
    stack: PDStack, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode gives up on the room once the K/V arrived (frees it, answers 502
    `transfer_failed`, as for a failed transfer): with the first token from prefill the
    client already has token 1, so it gets a 200 stream with that token, then the error
    event, then [DONE]; without, a plain HTTP 502. Decode's pages return either way."""
    from pdcache.wire.protocol import SERVER_ERROR, ApiError
    from tests.router.test_pd import wait_idle

    pd = stack.decode_server.pd

    class FailingAfterReceipt(GatedReceipt):
        async def kv_arrived(self, room: int) -> None:
            pd.controller.leave(room, "test: decode gives up after the K/V arrived")
            raise ApiError(
                502,
                f"KV transfer of room {room} failed: injected",
                type=SERVER_ERROR,
                code="transfer_failed",
            )

    gate = FailingAfterReceipt(stack, monkeypatch)
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "incremental_streaming_output": True,
        "sampling_params": {"max_new_tokens": 5, **GREEDY},
    }
    with pd_router(stack, first_token_from_prefill=on) as client:
        if not on:
            gate.open()
        with client.stream("POST", "/generate", json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    gate.open()  # on: the client has token 1 now; decode may go on (and fail)
        if on:
            assert r.status_code == 200
            (first, error) = sse_events("\n".join(lines))
            assert len(first["output_ids"]) == 1 and first["meta_info"]["finish_reason"] is None
            assert error["error"]["code"] == "transfer_failed", error
        else:
            assert (
                r.status_code == 502 and json.loads(lines[0])["error"]["code"] == "transfer_failed"
            )
        router = client.app.state.router  # type: ignore[attr-defined]
        assert [n.in_flight for n in router.registry.nodes] == [0, 0]
    wait_idle(stack.decode_server.engine)
    stack.decode_server.engine.check_accounting()


def tool_call_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat answer's content, tool calls (name and arguments reassembled per
    index) and finish reason."""
    content, calls, finish = "", {}, None
    for event in events:
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"content": content, "calls": calls, "finish": finish}


def test_forced_tool_call_stream_is_the_same_on_and_off(stack: PDStack) -> None:
    """A forced tool call (the nodes' JSON constraint; P samples token 1 under it, D goes on
    from it) streams the same call with the first token from prefill and without."""
    from tests.agent_support import TOOLS

    body = {
        "messages": [{"role": "user", "content": "what time is it in Paris?"}],
        "tools": [tool for tool in TOOLS if tool["function"]["name"] == "get_time"],
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 120,  # the tools' prompt is long on the tiny tokenizer; D holds 1024
        "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    events = stream_both_ways(stack, body, "/v1/chat/completions")
    on, off = tool_call_stream(events[True]), tool_call_stream(events[False])
    assert on == off
    assert on["finish"] == "tool_calls" and on["calls"][0]["name"] == "get_time", on
    json.loads(on["calls"][0]["arguments"])


class PrefillFirstSent(PrefillHooks):
    """`sent` once the prefill node's SSE answer has sent its first event (the first token)
    and waits for the room's release. The running node's hooks (`PrefillApp.hooks`)."""

    def __init__(self, stack: PDStack, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent = threading.Event()
        monkeypatch.setattr(stack.prefill_server.pd, "hooks", self)

    async def awaiting_release(self, room: int) -> None:
        self.sent.set()


def wait_no_rooms(stack: PDStack, timeout_s: float = 30.0) -> None:
    """Both nodes' controllers hold no room (bounded poll)."""
    controllers = (stack.prefill_server.pd.controller, stack.decode_server.pd.controller)
    deadline = time.monotonic() + timeout_s
    while any(c.rooms() for c in controllers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [len(c.rooms()) for c in controllers] == [0, 0]


STREAM_BODY = {
    "input_ids": PROMPT,
    "stream": True,
    "incremental_streaming_output": True,
    "sampling_params": {"max_new_tokens": 5, **GREEDY},
}


def test_decode_refusing_after_prefill_streamed_token_1_is_an_http_error(
    stack: PDStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefill_waits_for_decode = false`: P computes and streams token 1 while D's
    admission still waits; D's queue then answers `queue_full`. The router held P's first
    event until D's stream opened, so the client gets D's refusal as an HTTP 503 (retried
    when another decode node exists; here there is none), not a 200 stream ending in an
    error event. Nothing stays in flight, no room stays open on either node."""
    monkeypatch.setattr(stack.prefill_server.pd.controller, "wait_for_decode", False)
    first = PrefillFirstSent(stack, monkeypatch)
    decode = stack.decode_server.pd
    engine = stack.decode_server.engine
    decode.controller.attach(FullQueueEngine(engine, first.sent), decode.receiver)
    try:
        with pd_router(stack) as client:
            r = client.post("/generate", json=STREAM_BODY)
            assert first.sent.is_set()  # P had streamed token 1 before D refused
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "queue_full"
            router = client.app.state.router  # type: ignore[attr-defined]
            assert [n.in_flight for n in router.registry.nodes] == [0, 0]
    finally:
        decode.controller.attach(engine, decode.receiver)
    wait_no_rooms(stack)


class FullQueueEngine:
    """The decode engine as its controller uses it (`DecodeEngine`, handed over with
    `DecodeController.attach`), with its admission queue full: every reservation is answered
    `queue_full`, once `answer_after` is set; everything else is the real engine's."""

    def __init__(self, engine: Any, answer_after: threading.Event) -> None:
        self.engine = engine
        self.answer_after = answer_after

    def reserve_when_free(self, rid: str, num_tokens: int, on_done: Any,
                          max_new_tokens: int = 0, prefix_ids: Any = (), salt: str = "") -> None:
        from pdcache.engine.reservations import Admission

        def answer() -> None:  # the engine's answer of a full queue (its own thread)
            self.answer_after.wait(30)
            on_done(Admission(rid, None, "queue_full"))

        threading.Thread(target=answer, daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def test_client_leaving_before_decode_opened_frees_everything(
    stack: PDStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client disconnects after P sent token 1 to the router but before D's stream
    opened (D held after its admission): the router closes both calls, its in-flight counts
    return to 0 and neither node keeps the room."""
    import socket

    first = PrefillFirstSent(stack, monkeypatch)
    hold, held = threading.Event(), threading.Event()

    class HeldAfterAdmission(DecodeHooks):
        async def admitted(self, room: int) -> None:
            held.set()
            await asyncio.to_thread(hold.wait, 60)

    monkeypatch.setattr(stack.decode_server.pd, "hooks", HeldAfterAdmission())
    with pd_router(stack) as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        payload = json.dumps(STREAM_BODY).encode()
        url = httpx.URL(str(client.base_url))
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            assert first.sent.wait(30) and held.is_set()
        deadline = time.monotonic() + 30
        while any(n.in_flight for n in router.registry.nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        hold.set()
        assert [n.in_flight for n in router.registry.nodes] == [0, 0]
    wait_no_rooms(stack)
    wait_idle(stack.decode_server.engine)


def test_health_probe_records_first_token_stream_per_probe() -> None:
    """The router's /health probe records whether a node advertises `first_token_stream`:
    an older build's /health (no such key) reads False, a later probe of a node that stopped
    advertising it (a rollback) turns it off again. The node's answers: httpx's mock
    transport standing in for two builds' /health bodies."""
    from pdcache.router.nodes import NodeEndpoint, NodeRegistry

    bodies = [
        {"status": "ok", "role": "decode", "first_token_stream": True},
        {"status": "ok", "role": "decode"},
    ]

    def health(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=bodies[0])

    async def probe() -> list[bool]:
        seen = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as http:
            registry = NodeRegistry([NodeEndpoint("d0", "decode", "http://d0")], http)
            for _ in range(2):
                await registry.check_all()
                seen.append(registry.nodes[0].first_token_stream)
                bodies.pop(0)
        return seen

    assert asyncio.run(probe()) == [True, False]


@pytest.mark.parametrize("old", ["prefill", "decode"])
def test_a_node_not_advertising_first_token_stream_gets_the_old_bodies(
    stack: PDStack, old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both real nodes advertise `first_token_stream` in /health (the router's startup probe
    read it); with one of them taken for an older build (its flag off, as the probe records
    an older /health) the router sends the old bodies: P answers JSON (its SSE answer is
    never built), D streams token 1 itself, and the client's stream is the same."""
    sse_answers: list[int] = []

    class CountedStreams(PrefillHooks):
        async def streaming(self, room: int) -> None:
            sse_answers.append(room)

    monkeypatch.setattr(stack.prefill_server.pd, "hooks", CountedStreams())
    events = {}
    with pd_router(stack) as client:
        router = client.app.state.router  # type: ignore[attr-defined]
        assert [n.first_token_stream for n in router.registry.nodes] == [True, True]
        assert [n["first_token_stream"] for n in client.get("/health").json()["nodes"]] == [
            True,
            True,
        ]
        fresh = lambda: {**STREAM_BODY, "cache_salt": uuid.uuid4().hex}  # noqa: E731
        events["new"] = sse_events(client.post("/generate", json=fresh()).text)
        assert len(sse_answers) == 1
        next(n for n in router.registry.nodes if n.role == old).first_token_stream = False
        events["old"] = sse_events(client.post("/generate", json=fresh()).text)
        assert len(sse_answers) == 1  # P was not asked to stream
    assert assembled(events["old"], True) == assembled(events["new"], True)
