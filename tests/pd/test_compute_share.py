"""A prefill and a decode node on one compute share ([scheduler] compute_share, docs/design.md
§4.13), over real HTTP and a real KV transfer: the prefill node announces its prefill work,
the decode node holds its decode steps while some engine announces, and both export it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdcache.engine.compute_share import ComputeShare
from tests.pd_harness import UnifiedReference, metric_value, node_setups, start_stack

PAGE = 4
ANSWER = 6


@pytest.fixture(scope="module")
def tiny():
    from pdcache.engine.loader import load_model

    return load_model("tiny", seed=0)


def _shared(setup, path: str):
    scheduler = replace(setup.engine.scheduler, compute_share=path, decode_yield_max_ms=50)
    return replace(setup, engine=replace(setup.engine, scheduler=scheduler))


def test_pd_nodes_on_a_compute_share_announce_yield_and_export_it(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    path = str(tmp_path / "compute.share")
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=False)
    stack = start_stack(_shared(prefill, path), _shared(decode, path))
    reference = UnifiedReference(model, tokenizer, PAGE)
    other = ComputeShare(path)  # a third engine on the host, computing prefill throughout
    try:
        prompt = [(7 * i + 3) % 250 for i in range(37)]
        _, quiet = stack.generate(prompt, ANSWER)
        other.announce(True)
        _, held = stack.generate(prompt[:-3], ANSWER)
        other.announce(False)
        p_metrics = stack.client.get(f"{stack.prefill.url}/metrics").text
        d_metrics = stack.client.get(f"{stack.decode.url}/metrics").text
        expected = [reference(prompt, ANSWER), reference(prompt[:-3], ANSWER)]
    finally:
        other.close()
        stack.close()
        reference.close()
    assert quiet["output_ids"] == expected[0]
    assert held["output_ids"] == expected[1]
    # prefill computed two prompts under its announcement; decode was never held by it (its
    # steps came after prefill's batch), but by the other engine's, every decode step of the
    # second request, each let through at the 50 ms bound
    assert metric_value(p_metrics, "pdcache_compute_share_busy_seconds_total") > 0
    assert metric_value(d_metrics, "pdcache_decode_yielded_steps_total") >= ANSWER - 1
    assert metric_value(d_metrics, "pdcache_decode_yielded_seconds_total") >= (
        (ANSWER - 1) * 0.9 * 0.05)
