"""`pdcache.config`: one setup path for flags and topology files, the node keys that moved into
the topology, argparse choices from the registries, the kernel backend from the config."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from pdcache.config import (
    ApiSettings,
    CacheSpec,
    OffloadSettings,
    TopologyError,
    TransferSpec,
    add_node_flags,
    add_topology_arguments,
    node_from_args,
    parse_topology,
    process_environment,
    setup_for,
    topology_from_flags,
)
from pdcache.engine.loader import load_model_config
from pdcache.engine.page_keys import KEY_SCHEMES
from pdcache.engine.scheduler_config import SchedulerConfig
from pdcache.kernels.dispatch import KERNEL_BACKENDS
from pdcache.offload_manager.hicache import PREFETCH_POLICIES, WRITE_POLICIES
from pdcache.offload_manager.storage import BACKENDS as STORAGE_BACKENDS
from pdcache.transfer.config import TransferConfig
from pdcache.transfer.engines.base import ENGINES

MODEL = load_model_config("tiny")

PD = """
[model]
preset = "tiny"

[cache]
page_size = 16
device_pages = 128
{cache}

[storage]
backend = "hf3fs"
path = "{path}"
metadata = "tcp://127.0.0.1:18000"

[transfer]
engine = "zmq"
timeout_s = 7.5

[router]
port = 8000

[[node]]
name = "p0"
role = "prefill"
port = 31001
bootstrap_port = 8998
{prefill}

[[node]]
name = "d0"
role = "decode"
port = 31002
{decode}
"""

UNIFIED = """
[model]
preset = "tiny"

[cache]
device_pages = 128
{cache}

[[node]]
name = "u0"
role = "unified"
port = 31000
{node}
"""


def parser_for(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    add_node_flags(parser, role)
    return parser


def from_flags(role: str, *argv: str):
    args = parser_for(role).parse_args(list(argv))
    return setup_for(topology_from_flags(args, role), args.name, MODEL)


def pd(tmp_path: Path, cache: str = "", prefill: str = "", decode: str = "", overrides=()):
    text = PD.format(path=tmp_path / "s", cache=cache, prefill=prefill, decode=decode)
    return parse_topology(text, "t.toml", overrides)


def storage_flags(tmp_path: Path) -> list[str]:
    return ["--storage-backend", "hf3fs", "--storage-path", str(tmp_path / "s"),
            "--storage-metadata", "tcp://127.0.0.1:18000", "--page-size", "16",
            "--device-pages", "128"]


def test_prefill_from_flags_equals_prefill_from_topology(tmp_path: Path) -> None:
    flags = from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                       "--transfer-engine", "zmq", "--transfer-timeout", "7.5",
                       "--request-timeout", "30", "--write-policy", "write_back",
                       *storage_flags(tmp_path))
    topo = setup_for(pd(tmp_path, cache='write_policy = "write_back"',
                        prefill="request_timeout_s = 30"), "p0", MODEL)
    assert flags == topo
    assert flags.server == ApiSettings(request_timeout_s=30.0) and flags.tiers.hicache.write_policy == "write_back"
    assert flags.tiers.host_pages == 256  # 2 x the device pool, as before
    assert (flags.transfer.bootstrap_timeout_s, flags.transfer.room_timeout_s) == (7.5, 30.0)


def test_decode_from_flags_equals_decode_from_topology(tmp_path: Path) -> None:
    flags = from_flags("decode", "--name", "d0", "--port", "31002", "--transfer-engine", "zmq",
                       "--transfer-timeout", "7.5", "--offload-staging-pages", "64",
                       "--offload-stride-pages", "2", "--kernels", "torch", *storage_flags(tmp_path))
    topo = setup_for(pd(tmp_path, decode="offload_staging_pages = 64\noffload_stride_pages = 2\n"
                                         'kernels = "torch"'), "d0", MODEL)
    assert flags == topo
    assert flags.offload == OffloadSettings(staging_pages=64, stride_pages=2)
    assert flags.engine.kernels == "torch" and flags.tiers is None
    assert flags.engine.cache.enable_prefix_cache  # decode's prefix cache, on by default
    off = from_flags("decode", "--name", "d0", "--port", "31002", "--transfer-engine", "zmq",
                     "--no-prefix-cache", *storage_flags(tmp_path))
    assert not off.engine.cache.enable_prefix_cache
    no_offload = from_flags("decode", "--no-offload", "--transfer-engine", "zmq",
                            *storage_flags(tmp_path))
    assert no_offload.offload is None
    assert setup_for(pd(tmp_path, decode="offload = false"), "d0", MODEL).offload is None


def test_unified_from_flags_equals_unified_from_topology(tmp_path: Path) -> None:
    flags = from_flags("unified", "--name", "u0", "--port", "31000", "--device-pages", "128",
                       "--max-running", "8", "--max-queued", "9", "--chunked-prefill-tokens", "512")
    text = UNIFIED.format(cache="host_pages = 0", node="[node.scheduler]\nmax_running_requests = 8\n"
                          "max_queued_requests = 9\nchunked_prefill_tokens = 512")
    topo = setup_for(parse_topology(text, "u.toml"), "u0", MODEL)
    assert flags == topo
    assert flags.tiers is None and flags.transfer is None  # no host tier, no storage: plain engine
    assert flags.engine.scheduler == SchedulerConfig(8, 512, 9)
    hosted = from_flags("unified", "--host-pages", "40")
    assert hosted.tiers.host_pages == 40 and hosted.storage is None
    nocache = from_flags("unified", "--no-prefix-cache", "--host-pages", "40")
    assert nocache.tiers is None and not nocache.engine.cache.enable_prefix_cache


def test_flags_keep_their_defaults() -> None:
    setup = from_flags("prefill")
    assert (setup.name, setup.port, setup.bootstrap_port, setup.transfer.engine) == ("p0", 0, 0, "mooncake")
    assert setup.server == ApiSettings() and setup.engine.kernels == "auto"
    assert setup.engine.scheduler == SchedulerConfig()
    unified = from_flags("unified")
    assert (unified.name, unified.port, unified.tiers) == ("unified", 30000, None)
    assert from_flags("decode").name == "d0"


def test_given_flags_override_the_topology_node(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(PD.format(path=tmp_path / "s", cache="", prefill="", decode="request_timeout_s = 9"))
    args = parser_for("decode").parse_args(["--config", str(path), "--node", "d0",
                                             "--offload-staging-pages", "32"])
    topology, node = node_from_args(args, ["decode"])
    setup = setup_for(topology, node.name, MODEL)
    assert setup.offload == OffloadSettings(staging_pages=32) and setup.server.request_timeout_s == 9
    args = parser_for("decode").parse_args(["--config", str(path), "--node", "d0",
                                             "--request-timeout", "5"])
    assert setup_for(*_topology_and_name(args, "decode"), MODEL).server.request_timeout_s == 5


@pytest.mark.parametrize("flags", [["--secret-file", "/s"], ["--model", "small", "--port", "1234"],
                                   ["--storage-backend", "file"]])
def test_flags_the_topology_owns_are_refused_with_config(tmp_path: Path, flags) -> None:
    """With --config only NODE_FLAG_KEYS' flags apply; the others were ignored without a
    word (`--secret-file` left the node without its secret)."""
    path = tmp_path / "t.toml"
    path.write_text(PD.format(path=tmp_path / "s", cache="", prefill="", decode=""))
    args = parser_for("prefill").parse_args(["--config", str(path), "--node", "p0", *flags])
    named = ", ".join(flag for flag in flags if flag.startswith("--"))
    with pytest.raises(TopologyError, match=f"{named}: set by the topology file"):
        node_from_args(args, ["prefill"])
    quiet = parser_for("prefill").parse_args(["--config", str(path), "--node", "p0",
                                              "--log-level", "debug"])
    assert node_from_args(quiet, ["prefill"])[1].name == "p0"  # the process's own flag


def _topology_and_name(args: argparse.Namespace, role: str):
    topology, node = node_from_args(args, [role])
    return topology, node.name


def test_new_node_keys_are_validated(tmp_path: Path) -> None:
    cases = {
        ("prefill", "offload_staging_pages = 8"): "node.p0.offload_staging_pages: only decode nodes offload",
        ("decode", "offload_stride_pages = 0"): "node.d0.offload_stride_pages: expected an integer >= 1",
        ("decode", "request_timeout_s = 0"): "node.d0.request_timeout_s: expected a number > 0",
        ("prefill", "[node.cache]\nhost_pages = 0"): "node.p0.cache.host_pages: a prefill node needs a host tier",
        ("prefill", "[node.cache]\nprefix_cache = false"): "node.p0.cache.prefix_cache: a prefill node always runs its prefix cache",
        ("prefill", "[node.scheduler]\nmax_running_requests = 0"):
            "node.p0.scheduler.max_running_requests: expected an integer >= 1",
    }
    for (role, text), message in cases.items():
        with pytest.raises(TopologyError, match=message):
            pd(tmp_path, **{role: text})
    with pytest.raises(TopologyError, match="give one of host_ratio or host_pages"):
        pd(tmp_path, cache="host_ratio = 2.0\nhost_pages = 4")
    assert pd(tmp_path, overrides=["cache.host_pages=40"]).node("p0").cache.host_ratio is None
    with pytest.raises(TopologyError, match='node.d0.kernels: unknown kernel backend "cuda"'):
        setup_for(pd(tmp_path, decode='kernels = "cuda"'), "d0", MODEL)


def test_choices_come_from_the_registries() -> None:
    actions = {a.dest: a for a in parser_for("prefill")._actions}
    assert actions["transfer_engine"].choices == ENGINES.names()
    assert actions["storage_backend"].choices == ["none", *STORAGE_BACKENDS.names()]
    assert actions["kernels"].choices == ["auto", *KERNEL_BACKENDS.names()]
    assert actions["key_scheme"].choices == list(KEY_SCHEMES)
    assert actions["write_policy"].choices == list(WRITE_POLICIES)
    assert actions["prefetch_policy"].choices == list(PREFETCH_POLICIES)
    # the TOML schema names the same values (its own order, which its error messages keep)
    def values(cls: type, key: str) -> set[str]:
        return set(get_args(get_type_hints(cls)[key]))

    assert values(TransferSpec, "engine") == set(ENGINES.names())
    assert values(CacheSpec, "key_scheme") == set(KEY_SCHEMES)
    assert values(CacheSpec, "write_policy") == set(WRITE_POLICIES)
    assert values(CacheSpec, "prefetch_policy") == set(PREFETCH_POLICIES)


def test_kernels_come_from_the_config(tiny) -> None:
    from dataclasses import replace

    from pdcache.engine.engine import Engine

    model, tokenizer = tiny
    setup = from_flags("unified", "--kernels", "reference", "--device-pages", "32")
    engine = Engine(setup.engine, model, tokenizer)
    assert engine.kernels.name == "reference" and engine.runner.kernels is engine.kernels
    auto = Engine(replace(setup.engine, kernels="auto"), model, tokenizer)
    assert auto.kernels.name is None  # chosen per call by device
    os.environ["PDCACHE_KERNELS"] = "torch"
    try:  # the environment variable is not read any more
        assert Engine(setup.engine, model, tokenizer).kernels.name == "reference"
    finally:
        del os.environ["PDCACHE_KERNELS"]


@pytest.fixture(scope="module")
def tiny():
    from pdcache.engine.loader import load_model

    return load_model("tiny", seed=0)


def test_process_environment_is_computed_not_written(tmp_path: Path) -> None:
    before = dict(os.environ)
    setup = setup_for(pd(tmp_path, overrides=["transfer.engine=mooncake", "transfer.timeout_s=10"]),
                      "p0", MODEL)
    env = process_environment(setup, {})
    assert env == {"MC_LOG_LEVEL": "ERROR", "MC_TRANSFER_TIMEOUT": "40",
                   "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    assert process_environment(setup, {"MC_LOG_LEVEL": "INFO", "MC_TCP_BIND_ADDRESS": "10.0.0.5"}) == {
        "MC_TRANSFER_TIMEOUT": "40", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192"}
    unified = setup_for(parse_topology(UNIFIED.format(cache="", node=""), "u.toml"), "u0", MODEL)
    assert process_environment(unified, {}) == {}
    assert dict(os.environ) == before


def test_mooncake_engine_leaves_the_environment_alone() -> None:
    pytest.importorskip("mooncake.engine")
    before = dict(os.environ)
    engine = ENGINES.get("mooncake")(TransferConfig(engine="mooncake", room_timeout_s=77))
    try:
        assert engine.session()
    finally:
        engine.close()
    assert dict(os.environ) == before
    remote = TransferConfig(engine="mooncake", local_host="10.0.0.2")
    assert ENGINES.get("mooncake").environment(remote, {"MC_TCP_BIND_ADDRESS": "127.0.0.1"})[
        "MC_TCP_BIND_ADDRESS"] == "10.0.0.2"  # a multi-host node never listens on loopback


def test_admission_keys_reach_the_node_setup(tmp_path: Path) -> None:
    """`[scheduler] max_pending_reservations` sizes the decode node's admission queue and
    `[transfer] prefill_waits_for_decode` gates prefill compute (issue 17): both reach the
    frozen configs the node runs with; defaults 256 / true."""
    default = setup_for(pd(tmp_path), "d0", MODEL)
    assert default.engine.scheduler.max_pending_reservations == 256
    assert default.transfer is not None and default.transfer.prefill_waits_for_decode
    overrides = ("scheduler.max_pending_reservations=3", "transfer.prefill_waits_for_decode=false")
    setup = setup_for(pd(tmp_path, overrides=overrides), "d0", MODEL)
    assert setup.engine.scheduler.max_pending_reservations == 3
    assert setup.transfer is not None and not setup.transfer.prefill_waits_for_decode


def test_max_pending_reservations_zero_refuses_at_once_and_negative_is_refused(tmp_path: Path) -> None:
    """0 is documented (docs/pd-protocol.md: refuse a reservation that must wait) and accepted;
    below 0 is a topology error."""
    zero = setup_for(pd(tmp_path, overrides=("scheduler.max_pending_reservations=0",)), "d0", MODEL)
    assert zero.engine.scheduler.max_pending_reservations == 0
    with pytest.raises(TopologyError, match="scheduler.max_pending_reservations: expected an integer >= 0, got -1"):
        pd(tmp_path, overrides=("scheduler.max_pending_reservations=-1",))


def test_decode_pacing_key_and_flag_reach_the_engine(tmp_path: Path) -> None:
    """`[node.scheduler] decode_step_interval_ms` (default 0: off) and decode's
    `--decode-step-interval` reach the frozen engine config."""
    assert setup_for(pd(tmp_path), "d0", MODEL).engine.scheduler.decode_step_interval_ms == 0
    paced = setup_for(pd(tmp_path, overrides=("node.d0.scheduler.decode_step_interval_ms=80",)),
                      "d0", MODEL)
    assert paced.engine.scheduler.decode_step_interval_ms == 80
    flags = from_flags("decode", "--decode-step-interval", "40")
    assert flags.engine.scheduler.decode_step_interval_ms == 40


def test_compute_share_keys_and_flags_reach_the_engine(tmp_path: Path) -> None:
    """`[scheduler] compute_share` / `decode_yield_max_ms` (default: off, 300) and the nodes'
    `--compute-share` / `--decode-yield-max` reach the frozen engine config."""
    off = setup_for(pd(tmp_path), "d0", MODEL).engine.scheduler
    assert off.compute_share is None and off.decode_yield_max_ms == 300
    share = str(tmp_path / "compute.share")
    topology = pd(tmp_path, overrides=(f"scheduler.compute_share={share}",
                                       "node.d0.scheduler.decode_yield_max_ms=120"))
    for name in ("p0", "d0"):
        assert setup_for(topology, name, MODEL).engine.scheduler.compute_share == share
    assert setup_for(topology, "d0", MODEL).engine.scheduler.decode_yield_max_ms == 120
    flags = from_flags("decode", "--compute-share", share, "--decode-yield-max", "50")
    assert (flags.engine.scheduler.compute_share, flags.engine.scheduler.decode_yield_max_ms) == (
        share, 50)
    assert from_flags("prefill", "--compute-share", share).engine.scheduler.compute_share == share


def test_tool_call_parser_key_and_flag_reach_the_server(tmp_path: Path) -> None:
    from pdcache.server.bridge import ServerConfig
    from pdcache.wire.tool_calls import TOOL_CALL_PARSERS

    path = tmp_path / "t.toml"
    path.write_text(PD.format(path=tmp_path / "s", cache="", prefill="",
                              decode='tool_call_parser = "llama3"'))
    args = parser_for("decode").parse_args(["--config", str(path), "--node", "d0"])
    setup = setup_for(*_topology_and_name(args, "decode"), MODEL)
    assert ServerConfig.of(setup).tool_call_parser == "llama3"
    args = parser_for("decode").parse_args(["--config", str(path), "--node", "d0",
                                             "--tool-call-parser", "qwen25"])
    assert setup_for(*_topology_and_name(args, "decode"), MODEL).server.tool_call_parser == "qwen25"
    assert setup_for(*_topology_and_name(parser_for("prefill").parse_args(
        ["--config", str(path), "--node", "p0"]), "prefill"), MODEL).server.tool_call_parser == (
        "hermes")
    with pytest.raises(TopologyError, match="tool_call_parser"):
        pd(tmp_path, decode='tool_call_parser = "nope"')
    flag = parser_for("unified")._option_string_actions["--tool-call-parser"]
    assert set(flag.choices) == set(TOOL_CALL_PARSERS)


def test_router_tool_call_parser_flag_and_key(tmp_path: Path) -> None:
    from pdcache.router.cli import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config, _, _ = build_config(parser.parse_args(["--unified", "127.0.0.1:1"]))
    assert config.tool_call_parser == "hermes"
    args = parser.parse_args(["--unified", "127.0.0.1:1", "--tool-call-parser", "llama3"])
    assert build_config(args)[0].tool_call_parser == "llama3"


def test_tier_policy_keys_reach_the_engine_and_hicache(tmp_path: Path) -> None:
    """`[cache] device_eviction / host_eviction / host_mode / session_idle_s` (and their flags)
    land in the engine's CacheConfig and HiCacheConfig; LRU + inclusive stay the defaults."""
    from pdcache.engine.eviction import EVICTION_POLICIES
    from pdcache.offload_manager.hicache import HOST_MODES

    default = setup_for(pd(tmp_path), "p0", MODEL)
    assert (default.engine.cache.device_eviction, default.tiers.hicache.host_eviction,
            default.tiers.hicache.host_mode) == ("lru", "lru", "inclusive")
    keys = ('device_eviction = "session"\nhost_eviction = "session"\n'
            'host_mode = "exclusive"\nsession_idle_s = 45.0')
    topo = setup_for(pd(tmp_path, cache=keys), "p0", MODEL)
    assert topo.engine.cache.device_eviction == "session"
    assert topo.engine.cache.session_idle_s == 45.0
    assert (topo.tiers.hicache.host_eviction, topo.tiers.hicache.host_mode) == ("session",
                                                                                 "exclusive")
    flags = from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                       "--transfer-engine", "zmq", "--transfer-timeout", "7.5",
                       "--device-eviction", "session", "--host-eviction", "session",
                       "--host-mode", "exclusive", "--session-idle-s", "45",
                       *storage_flags(tmp_path))
    assert flags.engine.cache == topo.engine.cache and flags.tiers == topo.tiers
    with pytest.raises(TopologyError, match="cache.host_mode"):
        pd(tmp_path, cache='host_mode = "victim"')
    with pytest.raises(TopologyError, match="cache.session_idle_s: expected a number > 0"):
        pd(tmp_path, cache="session_idle_s = 0")
    actions = {a.dest: a for a in parser_for("prefill")._actions}
    assert actions["device_eviction"].choices == list(EVICTION_POLICIES)
    assert actions["host_mode"].choices == list(HOST_MODES)
    assert set(get_args(get_type_hints(CacheSpec)["device_eviction"])) == set(EVICTION_POLICIES)
    assert set(get_args(get_type_hints(CacheSpec)["host_mode"])) == set(HOST_MODES)


def test_storage_eviction_from_flags_equals_from_topology(tmp_path: Path) -> None:
    flags = from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                       "--transfer-engine", "zmq", "--storage-eviction", "session",
                       "--storage-session-protect-share", "0.25",
                       "--storage-session-protect-bytes", "1MiB",
                       "--storage-session-idle-s", "60", *storage_flags(tmp_path))
    topo = setup_for(pd(tmp_path, overrides=[
        'storage.eviction="session"', "storage.session_protect_share=0.25",
        'storage.session_protect_bytes="1MiB"', "storage.session_idle_s=60.0"]), "p0", MODEL)
    storage = flags.tiers.storage
    assert storage == topo.tiers.storage
    assert (storage.eviction, storage.session_protect_share) == ("session", 0.25)
    assert (storage.session_protect_bytes, storage.session_idle_s) == (1 << 20, 60.0)
    assert from_flags("prefill", "--transfer-engine", "zmq",
                      *storage_flags(tmp_path)).tiers.storage.eviction == "lru"


def test_page_pipeline_key_reaches_the_store(tmp_path: Path) -> None:
    """`[storage] page_pipeline`: "auto" (default) leaves StorageConfig.pipeline_pages at None
    (each sealed batch pipelined or page by page as measured), "off" sets 0, "on" sets
    PIPELINE_ON_PAGES; an unknown value names the key, and so does a StorageConfig given
    "auto" as a number."""
    from pdcache.offload_manager.storage.config import PIPELINE_ON_PAGES, StorageConfig

    def pipeline_pages(value: str | None) -> int | None:
        overrides = [] if value is None else [f'storage.page_pipeline="{value}"']
        return setup_for(pd(tmp_path, overrides=overrides), "p0", MODEL).tiers.storage.pipeline_pages

    assert pipeline_pages(None) is None and pipeline_pages("auto") is None
    assert pipeline_pages("off") == 0 and pipeline_pages("on") == PIPELINE_ON_PAGES
    with pytest.raises(TopologyError, match="storage.page_pipeline"):
        pd(tmp_path, overrides=['storage.page_pipeline="sometimes"'])
    with pytest.raises(ValueError, match="pipeline_pages"):
        StorageConfig.from_mapping({"backend": "hf3fs", "page_bytes": 4096, "pipeline_pages": "auto"})


def test_load_copy_ahead_key_and_flag_reach_hicache(tmp_path: Path) -> None:
    """`[cache] load_copy_ahead` (off by default) and `--load-copy-ahead` land in
    HiCacheConfig.copy_ahead."""
    assert setup_for(pd(tmp_path), "p0", MODEL).tiers.hicache.copy_ahead is False
    on = setup_for(pd(tmp_path, cache="load_copy_ahead = true"), "p0", MODEL)
    assert on.tiers.hicache.copy_ahead is True
    flags = from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                       "--load-copy-ahead", *storage_flags(tmp_path))
    assert flags.tiers.hicache.copy_ahead is True
    assert from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                      *storage_flags(tmp_path)).tiers.hicache.copy_ahead is False


def test_layerwise_prefetch_key_and_flag_reach_hicache(tmp_path: Path) -> None:
    """`[cache] prefetch_layerwise / prefetch_layers_per_read` (and `--prefetch-layerwise`,
    `--prefetch-layers-per-read`) land in HiCacheConfig, flags as the keys do; off by default;
    a step of 0 layers is refused (key and flag)."""
    default = setup_for(pd(tmp_path), "p0", MODEL)
    assert (default.tiers.hicache.layerwise_prefetch,
            default.tiers.hicache.layerwise_read_layers) == (False, 1)
    topo = setup_for(pd(tmp_path, cache="prefetch_layerwise = true\nprefetch_layers_per_read = 2"),
                     "p0", MODEL)
    assert (topo.tiers.hicache.layerwise_prefetch, topo.tiers.hicache.layerwise_read_layers) == (
        True, 2)
    flags = from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                       "--prefetch-layerwise", *storage_flags(tmp_path))
    assert flags.tiers.hicache.layerwise_prefetch is True
    assert flags.tiers.hicache.layerwise_read_layers == 1
    both = from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                      "--prefetch-layerwise", "--prefetch-layers-per-read", "2",
                      *storage_flags(tmp_path))
    assert both.tiers.hicache == topo.tiers.hicache
    with pytest.raises(TopologyError, match="cache.prefetch_layers_per_read"):
        pd(tmp_path, cache="prefetch_layers_per_read = 0")
    with pytest.raises(TopologyError, match="cache.prefetch_layers_per_read"):
        from_flags("prefill", "--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
                   "--prefetch-layers-per-read", "0", *storage_flags(tmp_path))


def test_a_node_listens_on_bind_host_and_is_reached_at_host(tmp_path: Path) -> None:
    """A pod's DNS name resolves only once the pod runs: the node listens on 0.0.0.0 (HTTP
    and the KV bootstrap) while its URL and transfer address stay its name."""
    import socket

    import torch

    from pdcache.transfer.sender import KVSender
    from pdcache.utils.secret import create_secret

    with pytest.raises(TopologyError, match=r"node\.p0\.bind_host: binds the wildcard"):
        pd(tmp_path, prefill='host = "localhost"\nbind_host = "0.0.0.0"')  # no secret
    secret = create_secret(tmp_path / "cluster.secret")
    topology = pd(tmp_path, prefill='host = "localhost"\nbind_host = "0.0.0.0"',
                  overrides=[f"security.secret_file={secret}"])
    setup = setup_for(topology, "p0", MODEL)
    assert (setup.host, setup.listen_host) == ("localhost", "0.0.0.0")
    assert topology.node("p0").url == "http://localhost:31001"
    assert setup_for(topology, "d0", MODEL).listen_host == "127.0.0.1"  # default: its host
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = KVSender(setup.transfer, torch.zeros(2, 2, 4, 4, 2, 8), setup.listen_host,
                      port).start()
    try:
        assert sender.bootstrap_addr == f"tcp://0.0.0.0:{port}"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        sender.close()


def test_window_tiers_is_one_deployment_wide_stored_format(tmp_path: Path) -> None:
    """`[cache] window_tiers` reaches every node's setup and names its stored pages (a
    sliding-window model's full-layer pages carry another fingerprint than its one-space
    ones); a node overriding it would never find the others' pages: refused by key."""
    from pdcache.engine.loader import load_model_config as config_of

    oss = config_of("tiny-gpt-oss")
    topology = pd(tmp_path, overrides=("model.preset=\"tiny-gpt-oss\"",))
    tails = pd(tmp_path, overrides=("model.preset=\"tiny-gpt-oss\"", "cache.window_tiers=true"))
    off, on = setup_for(topology, "p0", oss), setup_for(tails, "p0", oss)
    assert not off.cache_tiers.window_tiers and on.cache_tiers.window_tiers
    assert setup_for(tails, "d0", oss).cache_tiers.window_tiers
    assert off.fingerprint != on.fingerprint and on.storage is not None
    assert on.storage.state_bytes > 0 and (off.storage is None or not off.storage.state_bytes)
    with pytest.raises(TopologyError, match="node.d0.cache.window_tiers"):
        pd(tmp_path, overrides=("node.d0.cache.window_tiers=true",))
