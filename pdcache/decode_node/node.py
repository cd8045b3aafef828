"""Assembling a decode node: engine + DecodeScheduler (+ DecodeOffloadManager), KVReceiver,
HTTP app."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pdcache.decode_node.metrics import OffloadStatsCollector
from pdcache.decode_node.scheduler import DecodeScheduler
from pdcache.decode_node.server import DecodeServer
from pdcache.engine.engine import Engine
from pdcache.launch.node_config import NodeSetup
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.storage import create_backend
from pdcache.server.app import routes_for
from pdcache.server.bridge import ServerConfig
from pdcache.server.routes import build_app
from pdcache.transfer import KVReceiver, Outcome


def build_decode_app(setup: NodeSetup, model: Any, tokenizer: Any, staging_pages: int = 256,
                     stride_pages: int = 1, request_timeout_s: float = 600.0,
                     ) -> tuple[FastAPI, DecodeServer]:
    """The app of one decode node; with `setup.offload` its KV goes back to storage."""
    if setup.transfer is None:
        raise ValueError("a decode node needs a transfer config")
    if staging_pages < 1 or stride_pages < 1:
        raise ValueError(f"offload staging pages ({staging_pages}) and stride pages "
                         f"({stride_pages}) must be >= 1")
    storage = create_backend(setup.storage) if setup.offload and setup.storage else None
    engines: list[Engine] = []
    managers: list[DecodeOffloadManager] = []
    servers: list[DecodeServer] = []

    def make_scheduler(**kwargs: Any) -> DecodeScheduler:
        offload = None
        if storage is not None:
            offload = DecodeOffloadManager(kwargs["pool"].device_kv, storage, setup.fingerprint,
                                           staging_pages, stride_pages,
                                           key_scheme=setup.key_scheme,
                                           key_namespace=setup.key_namespace)
            managers.append(offload)
        return DecodeScheduler(offload=offload, release=lambda rid: engines[0].release_held(rid),
                               **kwargs)

    engine = Engine(setup.engine, model, tokenizer, make_scheduler=make_scheduler)
    engines.append(engine)

    def on_release(outcome: Outcome) -> None:
        servers[0].on_release(outcome)

    receiver = KVReceiver(setup.transfer, engine.pool.device_kv, on_release=on_release,
                          decode_id=setup.name).start()
    config = ServerConfig(name=setup.name, request_timeout_s=request_timeout_s)
    server = DecodeServer(routes_for(engine, config), receiver)
    servers.append(server)
    if managers:  # pdcache_decode_offload_* on this node's /metrics
        server.bridge.metrics.registry.register(OffloadStatsCollector(managers[0], setup.name))

    def shutdown() -> None:
        engine.shutdown()
        receiver.close()
        for manager in managers:
            manager.close()
        engine.scheduler.release_all_held()
        if storage is not None:
            storage.close()

    app = build_app(server.routes, pd_generate=server.pd_generate,
                    health_extra=server.health_extra, on_startup=engine.start,
                    on_shutdown=shutdown)
    app.state.offload = managers[0] if managers else None
    return app, server
