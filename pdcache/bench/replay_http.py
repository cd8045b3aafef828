"""One replayed request over HTTP: `POST /generate` streamed (`send_stream`: TTFT and ITL
measured as token-bearing SSE chunks arrive, `StreamState`) or not (`send_plain`: TTFT from
the server's meta), filling the request's `RequestRecord`. Runs on the replay's event loop,
on the run's shared `httpx.AsyncClient`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdcache.bench.replay_records import RequestRecord


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class StreamErrorChunk(Exception):
    """The server reported an error inside a 200 event stream."""


@dataclass
class StreamState:
    """Timing of a streamed response, measured on arrival of token-bearing chunks."""

    start: float
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_at: float | None = None
    itl_s: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if chunk.get("error"):
            raise StreamErrorChunk(json.dumps(chunk["error"])[:300])
        ids = chunk.get("output_ids") or []
        if ids:
            if self.first_token_at is None:
                self.first_token_at = now
                gaps = [0.0] * (len(ids) - 1)  # tokens of the first chunk arrive together
            else:
                gaps = [(now - (self.last_at or now)) / len(ids)] * len(ids)
            self.itl_s.extend(gaps)
            self.last_at = now
            self.output_ids.extend(int(t) for t in ids)
        if chunk.get("meta_info"):
            self.meta = chunk["meta_info"]


async def send_stream(
    client: httpx.AsyncClient, body: dict[str, Any], rec: RequestRecord,
    on_first_token: Callable[[], None],
) -> list[int]:
    state = StreamState(start=time.perf_counter())
    async with client.stream("POST", "/generate", json=body) as resp:
        rec.http_status = resp.status_code
        if resp.status_code != 200:
            raise HttpError(resp.status_code, (await resp.aread()).decode(errors="replace"))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            had_token = state.first_token_at is not None
            state.on_chunk(json.loads(payload), time.perf_counter())
            if not had_token and state.first_token_at is not None:
                on_first_token()
    end = time.perf_counter()
    rec.apply_meta(state.meta)
    rec.e2e_s = end - state.start
    rec.ttft_s = None if state.first_token_at is None else state.first_token_at - state.start
    rec.itl_s = [round(g, 6) for g in state.itl_s]
    return state.output_ids


async def send_plain(
    client: httpx.AsyncClient, body: dict[str, Any], rec: RequestRecord,
    on_first_token: Callable[[], None],
) -> list[int]:
    start = time.perf_counter()
    resp = await client.post("/generate", json=body)
    rec.http_status = resp.status_code
    if resp.status_code != 200:
        raise HttpError(resp.status_code, resp.text)
    data = resp.json()
    rec.e2e_s = time.perf_counter() - start
    rec.apply_meta(data.get("meta_info") or {})
    rec.ttft_s = rec.server_ttft_s
    on_first_token()  # not observable without streaming: the prompt counts from completion
    return [int(t) for t in data.get("output_ids") or []]
