"""P→D with window pages, the engine side (docs/design.md §4.14): a decode engine keeping its
sliding layers' pages apart (`Engine(window_pages=True)`) reserves full pages for the whole
prompt and sliding pages for its window tail only (`Admission.window_page_ids`); a prefill
engine's one-space pages are copied into the two spaces by `window_tail_copy_batch` (the
address arithmetic a transfer runs: the full layers of every page, the sliding layers of the
tail); greedy decode then equals transformers', with the rest of the prompt's sliding pages
tombstones in decode's tree. The tiny gpt-oss checkpoint of `test_gpt_oss` (window 8, pages
of 4 tokens, fp32).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.engine.api import (  # noqa: E402
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
)
from pdcache.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.request import Req  # noqa: E402
from pdcache.engine.reservations import Admission  # noqa: E402
from pdcache.engine.roles import Unified  # noqa: E402
from pdcache.engine.scheduler import Scheduler  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from pdcache.transfer.layout import KVLayout, window_tail_copy_batch  # noqa: E402
from tests.engine.test_gpt_oss import PAGE, WINDOW, prompt_of, save_gpt_oss  # noqa: E402
from tests.engine.test_sliding_window_pages import assert_like_hf, hf_greedy  # noqa: E402

PROMPT = 61  # 15 full pages and a partial one
STEPS = 20  # past the window
FIRST = 1  # prefill samples the first token


class HoldingRole(Unified):
    """Prefill side: keeps every finished request's pages, remembering which they are."""

    def __init__(self) -> None:
        self.finished_pages: dict[str, list[int]] = {}

    def hold_after_finish(self, req: Req) -> bool:
        self.finished_pages[req.rid] = list(req.page_ids)
        return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss-window-tail")
    return path, save_gpt_oss(path, seed=11)


@pytest.fixture(scope="module")
def model(checkpoint) -> torch.nn.Module:
    return load_model(str(checkpoint[0]))[0]


def make_engine(model: torch.nn.Module, *, role: Unified | None = None,
                window_pages: bool = False) -> Engine:
    config = EngineConfig(model=model.config,
                          cache=CacheConfig(page_size=PAGE, num_device_pages=64),
                          scheduler=SchedulerConfig(chunked_prefill_tokens=2048),
                          kernels="torch")
    return Engine(config, model, make_scheduler=functools.partial(Scheduler, role=role),
                  window_pages=window_pages).start()


def prefill(engine: Engine, prompt: list[int]) -> tuple[int, list[int]]:
    """The first token and the held pages of `prompt` on a one-space prefill engine."""
    out = engine.generate(GenerateRequest("r", prompt, SamplingParams(max_new_tokens=1,
                                                                      temperature=0.0)), 60)
    return out[-1].new_token_ids[0], engine.scheduler.role.finished_pages["r"]


def reserve(engine: Engine, prompt: list[int], rid: str = "r") -> Admission:
    answers: list[Admission] = []
    done = threading.Event()

    def on_done(admission: Admission) -> None:
        answers.append(admission)
        done.set()

    engine.reserve_when_free(rid, len(prompt), on_done, max_new_tokens=STEPS,
                             prefix_ids=prompt[: len(prompt) // PAGE * PAGE])
    assert done.wait(30)
    assert answers[0].ok, answers[0]
    return answers[0]


def transfer(src: Engine, dst: Engine, src_pages: list[int], admission: Admission,
             tail: range) -> int:
    """Copy the pages after the decode prefix as a transfer would (`tail`: the sliding
    pages sent, as prompt page indices); the bytes written."""
    assert dst.window is not None
    first = admission.cached_pages
    src_ids = np.array(src_pages[first:])
    kinds = src.config.model.kv_geometry.layer_kinds
    batch = window_tail_copy_batch(
        KVLayout.from_tensor(src.pool.device_kv), KVLayout.from_tensor(dst.pool.device_kv),
        KVLayout.from_tensor(dst.window.pool.device_kv), kinds, src_ids,
        np.array(admission.page_ids),
        range(tail.start - first, tail.stop - first),
        np.array(admission.window_page_ids[len(admission.window_page_ids) - len(tail):]))
    for s, d, n in zip(batch.srcs.tolist(), batch.dsts.tolist(), batch.lengths.tolist()):
        ctypes.memmove(d, s, n)
    return batch.nbytes


def decode(engine: Engine, prompt: list[int], first_token: int
           ) -> tuple[list[int], list[float], list[RequestOutput]]:
    outputs: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        outputs.append(out)
        if out.finished:
            done.set()

    engine.submit_prefilled(
        GenerateRequest("r", prompt, SamplingParams(max_new_tokens=STEPS, temperature=0.0,
                                                    ignore_eos=True),
                        logprobs=LogprobRequest()),
        first_token, on_output)
    assert done.wait(60)
    assert outputs[-1].error is None, outputs[-1]
    tokens = [t for out in outputs for t in out.new_token_ids]
    # the first token's logprob is prefill's (none sent here)
    logprobs = [lp.logprob for out in outputs for lp in out.new_logprobs][FIRST:]
    return tokens, [float(lp) for lp in logprobs], outputs


def test_decode_from_the_window_tail_equals_transformers(checkpoint, model) -> None:
    _, hf = checkpoint
    prompt = prompt_of(21, PROMPT)
    src = make_engine(model, role=HoldingRole())
    dst = make_engine(model, window_pages=True)
    try:
        assert src.window is None and dst.window is not None
        first_token, src_pages = prefill(src, prompt)
        admission = reserve(dst, prompt)
        tail = dst.window.tail_pages(PROMPT)
        assert admission.cached_pages == 0 and len(admission.page_ids) == len(src_pages) == 16
        # sliding pages only for the tail: the window before the last token, up to its page
        assert admission.window_first_page == tail.start == (PROMPT - WINDOW) // PAGE
        assert len(admission.window_page_ids) == len(tail) == 3
        numbers = dst.check_accounting()
        assert numbers["requests"] == 16 and numbers["window_requests"] == 3, numbers
        sent = transfer(src, dst, src_pages, admission, tail)
        geometry = model.config.kv_geometry
        slab = geometry.slab_page_bytes(PAGE)
        full, sliding = geometry.layer_kinds.count("full"), geometry.layer_kinds.count("sliding")
        assert sent == 2 * slab * (full * 16 + sliding * 3)  # vs 2·slab·(full+sliding)·16
        src.release_held("r")
        tokens, logprobs, outputs = decode(dst, prompt, first_token)
        assert tokens[0] == first_token == hf_greedy(hf, prompt, 1)[0][0]
        assert_like_hf(hf, prompt + [first_token], tokens[FIRST:], logprobs)
        # decode's tree: every full page, sliding pages only where a window still needs them
        numbers = dst.check_accounting()
        assert numbers["requests"] == 0 and numbers["window_requests"] == 0, numbers
        assert numbers["window_tree"] < numbers["tree"], numbers
        dst.flush_cache()
        numbers = dst.check_accounting()
        assert numbers["free"] == numbers["capacity"], numbers
        assert numbers["window_free"] == numbers["window_capacity"], numbers
    finally:
        src.shutdown()
        dst.shutdown()


def test_without_the_tails_first_page_decode_differs(checkpoint, model) -> None:
    """Protection off: a tail one page short (the window's oldest tokens never sent) reads
    an unwritten sliding page, and the first decoded token's logits move."""
    _, hf = checkpoint
    prompt = prompt_of(21, PROMPT)
    src = make_engine(model, role=HoldingRole())
    dst = make_engine(model, window_pages=True)
    try:
        first_token, src_pages = prefill(src, prompt)
        admission = reserve(dst, prompt)
        assert dst.window is not None
        tail = dst.window.tail_pages(PROMPT)
        short = Admission(admission.rid, admission.page_ids,
                          window_page_ids=admission.window_page_ids[1:])
        transfer(src, dst, src_pages, short, range(tail.start + 1, tail.stop))
        src.release_held("r")
        _, logprobs, _ = decode(dst, prompt, first_token)
        _, expected = hf_greedy(hf, prompt + [first_token], 1)
        assert abs(logprobs[0] - expected[0]) > 1e-3
    finally:
        src.shutdown()
        dst.shutdown()


def test_a_released_reservation_frees_its_window_tail(model) -> None:
    dst = make_engine(model, window_pages=True)
    try:
        admission = reserve(dst, prompt_of(3, 30))
        assert len(admission.window_page_ids) == 3
        assert dst.check_accounting()["window_requests"] == 3
        with pytest.raises(ValueError, match="reserve_when_free"):
            dst.reserve("other", 30)
        assert dst.release_reservation("r")
        numbers = dst.check_accounting()
        assert numbers["used"] == 0 and numbers["window_free"] == numbers["window_capacity"]
    finally:
        dst.shutdown()
