"""The Grafana dashboard and the Prometheus alert rules (deploy/) against a real Prometheus
(Debian's `prometheus` package, installed by scripts/setup.sh) scraping a running 1P1D stack
and its router under a short session: `promtool check rules` passes, and every panel's and
every rule's query returns data (a rule's expression without its threshold)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdcache.engine.loader import load_model
from pdcache.router.app import create_app
from pdcache.router.config import RouterConfig
from pdcache.router.nodes import NodeEndpoint
from tests.net_support import free_ports
from tests.pd_harness import node_setups, run_session, start_stack
from tests.router_support import RouterUnderTest
from tests.transfer_support import scaled_limit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdcache.json"
RULES = ROOT / "deploy" / "prometheus" / "pdcache-alerts.yml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
PAGE = 4

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="needs Debian's prometheus package (scripts/setup.sh installs it as root)")


def panel_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def rule_queries() -> list[str]:
    """Each rule's expression without its comparison: what must have data for it to judge."""
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    return [re.split(r"\s(?:==|!=|>=|<=|>|<)\s", r["expr"])[0] for r in rules]


@needs_prometheus
def test_promtool_accepts_the_rules() -> None:
    proc = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rule_queries())} rules found" in proc.stdout


def test_the_dashboard_is_grafana_json_with_a_query_per_panel() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    assert all(panel["targets"] and all(t["expr"] for t in panel["targets"])
               for panel in dashboard["panels"])
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("tier", "ttft", "inter-token", "queue", "transfer", "storage", "write-back"):
        assert topic in titles, topic


class Prometheus:
    """A real Prometheus on a free loopback port scraping `targets` (job -> url) every 1 s."""

    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": job, "static_configs": [
                      {"targets": [url.removeprefix("http://")]}]} for job, url in targets.items()]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = answer.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def wait(self, expr: str, timeout_s: float) -> bool:
        """Until `expr` has a result (Prometheus up, scrapes in); False at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.query(expr):
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@needs_prometheus
def test_every_panel_and_rule_query_returns_data_from_a_live_stack(tmp_path: Path) -> None:
    model, _ = load_model("tiny", seed=0)
    prefill, decode = node_setups(tmp_path, model, PAGE, "zmq", offload=True)
    stack = start_stack(prefill, decode)
    nodes = (NodeEndpoint("p0", "prefill", stack.prefill.url, stack.bootstrap),
             NodeEndpoint("d0", "decode", stack.decode.url))
    router = RouterUnderTest(create_app(RouterConfig(nodes=nodes, page_size=PAGE,
                                                     request_timeout_s=60)))
    prometheus = None
    try:
        with router as client:
            targets = {"prefill": stack.prefill.url, "decode": stack.decode.url,
                       "router": str(client.base_url).rstrip("/")}
            prometheus = Prometheus(tmp_path, targets)
            assert prometheus.wait('count(up == 1) == 3', scaled_limit(30)), "scrapes"
            # traffic between two scrapes at least, through the router and node to node
            first = [(7 * i + 3) % 250 for i in range(30)]
            run_session(stack, first, [[5, 6, 7, 8, 9]], 16)
            body = {"input_ids": first, "sampling_params": {"max_new_tokens": 8}}
            assert client.post("/generate", json=body).status_code == 200
            assert prometheus.wait("sum(pdcache_router_requests_total) > 0", scaled_limit(20))
            time.sleep(2.5)  # two more scrapes: every rate() sees the increase
            empty = [q for q in panel_queries() + rule_queries() if not prometheus.query(q)]
            assert not empty, "queries without data:\n" + "\n".join(empty)
    finally:
        if prometheus is not None:
            prometheus.stop()
        stack.close()
