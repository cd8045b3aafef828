"""SGLang's service endpoints on real prefill and decode nodes (zmq transfer, tiny preset):
`/server_info` says the disaggregation mode and, on prefill, the bootstrap port; a 1-token
`/health_generate` and `/flush_cache` work on both roles; the PD queue gauges carry the role."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdcache.engine.loader import load_model
from tests.pd_harness import node_setups, start_stack

PAGE = 4


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def sched(role: str) -> tuple[tuple[str, str], ...]:
    labels = {"model_name": "pdcache-tiny", "engine_type": role, "tp_rank": "0", "pp_rank": "0",
              "moe_ep_rank": "0"}
    return tuple(sorted(labels.items()))


def test_pd_nodes_answer_sglang_service_endpoints(tmp_path) -> None:
    model, _ = load_model("tiny", seed=0)
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=False)
    stack = start_stack(prefill, decode)
    try:
        p_info = httpx.get(f"{stack.prefill.url}/server_info", timeout=30).json()
        d_info = httpx.get(f"{stack.decode.url}/get_server_info", timeout=30).json()
        assert p_info["disaggregation_mode"] == "prefill" and p_info["role"] == "prefill"
        assert p_info["disaggregation_bootstrap_port"] == prefill.bootstrap_port
        assert p_info["disaggregation_bootstrap_addr"] == stack.bootstrap
        assert p_info["disaggregation_transfer_backend"] == "zmq"
        assert p_info["enable_hierarchical_cache"] is True and p_info["page_size"] == PAGE
        assert d_info["disaggregation_mode"] == "decode"
        assert "disaggregation_bootstrap_port" not in d_info
        assert d_info["disable_radix_cache"] is True
        model_info = httpx.get(f"{stack.prefill.url}/get_model_info", timeout=30).json()
        assert model_info["disaggregation_mode"] == "prefill"
        prompt = [(3 * i + 2) % 250 for i in range(26)]
        _, answer = stack.generate(prompt, 5)
        assert len(answer["output_ids"]) == 5
        for url in (stack.prefill.url, stack.decode.url):
            assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
            r = httpx.post(f"{url}/flush_cache", params={"timeout": 10}, timeout=60)
            assert r.status_code == 200 and r.text.startswith("Cache flushed."), r.text
        assert stack.prefill_server.engine.stats()["cached_pages"] == 0
        p_metrics, d_metrics = scrape(stack.prefill.url), scrape(stack.decode.url)
        assert p_metrics[("sglang:num_prefill_inflight_queue_reqs", sched("prefill"))] == 0
        assert d_metrics[("sglang:num_decode_prealloc_queue_reqs", sched("decode"))] == 0
        decoded = ("sglang:generation_tokens_total",
                   (("engine_type", "decode"), ("is_streaming", "false"),
                    ("model_name", "pdcache-tiny")))
        assert d_metrics[decoded] == 5
        stack.prefill_server.engine.check_accounting()
        stack.decode_server.engine.check_accounting()
    finally:
        stack.close()
