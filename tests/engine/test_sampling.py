"""Engine sampling features on the `tiny` preset, checked against an independent forward:
logprobs (output, top-n, selected ids, prompt logprobs from `input_start` with the cached
prefix recomputed), penalties, min_new_tokens, constraints (`ForcedTokens`), validation, and
n > 1 followers sharing the leader's prompt pages (`prefill_leader`)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from pdcache.engine.api import (
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
)
from pdcache.engine.config import CacheConfig, EngineConfig
from pdcache.engine.constraints import ForcedTokens
from pdcache.engine.engine import Engine
from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.loader import allocate_device_kv, load_model
from pdcache.engine.roles import RolePolicy, Unified
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.scheduler_config import SchedulerConfig

PAGE = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", seed=0)
    return model


def make_engine(model, *, budget: int = 2048) -> Engine:
    """Not started: `with make_engine(...)` starts its thread, `.start(thread=False)` drives."""
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=256),
        scheduler=SchedulerConfig(chunked_prefill_tokens=budget),
    )
    return Engine(config, model)


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits from one fresh forward of `ids` (own pool, contiguous pages)."""
    num_pages = (len(ids) + PAGE - 1) // PAGE
    kv = allocate_device_kv(model.config, num_pages, PAGE)
    positions = torch.arange(len(ids))
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(ids),
        positions=positions,
        out_slots=positions,
        page_table=torch.arange(num_pages)[None],
        prefix_lens=[0],
        extend_lens=[len(ids)],
        logits_indices=positions,
    )
    with torch.inference_mode():
        return model(batch, kv).float()


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def logprobs_of(outputs: list[RequestOutput]):
    return [lp for out in outputs for lp in out.new_logprobs]


def run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, **kw):
    outputs = engine.generate(GenerateRequest(rid, prompt, params, **kw), timeout=60)
    assert outputs[-1].finished and sum(o.finished for o in outputs) == 1
    return outputs


# ---- logprobs ----------------------------------------------------------------------------
def test_output_logprobs_equal_log_softmax_of_an_independent_forward(tiny) -> None:
    prompt = prompt_of(1, 13)
    request = LogprobRequest(top_n=5, token_ids=(3, 17, 200))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with make_engine(tiny, budget=5) as engine:  # chunked prefill: 3 chunks
        outputs = run(engine, "a", prompt, params, logprobs=request)
    tokens, entries = tokens_of(outputs), logprobs_of(outputs)
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outputs)
    assert outputs[0].input_logprobs is None  # none asked for
    reference = torch.log_softmax(full_logits(tiny, prompt + tokens), dim=-1)
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        row = reference[len(prompt) - 1 + i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL)
        # greedy: the sampled token is the top-1 alternative; the top-5 sorted, best first
        assert entry.top[0][0] == token == int(row.argmax())
        values = [lp for _, lp in entry.top]
        assert len(entry.top) == 5 and values == sorted(values, reverse=True)
        assert [t for t, _ in entry.top] == row.topk(5).indices.tolist()
        for (t, lp), wanted in zip(entry.selected, (3, 17, 200)):
            assert t == wanted and lp == pytest.approx(float(row[wanted]), abs=ATOL)


def test_sampled_logprobs_follow_sglang_temperature_scaled_softmax(tiny) -> None:
    prompt = prompt_of(2, 9)
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=20, seed=5, ignore_eos=True)
    with make_engine(tiny) as engine:
        outputs = run(engine, "s", prompt, params, logprobs=LogprobRequest(top_n=2))
    tokens, entries = tokens_of(outputs), logprobs_of(outputs)
    logits = full_logits(tiny, prompt + tokens)
    for i, entry in enumerate(entries):
        row = logits[len(prompt) - 1 + i]
        # SGLang's default: log_softmax(logits / T), before top-k truncation
        expected = torch.log_softmax(row / 0.7, dim=-1)[tokens[i]]
        assert entry.logprob == pytest.approx(float(expected), abs=ATOL)
        assert entry.logprob != pytest.approx(
            float(torch.log_softmax(row, -1)[tokens[i]]), abs=1e-3
        )


def test_input_logprobs_recompute_the_cached_prefix_from_input_start(tiny) -> None:
    prompt = prompt_of(3, 22)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    start = 9
    with make_engine(tiny, budget=7) as engine:
        warm = run(engine, "warm", prompt, params)[-1]
        assert warm.cached.total == 0 and warm.computed_tokens == 22
        plain = run(engine, "plain", prompt, params)[-1]
        assert plain.cached.total == 20  # all full pages but the one holding the last token
        outputs = run(
            engine, "in", prompt, params, logprobs=LogprobRequest(top_n=3, input_start=start)
        )
        assert engine.check_accounting()["requests"] == 0
    final = outputs[-1]
    # positions >= input_start need their logits: reuse stops at the page holding input_start
    assert final.cached.total == (start // PAGE) * PAGE == 8
    assert final.computed_tokens == 22 - 8
    entries = outputs[0].input_logprobs
    assert entries is not None and len(entries) == len(prompt) - start
    assert all(o.input_logprobs is None for o in outputs[1:])
    assert entries[0].token_id == prompt[start] and entries[0].logprob is None
    assert entries[0].top == ()
    reference = torch.log_softmax(full_logits(tiny, prompt), dim=-1)
    for offset, entry in enumerate(entries[1:], start=start + 1):
        assert entry.token_id == prompt[offset]
        row = reference[offset - 1]
        assert entry.logprob == pytest.approx(float(row[prompt[offset]]), abs=ATOL)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    assert tokens_of(outputs) == tokens_of(run_fresh(tiny, prompt, params))


def run_fresh(model, prompt, params):
    with make_engine(model) as engine:
        return run(engine, "fresh", prompt, params)


def test_input_start_at_prompt_end_gives_no_input_logprobs(tiny) -> None:
    prompt = prompt_of(4, 10)
    with make_engine(tiny) as engine:
        outputs = run(
            engine,
            "end",
            prompt,
            SamplingParams(max_new_tokens=2, ignore_eos=True),
            logprobs=LogprobRequest(input_start=len(prompt)),
        )
    assert outputs[0].input_logprobs == []
    assert len(logprobs_of(outputs)) == 2


# ---- penalties and min_new_tokens --------------------------------------------------------
def penalised(
    row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """The penalties computed by hand, one token at a time (SGLang's: over the output;
    `prompt` is not penalised)."""
    out = row.clone()
    for token in set(output):
        if params.repetition_penalty != 1.0:
            value = float(out[token])
            out[token] = (
                value / params.repetition_penalty
                if value > 0
                else value * params.repetition_penalty
            )
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token)
        out[token] -= params.presence_penalty
    return out


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 0.5, "presence_penalty": 0.7, "repetition_penalty": 1.3},
    ],
)
def test_greedy_penalties_equal_a_reference_on_the_logits(tiny, penalty) -> None:
    prompt = prompt_of(1, 8)  # greedy repeats an output token at step 11 (loops after)
    base = SamplingParams(max_new_tokens=24, ignore_eos=True)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **penalty)
    with make_engine(tiny) as engine:
        plain = tokens_of(run(engine, "plain", prompt, base))
        outputs = run(engine, "pen", prompt, params, logprobs=LogprobRequest())
    tokens = tokens_of(outputs)
    assert tokens != plain  # the penalty changes what greedy picks
    logits = full_logits(tiny, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, logprobs_of(outputs))):
        row = penalised(logits[len(prompt) - 1 + i], prompt, tokens[:i], params)
        assert token == int(row.argmax()), i
        # the logprob is taken after the penalties (SGLang's order)
        assert entry.logprob == pytest.approx(float(torch.log_softmax(row, -1)[token]), abs=ATOL)


def test_min_new_tokens_keeps_stop_tokens_out(tiny) -> None:
    prompt = prompt_of(6, 8)
    base = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with make_engine(tiny) as engine:
        plain = tokens_of(run(engine, "plain", prompt, base))
        stop = plain[2]
        first_stop = plain.index(stop)
        stopped = run(
            engine,
            "stop",
            prompt,
            SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,)),
        )
        assert tokens_of(stopped) == plain[: first_stop + 1]
        assert stopped[-1].finish_reason == "stop"
        held = run(
            engine,
            "min",
            prompt,
            SamplingParams(  # an id outside the vocabulary is no stop token to mask
                max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop, 10**6), min_new_tokens=6
            ),
        )
    tokens = tokens_of(held)
    assert len(tokens) >= 6 and stop not in tokens[:6]
    assert tokens[:first_stop] == plain[:first_stop]  # unchanged before the masked position
    assert tokens[-1] == stop and held[-1].finish_reason == "stop" or len(tokens) == 12


def test_min_p_keeps_only_tokens_near_the_best(tiny) -> None:
    prompt = prompt_of(7, 8)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, min_p=0.9, seed=0)
    with make_engine(tiny) as engine:
        seen = {
            tokens_of(run(engine, f"m{i}", prompt, replace(params, seed=i)))[0] for i in range(12)
        }
    probs = torch.softmax(full_logits(tiny, prompt)[-1], dim=-1)
    allowed = set((probs >= 0.9 * probs.max()).nonzero().flatten().tolist())
    assert seen <= allowed


# ---- constraints -------------------------------------------------------------------------
def test_forced_tokens_yield_exactly_their_tokens_and_stop(tiny) -> None:
    prompt = prompt_of(8, 7)
    script = [17, 42, 42, 99, 5, 240]
    with make_engine(tiny) as engine:
        outputs = run(
            engine,
            "f",
            prompt,
            SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True),
            constraint=ForcedTokens(script),
            logprobs=LogprobRequest(top_n=2),
        )
        plain = tokens_of(
            run(engine, "p", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
        )
        assert engine.check_accounting()["requests"] == 0
    assert tokens_of(outputs) == script != plain
    assert outputs[-1].finish_reason == "stop" and outputs[-1].completion_tokens == 6
    entries = logprobs_of(outputs)
    assert [e.logprob for e in entries] == [0.0] * 6  # the only allowed token


def test_a_constraint_that_allows_nothing_fails_only_its_request(tiny) -> None:
    class Nothing:
        def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
            return torch.zeros(vocab_size, dtype=torch.bool)

        def accept(self, token_id: int) -> None:
            raise AssertionError("never sampled")

        def is_terminated(self) -> bool:
            return False

    prompt = prompt_of(9, 6)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with make_engine(tiny) as engine:
        bad = run(engine, "bad", prompt, params, constraint=Nothing())
        good = run(engine, "good", prompt, params)
        assert engine.check_accounting()["requests"] == 0
    assert bad[-1].finish_reason == "abort" and "allows no token" in bad[-1].error
    assert tokens_of(bad) == [] and len(tokens_of(good)) == 4


def test_a_constraint_whose_end_check_raises_fails_only_its_request(tiny) -> None:
    """`is_terminated` runs in the scheduler's commit of a whole batch: raising there failed
    every request of the step ("engine step failed"), not just its own."""
    class BrokenEnd:
        def allowed_tokens(self, vocab_size: int) -> None:
            return None

        def accept(self, token_id: int) -> None:
            pass

        def is_terminated(self) -> bool:
            raise RuntimeError("grammar matcher broke")

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    finals: dict[str, RequestOutput] = {}
    engine = make_engine(tiny).start(thread=False)  # driven: all three in one step
    try:
        for rid, constraint in (("good1", None), ("bad", BrokenEnd()), ("good2", None)):
            engine.submit(GenerateRequest(rid, prompt_of(11, 6), params, constraint=constraint),
                          lambda out: finals.__setitem__(out.rid, out) if out.finished else None)
        while engine.step():
            pass
        assert engine.check_accounting()["requests"] == 0
    finally:
        engine.shutdown()
    assert finals["bad"].finish_reason == "abort"
    assert "grammar matcher broke" in finals["bad"].error
    assert [finals[rid].finish_reason for rid in ("good1", "good2")] == ["length", "length"]


def test_invalid_sampling_and_logprob_requests_are_refused(tiny) -> None:
    prompt = prompt_of(10, 5)
    cases = [
        (SamplingParams(min_p=1.5), None, "min_p"),
        (SamplingParams(frequency_penalty=3.0), None, "frequency_penalty"),
        (SamplingParams(presence_penalty=-2.5), None, "presence_penalty"),
        (SamplingParams(repetition_penalty=0.0), None, "repetition_penalty"),
        (SamplingParams(max_new_tokens=4, min_new_tokens=5), None, "min_new_tokens"),
        (SamplingParams(), LogprobRequest(top_n=-1), "top_n"),
        (SamplingParams(), LogprobRequest(token_ids=(10**6,)), "logprobs token id"),
        (SamplingParams(), LogprobRequest(input_start=6), "input_start"),
    ]
    with make_engine(tiny) as engine:
        for params, request, field in cases:
            with pytest.raises(ValueError, match=field):
                engine.submit(
                    GenerateRequest("x", prompt, params, logprobs=request), lambda out: None
                )


# ---- n > 1: followers wait for the leader's prompt pages ----------------------------------
@pytest.mark.parametrize("share", [True, False])
def test_followers_compute_the_prompt_once(tiny, share: bool) -> None:
    prompt = prompt_of(11, 23)  # 5 full pages + 3 tokens
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine = make_engine(tiny).start(thread=False)
    finals: dict[str, RequestOutput] = {}
    tokens: dict[str, list[int]] = {}

    def collect(out: RequestOutput) -> None:
        tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.rid] = out

    rids = ["s0", "s1", "s2", "s3"]
    for rid in rids:
        leader = "s0" if share and rid != "s0" else None
        engine.submit(GenerateRequest(rid, prompt, params, prefill_leader=leader), collect)
    for _ in range(200):
        if not engine.step():
            break
    accounting = engine.check_accounting()
    engine.shutdown()
    assert set(finals) == set(rids) and accounting["requests"] == 0
    assert all(tokens[rid] == tokens["s0"] for rid in rids)  # greedy: the same answer
    assert finals["s0"].computed_tokens == 23 and finals["s0"].cached.total == 0
    for rid in rids[1:]:
        if share:  # the partial last page is recomputed (page granularity)
            assert finals[rid].cached.total == 20 and finals[rid].computed_tokens == 3 < PAGE
        else:  # admitted in one batch, nobody's pages are cached yet: all compute it all
            assert finals[rid].cached.total == 0 and finals[rid].computed_tokens == 23
    total = sum(f.computed_tokens for f in finals.values())
    assert total == (23 + 3 * 3 if share else 4 * 23)


def test_a_follower_of_a_failed_leader_computes_its_own_prompt(tiny) -> None:
    prompt = prompt_of(12, 10)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    engine = make_engine(tiny).start(thread=False)
    finals: dict[str, RequestOutput] = {}

    def collect(out: RequestOutput) -> None:
        if out.finished:
            finals[out.rid] = out

    engine.submit(GenerateRequest("lead", prompt, params), collect)
    engine.submit(GenerateRequest("follow", prompt, params, prefill_leader="lead"), collect)
    engine.abort("lead")
    for _ in range(50):
        if not engine.step():
            break
    engine.check_accounting()
    engine.shutdown()
    assert finals["lead"].finish_reason == "abort"
    assert finals["follow"].finish_reason == "length"
    assert finals["follow"].computed_tokens == 10


class HoldingRole(Unified):
    """A prefill node's pattern: finished requests keep their pages until `release_held`."""

    def hold_after_finish(self, req) -> bool:
        return True


def held_engine(tiny, role: RolePolicy) -> Engine:
    """A tiny engine (64 device pages) stepped by the test, holding finished requests."""
    config = EngineConfig(
        model=tiny.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=64),
        scheduler=SchedulerConfig(),
    )
    return Engine(config, tiny,
                  make_scheduler=functools.partial(Scheduler, role=role)).start(thread=False)


def finals_of(finals: dict[str, RequestOutput]) -> Callable[[RequestOutput], None]:
    """An output callback that keeps each request's final output in `finals`."""

    def collect(out: RequestOutput) -> None:
        if out.finished:
            finals[out.rid] = out

    return collect


def test_followers_share_a_held_leaders_prompt(tiny) -> None:
    prompt = prompt_of(13, 14)  # 3 full pages + 2 tokens
    engine = held_engine(tiny, HoldingRole())
    finals: dict[str, RequestOutput] = {}
    collect = finals_of(finals)

    first = SamplingParams(max_new_tokens=1)  # prefill's request: the first token only
    engine.submit(GenerateRequest("lead", prompt, first), collect)
    engine.submit(GenerateRequest("f1", prompt, first, prefill_leader="lead"), collect)
    for _ in range(20):
        if not engine.step():
            break
    assert finals["lead"].computed_tokens == 14
    assert finals["f1"].cached.total == 12 and finals["f1"].computed_tokens == 2
    assert engine.check_accounting()["requests"] > 0  # both still hold their pages
    engine.release_held("lead")
    engine.release_held("f1")
    engine.step()
    assert engine.check_accounting()["requests"] == 0
    engine.shutdown()


def test_min_new_tokens_keeps_eos_out(tiny) -> None:
    prompt = prompt_of(6, 8)
    with make_engine(tiny) as engine:
        plain = tokens_of(run(engine, "plain", prompt, SamplingParams(max_new_tokens=12)))
    eos = plain[1]  # make the token greedy emits second the model's EOS
    config = EngineConfig(
        model=replace(tiny.config, eos_token_ids=(eos,)),
        cache=CacheConfig(page_size=PAGE, num_device_pages=256),
    )
    with Engine(config, tiny) as engine:
        stopped = run(engine, "eos", prompt, SamplingParams(max_new_tokens=12))
        held = run(engine, "min", prompt, SamplingParams(max_new_tokens=12, min_new_tokens=5))
    assert tokens_of(stopped) == plain[:2] and stopped[-1].finish_reason == "stop"
    tokens = tokens_of(held)
    assert len(tokens) >= 5 and eos not in tokens[:5] and tokens[0] == plain[0]


# ---- one request's degenerate parameters stay its own problem --------------------------------
def run_together(model, requests: list[GenerateRequest]) -> dict[str, RequestOutput | list[int]]:
    """Submit `requests` before the first step (so they share every batch) and drive to the
    end; returns rid -> tokens and rid + "/final" -> the final output."""
    engine = make_engine(model).start(thread=False)
    results: dict[str, RequestOutput | list[int]] = {}

    def collect(out: RequestOutput) -> None:
        tokens = results.setdefault(out.rid, [])
        assert isinstance(tokens, list)
        tokens.extend(out.new_token_ids)
        if out.finished:
            results[out.rid + "/final"] = out

    for req in requests:
        engine.submit(req, collect)
    for _ in range(200):
        if not engine.step():
            break
    assert engine.check_accounting()["requests"] == 0
    engine.shutdown()
    return results


@pytest.mark.parametrize(
    "bad",
    [
        SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1e-40),
        SamplingParams(
            max_new_tokens=6, ignore_eos=True, temperature=1.0, repetition_penalty=1e-39
        ),
    ],
    ids=["temperature=1e-40", "repetition_penalty=1e-39"],
)
def test_a_degenerate_co_batched_request_leaves_the_other_untouched(tiny, bad) -> None:
    prompt = prompt_of(21, 9)
    normal = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=7)
    alone = run_together(tiny, [GenerateRequest("good", prompt, normal)])
    both = run_together(
        tiny,
        [GenerateRequest("good", prompt, normal), GenerateRequest("bad", prompt_of(22, 7), bad)],
    )
    assert both["good"] == alone["good"] and len(alone["good"]) == 6
    final = both["bad/final"]
    assert isinstance(final, RequestOutput) and final.error is None
    assert len(both["bad"]) == 6
    if bad.temperature < 1e-6:  # as greedy as temperature 0
        greedy = replace(bad, temperature=0.0)
        assert (
            both["bad"]
            == run_together(tiny, [GenerateRequest("bad", prompt_of(22, 7), greedy)])["bad"]
        )


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    from pdcache.engine.sampler import SampleRow, make_generator, sample_rows

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1] = float("-inf")  # nothing to draw from
    params = SamplingParams(temperature=0.7, seed=1)
    rows = [SampleRow(params, make_generator(b)) for b in range(3)]
    result = sample_rows(logits, rows)
    assert set(result.errors) == {1} and "sampling failed" in result.errors[1]
    alone = sample_rows(logits[[0, 2]], [SampleRow(params, make_generator(b)) for b in (0, 2)])
    assert [result.tokens[0], result.tokens[2]] == alone.tokens


class RecordingHoldRole(HoldingRole):
    """Holds every finished request and records the prompt pages it hands out (what a
    prefill node gives its KV sender to read)."""

    def __init__(self) -> None:
        self.handed: dict[str, list[int]] = {}

    def hold_after_finish(self, req) -> bool:
        self.handed[req.rid] = list(req.page_ids[: len(req.prompt_ids) // PAGE])
        return super().hold_after_finish(req)


def test_caching_a_held_leaders_prompt_keeps_its_handed_pages_intact(tiny) -> None:
    """A follower makes the scheduler cache a held leader's prompt after an equal prompt
    reached the tree: the leader's own pages are duplicates then, but a reader still has them,
    so they are freed only when the leader is released (not reused by the next request)."""
    prompt = prompt_of(14, 14)  # 3 full pages + 2 tokens
    role = RecordingHoldRole()
    engine = held_engine(tiny, role)
    finals: dict[str, RequestOutput] = {}
    collect = finals_of(finals)

    def drain() -> None:
        for _ in range(50):
            if not engine.step():
                break

    first = SamplingParams(max_new_tokens=1)
    engine.submit(GenerateRequest("twin", prompt, first), collect)
    engine.submit(GenerateRequest("lead", prompt, first), collect)
    drain()
    assert finals["lead"].computed_tokens == finals["twin"].computed_tokens == 14
    handed = role.handed["lead"]
    before = engine.pool.device_kv[:, :, handed].clone()
    engine.release_held("twin")  # the tree now has the prompt's pages: lead's are duplicates
    engine.submit(GenerateRequest("f1", prompt, first, prefill_leader="lead"), collect)
    drain()
    assert finals["f1"].cached.total == 12
    # a new prompt takes whatever pages are free and writes them
    engine.submit(GenerateRequest("other", prompt_of(15, 120), first), collect)
    drain()
    assert torch.equal(engine.pool.device_kv[:, :, handed], before)
    held = engine.check_accounting()["requests"]
    assert held >= len(handed)  # the deferred duplicates are counted as the leader's
    for rid in ("lead", "f1", "other"):
        engine.release_held(rid)
    engine.step()
    assert engine.check_accounting()["requests"] == 0  # nothing leaked
    engine.shutdown()
