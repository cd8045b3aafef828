"""Sampling features across a real prefill/decode pair (HTTP, zmq KV transfer, tiny preset):
the first token prefill samples travels with its logprob (and the prompt logprobs) in the
`PrefillReport`, the decode node's outputs carry them, equal to the unified engine's; a
`ForcedTokens` constraint gives the exact tokens across the pair, the decode node's copy
accepting prefill's first token; penalties count that token.

The HTTP request models do not carry logprobs or constraints yet,
so each test adds them where the node hands its request to its engine (`Engine.submit` on
prefill, `Engine.submit_prefilled` on decode); everything after that is the real path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from pdcache.engine.api import (
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
    TokenConstraint,
)
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.constraints import ForcedTokens
from pdcache.engine.engine import Engine
from pdcache.engine.loader import load_model
from tests.numeric_support import nested_close
from tests.pd_harness import PDStack, node_setups, start_stack

PAGE = 4
PROMPT = [(7 * i + 3) % 250 for i in range(18)]
LOGPROBS = LogprobRequest(top_n=3, token_ids=(5, 6), input_start=5)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model) -> Iterator[PDStack]:
    prefill, decode = node_setups(
        tmp_path_factory.mktemp("pd_sampling"), model, PAGE, "zmq", offload=False
    )
    stack = start_stack(prefill, decode)
    try:
        yield stack
    finally:
        stack.close()


class Seam:
    """Adds request fields at both engines' doors and records what decode's engine emits."""

    def __init__(self, stack: PDStack) -> None:
        self.p_engine: Engine = stack.prefill_server.engine
        self.d_engine: Engine = stack.decode_server.engine
        self.fields: dict = {}
        self.penalties: dict = {}  # onto each side's own SamplingParams (prefill's: 1 token)
        self.constraint: Callable[[], TokenConstraint] | None = None
        self.decode_outputs: list[RequestOutput] = []
        self._submit, self._submit_prefilled = self.p_engine.submit, self.d_engine.submit_prefilled
        self.p_engine.submit = self.submit  # type: ignore[method-assign]
        self.d_engine.submit_prefilled = self.submit_prefilled  # type: ignore[method-assign]

    def _extend(self, req: GenerateRequest) -> GenerateRequest:
        constraint = self.constraint() if self.constraint else None
        sampling = dataclasses.replace(req.sampling, **self.penalties)
        return dataclasses.replace(req, sampling=sampling, constraint=constraint, **self.fields)

    def submit(self, req, on_output) -> None:
        self._submit(self._extend(req), on_output)

    def submit_prefilled(self, req, first_token, on_output, **kw) -> None:
        def record(out: RequestOutput) -> None:
            self.decode_outputs.append(out)
            on_output(out)

        self._submit_prefilled(self._extend(req), first_token, record, **kw)

    def close(self) -> None:
        del self.p_engine.submit, self.d_engine.submit_prefilled


@pytest.fixture()
def seam(stack) -> Iterator[Seam]:
    seam = Seam(stack)
    try:
        yield seam
    finally:
        seam.close()


def unified(model, params: SamplingParams, **fields) -> list[RequestOutput]:
    config = EngineConfig(model.config, CacheConfig(PAGE, 256, enable_prefix_cache=False))
    with Engine(config, model) as engine:
        return engine.generate(GenerateRequest("ref", PROMPT, params, **fields), timeout=120)


def test_first_token_logprob_and_prompt_logprobs_cross_the_pair(stack, seam, model) -> None:
    seam.fields = {"logprobs": LOGPROBS}
    p, d = stack.generate(PROMPT, 6)
    reference = unified(model, SamplingParams(max_new_tokens=6, ignore_eos=True), logprobs=LOGPROBS)
    expected_tokens = [t for o in reference for t in o.new_token_ids]
    assert d["output_ids"] == expected_tokens and p["output_ids"] == expected_tokens[:1]
    outputs = seam.decode_outputs
    first = outputs[0]
    assert first.new_token_ids[:1] == expected_tokens[:1]
    # prefill's logprob of the first token, bit for bit the unified engine's
    assert first.new_logprobs[0] == reference[0].new_logprobs[0]
    assert first.new_logprobs[0].logprob is not None and len(first.new_logprobs[0].top) == 3
    assert first.input_logprobs == reference[0].input_logprobs
    assert len(first.input_logprobs) == len(PROMPT) - LOGPROBS.input_start
    got = [lp for o in outputs for lp in o.new_logprobs]
    want = [lp for o in reference for lp in o.new_logprobs]
    assert [e.token_id for e in got] == expected_tokens
    for mine, theirs in zip(got[1:], want[1:]):  # decode's own steps: same within fp32 noise
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    # again: prefill holds the prompt's pages now, but reuses them only below input_start
    seam.decode_outputs.clear()
    _, again = stack.generate(PROMPT, 6)
    assert again["output_ids"] == expected_tokens
    assert again["meta_info"]["cached_tokens"] == (LOGPROBS.input_start // PAGE) * PAGE == 4
    # computed past 4 reused tokens this time: within fp32 noise (tests/numeric_support.py)
    assert nested_close(seam.decode_outputs[0].input_logprobs, reference[0].input_logprobs)
    stack.prefill_server.engine.check_accounting()
    stack.decode_server.engine.check_accounting()


def test_forced_tokens_across_the_pair(stack, seam) -> None:
    script = [11, 200, 200, 3, 97]
    seam.constraint = lambda: ForcedTokens(script)  # one per engine: decode's accepts the first
    seam.fields = {"logprobs": LogprobRequest()}
    p, d = stack.generate(PROMPT, 20)
    assert p["output_ids"] == script[:1]
    assert d["output_ids"] == script
    final = seam.decode_outputs[-1]
    assert final.finished and final.finish_reason == "stop"
    assert [lp.logprob for o in seam.decode_outputs for lp in o.new_logprobs] == [0.0] * 5
    stack.decode_server.engine.check_accounting()


def test_penalties_count_the_first_token_on_decode(stack, seam, model) -> None:
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 2.0}
    # long enough for greedy to repeat a generated token (SGLang's penalties see only those)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **penalties)
    seam.penalties = penalties
    _, d = stack.generate(PROMPT, 24)
    reference = [t for o in unified(model, params) for t in o.new_token_ids]
    plain = [
        t
        for o in unified(model, SamplingParams(max_new_tokens=24, ignore_eos=True))
        for t in o.new_token_ids
    ]
    assert d["output_ids"] == reference != plain
