"""Assembling a prefill node: HiCache engine + PrefillScheduler, KVSender, HTTP app."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pdcache.config import NodeSetup
from pdcache.engine.request import Req
from pdcache.offload_manager.builder import build_tiered_engine
from pdcache.prefill_node.scheduler import PrefillScheduler
from pdcache.prefill_node.server import PrefillServer
from pdcache.server.app import ServerConfig, create_app
from pdcache.transfer import KVSender, Outcome


def build_prefill_app(setup: NodeSetup, model: Any, tokenizer: Any) -> tuple[FastAPI, PrefillServer]:
    """The app of one prefill node; the KV bootstrap endpoint is listening when this returns
    (`server.sender.bootstrap_addr`), the engine starts with the app."""
    if setup.tiers is None or setup.transfer is None:
        raise ValueError("a prefill node needs cache tiers and a transfer config")
    servers: list[PrefillServer] = []

    def on_prefilled(req: Req) -> None:
        servers[0].on_prefilled(req)

    def on_release(outcome: Outcome) -> None:
        servers[0].on_release(outcome)

    tiered = build_tiered_engine(setup.engine, model, tokenizer, setup.tiers, PrefillScheduler,
                                 on_prefilled=on_prefilled)
    engine = tiered.engine
    sender = KVSender(setup.transfer, engine.pool.device_kv, setup.host,
                      setup.bootstrap_port or 0, on_release=on_release, prefill_id=setup.name)
    server = PrefillServer(engine, ServerConfig(name=setup.name,
                                                request_timeout_s=setup.server.request_timeout_s), sender)
    servers.append(server)
    sender.start()

    def shutdown() -> None:
        sender.close()
        engine.scheduler.release_all_held()
        tiered.hicache.close()
        if tiered.storage is not None:
            tiered.storage.close()

    app = create_app(engine, server.config, server=server, on_shutdown=shutdown)
    app.state.tiered = tiered
    return app, server
