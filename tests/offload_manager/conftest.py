"""Fixtures shared by the offload_manager tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcache.engine.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset's model and tokenizer (random weights, seed 0), loaded once per module."""
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[str]:
    """A real `mooncake_master` on a free local port, one per test module (its objects do not
    outlive the module); skips where Mooncake Store is not installed."""
    pytest.importorskip("mooncake.store")
    from pdcache.offload_manager.storage.mooncake_store import LocalMooncakeMaster

    master = LocalMooncakeMaster().start()
    try:
        yield master.address
    finally:
        master.stop()
