"""`pdcache chaos` end to end: a short seeded soak of a real 1P1D tiny-preset topology
(`pdcache launch`, router, prefill, decode) with every process fault this machine supports,
asserting every invariant from the JSON it writes. The hf3fs soak kills prefill, decode and
the metadata service and freezes a node; the Mooncake Store soak kills `mooncake_master`
(the two services never run in one topology). The hybrid soak runs the hf3fs topology with
the tiny Qwen3-Next preset: corrupt state objects, slow state writes, a killed decode."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.offload_manager.storage.etcd_cluster import free_port_pairs
from tests.net_support import free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _hf3fs(tmp_path: Path) -> tuple[str, list[str]]:
    router, p0, boot, d0, meta = free_ports(5)
    return "configs/local-1p1d.toml", [
        f"router.port={router}",
        f"node.p0.port={p0}",
        f"node.p0.bootstrap_port={boot}",
        f"node.d0.port={d0}",
        f'storage.metadata="tcp://127.0.0.1:{meta}"',
        f'storage.path="{tmp_path / "storage"}"',
        f'storage.metadata_service.state_dir="{tmp_path / "meta"}"',
        'storage.capacity="256MiB"',
    ]


def _hf3fs_hybrid(tmp_path: Path) -> tuple[str, list[str]]:
    """The hf3fs soak's topology serving a hybrid model (Qwen3-Next: recurrent-state
    checkpoints as stored objects in their own slot pool)."""
    config, overrides = _hf3fs(tmp_path)
    return config, [*overrides, "model.preset=tiny-qwen3-next", "storage.state_capacity=512"]


def _mooncake(tmp_path: Path) -> tuple[str, list[str]]:
    router, p0, boot, d0, master, http, metrics = free_ports(7)
    return "configs/local-mooncake-store.toml", [
        f"router.port={router}",
        f"node.p0.port={p0}",
        f"node.p0.bootstrap_port={boot}",
        f"node.d0.port={d0}",
        f'storage.mooncake.master="127.0.0.1:{master}"',
        f'storage.mooncake.metadata_server="http://127.0.0.1:{http}/metadata"',
        f"storage.mooncake.metrics_port={metrics}",
        'storage.mooncake.global_segment_size="128MiB"',
    ]


def _hf3fs_ha(tmp_path: Path) -> tuple[str, list[str]]:
    etcd_ports = free_port_pairs(3)  # a member's peer port is its client port + 1
    taken = {p + d for p in etcd_ports for d in (0, 1)}
    ports = [p for p in free_ports(16) if p not in taken][:8]
    router, p0, boot0, p1, boot1, d0, meta0, meta1 = ports
    members = [f"127.0.0.1:{port}" for port in etcd_ports]
    return "configs/local-ha.toml", [
        f"router.port={router}",
        f"node.p0.port={p0}",
        f"node.p0.bootstrap_port={boot0}",
        f"node.p1.port={p1}",
        f"node.p1.bootstrap_port={boot1}",
        f"node.d0.port={d0}",
        f'storage.metadata="tcp://127.0.0.1:{meta0},tcp://127.0.0.1:{meta1}"',
        f"storage.etcd.endpoints={json.dumps(members)}",
        f'storage.etcd.data_dir="{tmp_path / "etcd"}"',
        f'storage.path="{tmp_path / "storage"}"',
        'storage.capacity="256MiB"',
        "storage.metadata_service.lease_ttl_s=2",
    ]


# Kinds every machine runs (no root needed): a soak must inject these, whatever it lacks.
NEED_NO_PRIVILEGE = {"kill-prefill", "kill-decode", "kill-metadata", "freeze-node",
                     "storage-corrupt", "storage-slow", "kill-mooncake-master",
                     "kill-store-leader", "freeze-store-leader", "kill-metadata-leader",
                     "freeze-metadata-leader"}

WARMUP_S = 3
SOAKS = {
    # kinds, duration, quiet tail, mean gap. The plan's first round injects every kind once,
    # one per slot of min(duration - warmup - tail, kinds x mean gap) (schedule.py); each
    # span here is that first round and nothing more, so every kind strikes exactly once
    # (as in the 60 s soak this replaces, whose plan was also its first round alone). With
    # seed 3 the last kill (kill-decode at 22 s) has 24 s of traffic after it, as the 60 s
    # soak's last kill had: the slowest recoveries seen on a loaded 2-core machine (a
    # restarted metadata service 25 s, prefill 20 s to the next success) still end under
    # load, and every asserted error window stays under the duration. storage-full and
    # net-partition need root (mounts, namespaces): where CI lacks it they are reported in
    # faults_unavailable with the reason, and the rest still run.
    "hf3fs": (_hf3fs, ["kill-prefill", "kill-decode", "kill-metadata", "freeze-node",
                       "storage-full", "storage-corrupt", "storage-slow", "net-partition"],
              46, 20, 3.0),
    "mooncake": (_mooncake, ["kill-mooncake-master"], 14, 7, 4.0),
    # a hybrid model: corrupt state objects are refused, slow state writes are waited for by
    # the next turn, a killed decode's announced states are forgotten; no state slot leaks
    "hf3fs-hybrid": (_hf3fs_hybrid, ["storage-corrupt", "storage-slow", "kill-decode"],
                     24, 10, 3.0),
    # 2 prefill + 1 decode on hf3fs whose metadata runs on 2 replicas over 3 etcd members:
    # the leader of each is killed and frozen (a frozen one past its lease / election)
    "hf3fs-ha": (_hf3fs_ha, ["kill-store-leader", "freeze-store-leader", "kill-metadata-leader",
                             "freeze-metadata-leader"], 32, 12, 3.0),
}


@pytest.mark.parametrize("name", list(SOAKS))
def test_seeded_soak_keeps_every_invariant(tmp_path: Path, name: str) -> None:
    topology, kinds, duration, tail, mean_gap = SOAKS[name]
    if name == "hf3fs-ha" and (shutil.which("etcd") is None or find_spec("etcd3gw") is None):
        pytest.skip("etcd or etcd3gw is not installed (scripts/setup.sh installs both)")
    if (
        name == "mooncake"
        and shutil.which("mooncake_master") is None
        and not (Path(__import__("sys").executable).parent / "mooncake_master").exists()
    ):
        pytest.skip("mooncake_master is not installed")
    config, overrides = topology(tmp_path)
    out = tmp_path / "out"
    argv = [
        "bench",
        "chaos",
        str(ROOT / config),
        "--set",
        "model.preset=tiny",
        "--set",
        "cache.device_pages=512",
        *(a for o in overrides for a in ("--set", o)),
        "--duration",
        str(duration),
        "--quiet-tail",
        str(tail),
        "--warmup",
        str(WARMUP_S),
        "--mean-gap",
        str(mean_gap),
        "--faults",
        ",".join(kinds),
        "--seed",
        "3",
        "--concurrency",
        "3",
        "--hold",
        "2",
        "5",
        "--out",
        str(out),
        "--request-deadline",
        "90",
        "--progress-interval",
        "10",
    ]
    code = pdcache_main(argv)
    v = json.loads((out / "chaos.json").read_text())
    assert v["broken"] == [] and code == 0, (v["broken"], v["replay"])
    # each invariant, from the JSON
    assert v["wrong_tokens"] == 0 and v["unanswered"] == 0
    assert v["requests_ok"] > 20 and v["oracle_checked"] == v["requests_ok"]
    nodes = {"p0", "p1", "d0"} if name == "hf3fs-ha" else {"p0", "d0"}
    assert set(v["leaked_pages"]) == nodes == set(v["leaked_rooms"])
    assert all(n == 0 for n in (*v["leaked_pages"].values(), *v["leaked_rooms"].values()))
    assert set(v["leaked_states"]) == nodes and not any(v["leaked_states"].values())
    unavailable = v["faults_unavailable"]
    assert set(v["faults"]) | set(unavailable) == set(kinds), (v["faults"], unavailable)
    assert NEED_NO_PRIVILEGE & set(kinds) <= set(v["faults"]), unavailable
    for kind, row in v["faults"].items():
        assert row["injected"] >= 1 and row["injected"] == row["planned"], (kind, row)
        assert row["unrecovered"] == 0 and row["errors"] == 0, (kind, row)
        assert 0 < row["max_error_window_s"] < duration, (kind, row)
    assert "--seed 3" in v["replay"] and "--faults " + ",".join(kinds) in v["replay"]
    if name == "hf3fs-hybrid":  # the corruption hit state objects, not only pages
        corrupt = next(r["detail"] for r in v["fault_records"] if r["kind"] == "storage-corrupt")
        assert "(0 of them states)" not in corrupt, corrupt
