"""Fixtures shared by the offload_manager tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
