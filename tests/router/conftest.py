"""Fixtures shared by the router tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router_support import UnifiedNode


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[UnifiedNode]]:
    """Two real tiny-preset unified nodes (u0, u1) on free loopback ports, for one module."""
    started: list[UnifiedNode] = []
    try:
        for name in ("u0", "u1"):
            started.append(UnifiedNode(name))
        yield started
    finally:
        for node in started:
            node.stop()
