"""Assembling a decode node: engine + DecodeScheduler (+ DecodeOffloadManager), KVReceiver,
HTTP app."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pdcache.config import NodeSetup
from pdcache.decode_node.metrics import OffloadStatsCollector
from pdcache.decode_node.scheduler import DecodeScheduler
from pdcache.decode_node.server import DecodeServer
from pdcache.engine.engine import Engine
from pdcache.kernels import KernelSet
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.storage import create_backend
from pdcache.server.app import ServerConfig, create_app
from pdcache.transfer import KVReceiver, Outcome


def build_decode_app(setup: NodeSetup, model: Any, tokenizer: Any) -> tuple[FastAPI, DecodeServer]:
    """The app of one decode node; with `setup.offload` its KV goes back to storage."""
    if setup.transfer is None:
        raise ValueError("a decode node needs a transfer config")
    offload_settings = setup.offload
    storage = create_backend(setup.storage) if offload_settings and setup.storage else None
    engines: list[Engine] = []
    managers: list[DecodeOffloadManager] = []
    servers: list[DecodeServer] = []

    def make_scheduler(**kwargs: Any) -> DecodeScheduler:
        offload = None
        if storage is not None and offload_settings is not None:
            offload = DecodeOffloadManager(kwargs["pool"].device_kv, storage, setup.fingerprint,
                                           offload_settings.staging_pages,
                                           offload_settings.stride_pages,
                                           key_scheme=setup.key_scheme,
                                           key_namespace=setup.key_namespace,
                                           kernels=KernelSet(setup.engine.kernels))
            managers.append(offload)
        return DecodeScheduler(offload=offload, release=lambda rid: engines[0].release_held(rid),
                               **kwargs)

    engine = Engine(setup.engine, model, tokenizer, make_scheduler=make_scheduler)
    engines.append(engine)

    def on_release(outcome: Outcome) -> None:
        servers[0].on_release(outcome)

    receiver = KVReceiver(setup.transfer, engine.pool.device_kv, on_release=on_release,
                          decode_id=setup.name).start()
    server = DecodeServer(engine, ServerConfig(name=setup.name,
                                               request_timeout_s=setup.server.request_timeout_s),
                          receiver)
    servers.append(server)
    if managers:  # pdcache_decode_offload_* on this node's /metrics
        server.metrics.registry.register(OffloadStatsCollector(managers[0], setup.name))

    def shutdown() -> None:
        receiver.close()
        for manager in managers:
            manager.close()
        engine.scheduler.release_all_held()
        if storage is not None:
            storage.close()

    app = create_app(engine, server.config, server=server, on_shutdown=shutdown)
    app.state.offload = managers[0] if managers else None
    return app, server
