"""Topology files: parsing, --set overrides, and a table of broken files with precise errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdcache.cli import main as pdcache_main
from pdcache.config import (
    TopologyError,
    load_topology,
    parse_override_value,
    parse_size,
    parse_topology,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))

BASE = """
[model]
preset = "tiny"

[storage]
backend = "hf3fs"
metadata = "tcp://127.0.0.1:18000"

[router]
port = 8000

[[node]]
name = "p0"
role = "prefill"
port = 30001
bootstrap_port = 8998

[[node]]
name = "d0"
role = "decode"
port = 30002
offload = true
"""


def test_every_shipped_config_loads() -> None:
    assert {p.name for p in CONFIGS} >= {
        "local-1p1d.toml", "local-2p2d.toml", "local-mooncake-store.toml", "unified.toml",
        "multinode-example.toml",
    }
    for path in CONFIGS:
        topology = load_topology(path)
        assert topology.nodes, path
        assert dataclasses.is_dataclass(topology)


def test_local_1p1d_contents() -> None:
    t = load_topology(REPO / "configs/local-1p1d.toml")
    assert (t.model.preset, t.storage.backend, t.storage.io_engine) == ("small", "hf3fs", "posix")
    assert t.storage.path == "./.pdcache/storage"
    assert (t.transfer.engine, t.transfer.protocol) == ("mooncake", "tcp")
    assert t.node("d0").offload is True and t.node("p0").bootstrap_port == 8998
    assert t.storage.metadata_address == ("127.0.0.1", 18000)
    assert t.is_pd and t.router is not None
    assert t.endpoints()["p0"].url == "http://127.0.0.1:30001"
    assert t.endpoints()["router"].role == "router"


def test_2p2d_is_cache_aware_over_two_prefills() -> None:
    t = load_topology(REPO / "configs/local-2p2d.toml")
    assert t.router is not None and t.router.prefill_policy == "cache_aware"
    assert [n.name for n in t.nodes_with_role("prefill")] == ["p0", "p1"]


def test_sections_are_frozen() -> None:
    t = parse_topology(BASE, "x.toml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.model.seed = 3  # type: ignore[misc]


def test_node_cache_overrides_merge_with_global_cache() -> None:
    text = BASE.replace('[router]', '[cache]\npage_size = 32\nhost_ratio = 3.0\n\n[router]')
    text += '\n[node.cache]\nhost_bytes = "1GiB"\n'  # belongs to the last [[node]] (d0)
    t = parse_topology(text, "x.toml")
    assert t.node("p0").cache.page_size == 32 and t.node("p0").cache.host_ratio == 3.0
    d0 = t.node("d0").cache
    assert (d0.page_size, d0.host_bytes, d0.host_ratio) == (32, 2**30, None)


def test_decode_offload_defaults_to_storage_presence() -> None:
    t = parse_topology(BASE.replace("offload = true\n", ""), "x.toml")
    assert t.node("d0").offload is True
    no_storage = BASE.replace('backend = "hf3fs"', 'backend = "none"').replace("offload = true\n", "")
    assert parse_topology(no_storage, "x.toml").node("d0").offload is False


def test_set_overrides_any_key() -> None:
    t = parse_topology(BASE, "x.toml", [
        "model.preset=small", "cache.page_size=64", "node.p0.port=31001", "node.1.port=31002",
        "router.decode_policy=least_load", "transfer.devices=[\"mlx5_0\"]", "node.d0.cache.page_size=8",
    ])
    assert t.model.preset == "small" and t.cache.page_size == 64
    assert t.node("p0").port == 31001 and t.node("d0").port == 31002
    assert t.router is not None and t.router.decode_policy == "least_load"
    assert t.transfer.devices == ("mlx5_0",)
    assert t.node("d0").cache.page_size == 8 and t.node("p0").cache.page_size == 64
    assert t.overrides[0] == "model.preset=small"


def test_set_replaces_the_exclusive_twin() -> None:
    t = load_topology(REPO / "configs/multinode-example.toml", ["model.preset=tiny", "cache.host_ratio=1.5"])
    assert (t.model.preset, t.model.path) == ("tiny", None)
    assert (t.cache.host_ratio, t.cache.host_bytes) == (1.5, None)


def test_override_values_are_toml_literals_or_strings() -> None:
    assert parse_override_value("3") == 3
    assert parse_override_value("true") is True
    assert parse_override_value("1.5") == 1.5
    assert parse_override_value('["a", "b"]') == ["a", "b"]
    assert parse_override_value("tiny") == "tiny"
    assert parse_override_value("tcp://127.0.0.1:1") == "tcp://127.0.0.1:1"


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("64k") == 64_000
    assert parse_size("lots") is None
    assert parse_topology(BASE + "", "x.toml", ["storage.capacity=\"2GiB\""]).storage.capacity == 2 * 2**30


def test_prefetch_timeout_is_linear_and_capped() -> None:
    cache = parse_topology(BASE, "x.toml").cache
    assert cache.prefetch_timeout_s(1000) == pytest.approx(2.1)
    assert cache.prefetch_timeout_s(10**9) == 30.0


# A table of broken files: (name, how to break BASE, expected message fragment).
BROKEN = [
    ("missing model", lambda s: s.replace('[model]\npreset = "tiny"\n', ""), "model: missing required table [model]"),
    ("missing node port", lambda s: s.replace("port = 30002\n", ""),
     "node.d0.port: missing required key (expected an integer)"),
    ("wrong type", lambda s: s.replace("port = 30001", 'port = "30001"'),
     'node.p0.port: expected an integer, got string "30001"'),
    ("wrong bool", lambda s: s.replace("offload = true", 'offload = "yes"'),
     'node.d0.offload: expected true or false, got string "yes"'),
    ("unknown backend", lambda s: s.replace('backend = "hf3fs"', 'backend = "s3"'),
     'storage.backend: expected one of "none", "file", "hf3fs", "mooncake", got "s3"'),
    ("unknown policy", lambda s: s.replace("port = 8000", 'port = 8000\nprefill_policy = "random"'),
     "router.prefill_policy: unknown value string \"random\"; expected one of: round_robin, least_load, cache_aware"),
    ("unknown role", lambda s: s.replace('role = "decode"', 'role = "decoder"'),
     'node.d0.role: unknown value string "decoder"; expected one of: prefill, decode, unified'),
    ("port clash", lambda s: s.replace("port = 30002", "port = 30001"),
     "node.d0.port: port clash: 127.0.0.1:30001 is also used by node.p0.port"),
    ("port clash with router", lambda s: s.replace("bootstrap_port = 8998", "bootstrap_port = 8000"),
     "node.p0.bootstrap_port: port clash: 127.0.0.1:8000 is also used by router.port"),
    ("offload without storage", lambda s: s.replace('backend = "hf3fs"\nmetadata = "tcp://127.0.0.1:18000"', 'backend = "none"'),
     'node.d0.offload: decode offload needs storage: set storage.backend = "hf3fs"|"mooncake"|"file", or offload = false'),
    ("typo", lambda s: s.replace('preset = "tiny"', 'presett = "tiny"'),
     "model.presett: unknown key; did you mean 'preset'?"),
    ("unknown section", lambda s: s + "\n[routr]\nport = 1\n", "routr: unknown key; did you mean 'router'?"),
    ("no decode", lambda s: s.replace('role = "decode"', 'role = "prefill"\nbootstrap_port = 8997').replace("offload = true\n", ""),
     "node: a PD topology needs at least one prefill and one decode node; no decode node"),
    ("no nodes", lambda s: s[: s.index("[[node]]")],
     "node: missing [[node]] entries (expected at least one prefill + one decode, or one unified)"),
    ("prefill without bootstrap", lambda s: s.replace("bootstrap_port = 8998\n", ""),
     "node.p0.bootstrap_port: missing required key for role prefill"),
    ("pd without router", lambda s: s.replace("[router]\nport = 8000\n", ""),
     "router: missing [router] table: a PD topology needs a router"),
    ("shared inproc metadata", lambda s: s.replace('metadata = "tcp://127.0.0.1:18000"', 'metadata = "inproc"'),
     'storage.metadata: "inproc" metadata cannot be shared by 2 processes (p0, d0)'),
    ("bad metadata url", lambda s: s.replace("tcp://127.0.0.1:18000", "http://x"),
     'storage.metadata: expected "inproc" or "tcp://HOST:PORT", got "http://x"'),
    ("replicas on sqlite", lambda s: s.replace('"tcp://127.0.0.1:18000"',
                                               '"tcp://127.0.0.1:18000,tcp://127.0.0.1:18001"'),
     'storage.metadata: 2 metadata replicas need storage.metadata_service.store = "etcd"'),
    ("etcd without members", lambda s: s + '\n[storage.metadata_service]\nstore = "etcd"\n',
     'storage.etcd.endpoints: storage.metadata_service.store = "etcd" needs the etcd members'),
    ("a replica twice", lambda s: s.replace('"tcp://127.0.0.1:18000"',
                                            '"tcp://127.0.0.1:18000,tcp://127.0.0.1:18000"'),
     "storage.metadata: a replica address is listed twice"),
    ("preset and path", lambda s: s.replace('preset = "tiny"', 'preset = "tiny"\npath = "/m"'),
     "model: expected exactly one of preset"),
    ("duplicate name", lambda s: s.replace('name = "d0"', 'name = "p0"'), "node.p0.name: duplicate name 'p0'"),
    ("bad size", lambda s: s.replace('backend = "hf3fs"', 'backend = "hf3fs"\ncapacity = "lots"'),
     'storage.capacity: expected a size (bytes as an integer, or a string such as "4GiB"), got string "lots"'),
    ("offload on prefill", lambda s: s.replace("bootstrap_port = 8998", "bootstrap_port = 8998\noffload = true"),
     "node.p0.offload: only decode nodes offload (role is prefill)"),
    ("rdma over zmq", lambda s: s + '\n[transfer]\nengine = "zmq"\nprotocol = "rdma"\n',
     'transfer.protocol: "rdma" needs engine = "mooncake" or "nixl"'),
    ("not toml", lambda s: s + "\n[[[", "not valid TOML"),
    ("relative fault_injection", lambda s: s.replace('backend = "hf3fs"', 'backend = "hf3fs"\nfault_injection = "delay"'),
     'storage.fault_injection: expected an absolute path of the chaos control file, got "delay"'),
    ("decode pacing too long", lambda s: s + "\n[scheduler]\ndecode_step_interval_ms = 1001\n",
     "scheduler.decode_step_interval_ms: expected an integer within 0..1000, got 1001"),
    ("decode yield of 0", lambda s: s + "\n[scheduler]\ndecode_yield_max_ms = 0\n",
     "scheduler.decode_yield_max_ms: expected an integer within 1..1000, got 0"),
    ("empty compute share", lambda s: s + '\n[scheduler]\ncompute_share = ""\n',
     "scheduler.compute_share: expected a file path"),
    ("empty launch_prefix part", lambda s: s.replace("port = 30002", 'port = 30002\nlaunch_prefix = ["taskset", ""]'),
     "node.d0.launch_prefix: expected non-empty strings"),
    # the router refused these only once launched, naming no key, and was restarted until
    # the launcher gave up; a zero interval probed every node back to back
    ("no router attempt", lambda s: s.replace("port = 8000", "port = 8000\nmax_attempts = 0"),
     "router.max_attempts: expected an integer >= 1, got 0"),
    ("router probes back to back", lambda s: s.replace("port = 8000", "port = 8000\nhealth_interval_s = 0"),
     "router.health_interval_s: expected a number of seconds > 0, got 0"),
    ("router deadline nan", lambda s: s.replace("port = 8000", "port = 8000\nrequest_timeout_s = nan"),
     "router.request_timeout_s: expected a number of seconds > 0, got nan"),
    ("no node connection", lambda s: s.replace("port = 8000", "port = 8000\nmax_node_connections = 0"),
     "router.max_node_connections: expected an integer >= 1, got 0"),
    # a dotted name is two parts of a dotted key: `--set node.p.0.port=...` found no node 'p'
    ("dotted node name", lambda s: s.replace('name = "d0"', 'name = "d.0"'),
     "node.d.0.name: expected letters, digits, '_' or '-'"),
]


@pytest.mark.parametrize("name,breaker,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_file_gives_precise_message_and_exit_2(name, breaker, message, tmp_path, capsys) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(breaker(BASE))
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: "), str(info.value)
    assert message in str(info.value)
    assert pdcache_main(["launch", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"pdcache launch: error: {path}: " in err and message in err


def test_base_itself_is_valid() -> None:
    parse_topology(BASE, "x.toml")


@pytest.mark.parametrize("override,message", [
    ("node.p9.port=1", "node.p9.port: no node named or numbered 'p9' (nodes: p0, d0)"),
    ("model.presett=tiny", "model.presett: unknown key; did you mean 'preset'? (from --set)"),
    ("cache.page_size=big", 'cache.page_size: expected an integer, got string "big" (from --set)'),
    ("noequals", "noequals: a --set override must look like KEY=VALUE"),
])
def test_bad_overrides(override: str, message: str, tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(BASE)
    with pytest.raises(TopologyError, match=None) as info:
        load_topology(path, [override])
    assert message in str(info.value)
    assert pdcache_main(["launch", str(path), "--set", override, "--dry-run"]) == 2


def test_missing_file_is_exit_2(tmp_path, capsys) -> None:
    assert pdcache_main(["launch", str(tmp_path / "nope.toml"), "--dry-run"]) == 2
    assert "cannot read the file" in capsys.readouterr().err


def test_unified_with_pd_is_rejected() -> None:
    text = BASE + '\n[[node]]\nname = "u0"\nrole = "unified"\nport = 30009\n'
    with pytest.raises(TopologyError, match="unified nodes cannot be mixed"):
        parse_topology(text, "x.toml")


def _node_args(*argv: str):
    import argparse

    from pdcache.config import add_topology_arguments

    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    return parser.parse_args(list(argv))


def test_node_reads_its_own_settings(tmp_path) -> None:
    from pdcache.config import node_from_args, router_from_args

    path = tmp_path / "t.toml"
    path.write_text(BASE)
    topology, node = node_from_args(_node_args("--config", str(path), "--node", "d0",
                                               "--set", "node.d0.port=31999"), ["decode"])
    assert (node.name, node.port, node.offload) == ("d0", 31999, True)
    assert topology.endpoints()["p0"].bootstrap_port == 8998
    assert node_from_args(_node_args(), ["decode"]) is None
    with pytest.raises(TopologyError, match="node.p0.role: is prefill, but this command runs decode nodes"):
        node_from_args(_node_args("--config", str(path), "--node", "p0"), ["decode"])
    with pytest.raises(TopologyError, match=r"--node p9: no such node \(nodes: p0, d0\)"):
        node_from_args(_node_args("--config", str(path), "--node", "p9"), ["decode"])
    with pytest.raises(TopologyError, match="--node NAME is required"):
        node_from_args(_node_args("--config", str(path)), ["decode"])
    _, router = router_from_args(_node_args("--config", str(path), "--node", "router"))
    assert router.url == "http://127.0.0.1:8000"


def test_chaos_keys_parse_and_default_off() -> None:
    """`storage.fault_injection` and `launch_prefix` are off unless a topology sets them."""
    plain = parse_topology(BASE, "x.toml")
    assert plain.storage.fault_injection == "" and all(not n.launch_prefix for n in plain.nodes)
    topology = parse_topology(BASE, "x.toml", [
        'storage.fault_injection="/run/chaos/delay"',
        'node.p0.launch_prefix=["nsenter", "--net=/run/netns/a", "--"]'])
    assert topology.storage.fault_injection == "/run/chaos/delay"
    assert topology.node("p0").launch_prefix == ("nsenter", "--net=/run/netns/a", "--")
    assert topology.node("d0").launch_prefix == ()


def test_a_storage_backend_a_plugin_registered_is_a_valid_topology_value(tmp_path) -> None:
    """The backend names come from the registry (pdcache.offload_manager.storage.BACKENDS),
    not from a copied list: a name registered by a plugin is accepted, and the refusal of an
    unknown one lists it."""
    from pdcache.offload_manager.storage import BACKENDS

    text = BASE.replace('backend = "hf3fs"', 'backend = "s3"')
    with pytest.raises(TopologyError, match='got "s3"'):
        parse_topology(text, "t.toml")
    BACKENDS.register("s3", "tests.storage_doubles:DictBackend")
    try:
        topology = parse_topology(text, "t.toml")
        assert topology.storage.backend == "s3"
        with pytest.raises(TopologyError, match='"s3", got "s4"'):
            parse_topology(text.replace('"s3"', '"s4"'), "t.toml")
    finally:
        BACKENDS.unregister("s3")

