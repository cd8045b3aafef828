"""The unified server most tests of this package talk to: a tiny engine (16-token pages, 512
device pages) behind `create_app`, one per test module, accounting checked at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pdcache.engine.config import CacheConfig
from pdcache.engine.engine import Engine
from pdcache.server.app import ServerConfig, create_app

SERVER_PAGE = 16


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.from_spec("tiny", cache=CacheConfig(page_size=SERVER_PAGE, num_device_pages=512))
    eng.start()
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    app = create_app(engine, ServerConfig(name="u0", request_timeout_s=60, manage_engine=False))
    with TestClient(app) as c:
        yield c
    engine.check_accounting()
