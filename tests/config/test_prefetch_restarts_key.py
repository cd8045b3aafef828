"""`[cache] prefetch_restarts` / `--prefetch-restarts` (prefill and unified nodes): how many
times a queued request's storage prefetch restarts from a match that shrank under it
(docs/design.md §4.9, "Prefetch restarts"), from a topology and from flags alike, validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcache.config import TopologyError, setup_for
from tests.config.test_setup import MODEL, from_flags, pd, storage_flags


def test_prefetch_restarts_default_key_and_flag(tmp_path: Path) -> None:
    assert setup_for(pd(tmp_path), "p0", MODEL).tiers.hicache.prefetch_restarts == 1
    off = setup_for(pd(tmp_path, cache="prefetch_restarts = 0"), "p0", MODEL)
    assert off.tiers.hicache.prefetch_restarts == 0
    flags = ["--name", "p0", "--port", "31001", "--bootstrap-port", "8998",
             "--transfer-engine", "zmq", "--transfer-timeout", "7.5", *storage_flags(tmp_path)]
    assert from_flags("prefill", *flags).tiers.hicache.prefetch_restarts == 1
    assert from_flags("prefill", *flags, "--prefetch-restarts", "3").tiers.hicache.prefetch_restarts == 3


@pytest.mark.parametrize("bad", ["-1", "9"])
def test_prefetch_restarts_out_of_range_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(TopologyError, match=r"cache.prefetch_restarts: expected an integer within 0..8, got"):
        pd(tmp_path, cache=f"prefetch_restarts = {bad}")
