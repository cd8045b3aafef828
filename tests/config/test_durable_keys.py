"""The durable next turn's settings (docs/design.md §4.10): `[cache] pending_wait` /
`--no-pending-wait` (prefill), `offload_pending_ttl_s` / `--offload-pending-ttl` (decode),
`[storage] write_delay_s` (the store's emulated write latency), from a topology and from flags
alike, validated."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pdcache.config import TopologyError, setup_for
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.fault_injection import DelayInjectingBackend
from tests.config.test_setup import MODEL, from_flags, pd, storage_flags


def test_pending_wait_is_on_by_default_and_switched_off_by_key_or_flag(tmp_path: Path) -> None:
    assert setup_for(pd(tmp_path), "p0", MODEL).tiers.hicache.pending_wait is True
    off = setup_for(pd(tmp_path, cache="pending_wait = false"), "p0", MODEL)
    assert off.tiers.hicache.pending_wait is False
    flags = ["--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
             "--transfer-engine", "zmq", "--transfer-timeout", "7.5", *storage_flags(tmp_path)]
    assert from_flags("prefill", *flags).tiers.hicache.pending_wait is True
    assert from_flags("prefill", *flags, "--no-pending-wait").tiers.hicache.pending_wait is False


def test_offload_pending_ttl_reaches_the_decode_setup(tmp_path: Path) -> None:
    assert setup_for(pd(tmp_path), "d0", MODEL).offload.pending_ttl_s == 10.0
    topo = setup_for(pd(tmp_path, decode="offload_pending_ttl_s = 2.5"), "d0", MODEL)
    flags = from_flags("decode", "--name", "d0", "--port", "31002", "--transfer-engine", "zmq",
                       "--transfer-timeout", "7.5", "--offload-pending-ttl", "2.5",
                       *storage_flags(tmp_path))
    assert topo.offload.pending_ttl_s == flags.offload.pending_ttl_s == 2.5
    with pytest.raises(TopologyError, match="node.p0.offload_pending_ttl_s: only decode"):
        pd(tmp_path, prefill="offload_pending_ttl_s = 1.0")
    with pytest.raises(TopologyError, match="node.d0.offload_pending_ttl_s: expected a number > 0"):
        pd(tmp_path, decode="offload_pending_ttl_s = 0.0")


def test_write_delay_wraps_the_configured_backend(tmp_path: Path) -> None:
    plain = setup_for(pd(tmp_path, overrides=["storage.backend=file"]), "d0", MODEL).storage
    assert plain.write_delay_s == 0.0
    slow = setup_for(pd(tmp_path, overrides=["storage.backend=file", "storage.write_delay_s=0.05"]),
                     "d0", MODEL).storage
    assert slow.write_delay_s == 0.05
    backend = create_backend(slow)
    try:
        assert isinstance(backend, DelayInjectingBackend) and backend.write_delay_s == 0.05
        page = torch.zeros(slow.page_bytes, dtype=torch.uint8)
        started = time.monotonic()
        assert backend.put_from([b"k" * 32], [page], "decode") == [True]
        assert time.monotonic() - started >= 0.05  # the store's latency, then the real write
        assert backend.exists_prefix([b"k" * 32]) == 1
    finally:
        backend.close()
    assert not isinstance(create_backend(plain), DelayInjectingBackend)
    with pytest.raises(TopologyError, match="storage.write_delay_s: expected a number >= 0"):
        pd(tmp_path, overrides=["storage.write_delay_s=-1"])


def test_lost_peer_hold_reaches_the_transfer_config_and_is_validated(tmp_path: Path) -> None:
    assert setup_for(pd(tmp_path), "d0", MODEL).transfer.lost_peer_hold_s == 120.0
    topo = setup_for(pd(tmp_path, overrides=["transfer.lost_peer_hold_s=30"]), "d0", MODEL)
    flags = from_flags("decode", "--name", "d0", "--port", "31002", "--transfer-engine", "zmq",
                       "--transfer-timeout", "7.5", "--lost-peer-hold", "30",
                       *storage_flags(tmp_path))
    assert topo.transfer.lost_peer_hold_s == flags.transfer.lost_peer_hold_s == 30.0
    with pytest.raises(TopologyError, match="transfer.lost_peer_hold_s: expected a number > 0"):
        pd(tmp_path, overrides=["transfer.lost_peer_hold_s=0"])


def test_pending_ttls_are_bounded(tmp_path: Path) -> None:
    """Prefill caps a decode's pending-mark TTL (`[cache] pending_max_ttl_s`, 30 s by default;
    `--pending-max-ttl`), and decode's own `offload_pending_ttl_s` has an upper bound too."""
    assert setup_for(pd(tmp_path), "p0", MODEL).tiers.hicache.pending_max_ttl_s == 30.0
    topo = setup_for(pd(tmp_path, cache="pending_max_ttl_s = 4.0"), "p0", MODEL)
    flags = ["--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
             "--transfer-engine", "zmq", "--transfer-timeout", "7.5", *storage_flags(tmp_path)]
    flagged = from_flags("prefill", *flags, "--pending-max-ttl", "4")
    assert topo.tiers.hicache.pending_max_ttl_s == flagged.tiers.hicache.pending_max_ttl_s == 4.0
    for bad in ("0.0", "601.0"):
        with pytest.raises(TopologyError, match=r"cache.pending_max_ttl_s: expected a number in \(0, 600\]"):
            pd(tmp_path, cache=f"pending_max_ttl_s = {bad}")
    assert setup_for(pd(tmp_path, decode="offload_pending_ttl_s = 600.0"), "d0", MODEL)
    with pytest.raises(TopologyError, match="node.d0.offload_pending_ttl_s: expected a number > 0 and <= 600"):
        pd(tmp_path, decode="offload_pending_ttl_s = 3600.0")


def test_pending_pull_is_auto_by_default_and_set_by_key_or_flag(tmp_path: Path) -> None:
    assert setup_for(pd(tmp_path), "p0", MODEL).tiers.hicache.pending_pull == "auto"
    never = setup_for(pd(tmp_path, cache='pending_pull = "never"'), "p0", MODEL)
    assert never.tiers.hicache.pending_pull == "never"
    flags = ["--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
             "--transfer-engine", "zmq", "--transfer-timeout", "7.5", *storage_flags(tmp_path)]
    assert from_flags("prefill", *flags, "--pending-pull", "always").tiers.hicache.pending_pull \
        == "always"
    with pytest.raises(TopologyError, match="pending_pull"):
        pd(tmp_path, cache='pending_pull = "sometimes"')
