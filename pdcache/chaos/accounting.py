"""Each node's own accounting once the stack is idle: what it still holds that nothing uses.

Read from the node's `/health` (the engine's page counters, the transfer rooms, the PD
controller's `pd_rooms_open` / `pd_held`) and `/metrics` (HiCache host pages in flight, the
decode offload's staging pages):

- `leaked_pages` = device pages in use that eviction could not free (`pages_used -
  pages_evictable`: pages of requests, reservations, held requests, locked tree nodes) + host
  pages still in flight + host pages held outside the radix tree (`pdcache_host_pages_outside_
  tree`: USED pages no tree node holds, i.e. orphans, stream-deferred frees or a leak, and
  node pages still pinned) + decode staging pages in use;
- `leaked_rooms` = transfer rooms still active + PD rooms the controller has not closed;
- `leaked_states` (hybrid models, docs/design.md §4.14; 0 for others) = device recurrent-state
  slots neither free nor a tree checkpoint (`state_slots_total - state_slots_free -
  state_checkpoints`: slots of requests or pending decode checkpoints) + host state slots
  still pinned by a write (`pdcache_state_host_slots{state="pinned"}`).

An idle node has 0 of all three. Some of it drains asynchronously (offload writes, abort acks), so
`settle` polls until every node reads 0 or the deadline passes, and keeps the last reading.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

OUTSIDE_TREE = "pdcache_host_pages_outside_tree"


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0.0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += float(sample.value)
    return total


def node_accounting(health: Mapping[str, Any], metrics: str) -> dict[str, Any]:
    """leaked_pages, leaked_rooms and what they are made of, from one /health + /metrics."""
    engine = health.get("engine", {})
    rooms = (health.get("transfer") or {}).get("rooms") or {}
    detail = {
        "device_pages_unevictable": int(engine.get("pages_used", 0))
        - int(engine.get("pages_evictable", 0)),
        "host_pages_in_flight": int(metric_sum(metrics, "pdcache_host_pages", state="in_flight")),
        **{
            f"host_pages_{held}": int(metric_sum(metrics, OUTSIDE_TREE, held=held))
            for held in ("untracked", "pinned_in_tree", "abandoned_prefetch", "stream_deferred")
        },
        "staging_pages_used": int(metric_sum(metrics, "pdcache_decode_offload_staging_pages_used")),
        "transfer_rooms_active": int(rooms.get("active", 0)),
        "pd_rooms_open": int(health.get("pd_rooms_open", 0)),
        "pd_held": int(health.get("pd_held", 0)),
        "requests_running": int(engine.get("num_running", 0)) + int(engine.get("queued", 0)),
        "device_state_slots_held": int(engine.get("state_slots_total", 0))
        - int(engine.get("state_slots_free", 0)) - int(engine.get("state_checkpoints", 0)),
        "host_state_slots_pinned": int(
            metric_sum(metrics, "pdcache_state_host_slots", state="pinned")),
    }
    pages = (
        detail["device_pages_unevictable"]
        + detail["host_pages_in_flight"]
        + detail["host_pages_untracked"]  # abandoned/stream-deferred pages are in these two
        + detail["host_pages_pinned_in_tree"]
        + detail["staging_pages_used"]
    )
    return {
        "leaked_pages": pages,
        "leaked_rooms": detail["transfer_rooms_active"] + detail["pd_rooms_open"],
        "leaked_states": detail["device_state_slots_held"] + detail["host_state_slots_pinned"],
        "detail": detail,
    }


def read_node(client: httpx.Client, url: str) -> dict[str, Any]:
    try:
        health = client.get(f"{url}/health")
        metrics = client.get(f"{url}/metrics")
        health.raise_for_status()
        metrics.raise_for_status()
        return node_accounting(health.json(), metrics.text)
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def clean(reading: Mapping[str, Any]) -> bool:
    return "error" not in reading and not any(
        reading[leak] for leak in ("leaked_pages", "leaked_rooms", "leaked_states"))


def settle(
    nodes: Mapping[str, str], timeout_s: float, token: str | None = None, poll_s: float = 1.0
) -> dict[str, dict[str, Any]]:
    """Every node's accounting, polled until all read clean or `timeout_s` passes; the last
    reading of each (with `settle_s`, how long it took)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    start = time.monotonic()
    with httpx.Client(timeout=10.0, headers=headers) as client:
        while True:
            readings = {name: read_node(client, url) for name, url in nodes.items()}
            waited = time.monotonic() - start
            if all(clean(r) for r in readings.values()) or waited >= timeout_s:
                for reading in readings.values():
                    reading["settle_s"] = round(waited, 2)
                return readings
            time.sleep(poll_s)


def pd_nodes(
    topology: Any, roles: Sequence[str] = ("prefill", "decode", "unified")
) -> dict[str, str]:
    """name -> URL of every node with an HTTP endpoint."""
    return {n.name: n.url for n in topology.nodes if n.role in roles and n.health == "http"}
