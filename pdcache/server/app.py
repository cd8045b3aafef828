"""The unified server's app: `ServerRoutes` around one Engine, nothing else.

`create_app(engine, config)` is what `pdcache serve` (through `UnifiedRuntime`) and tests
build; P/D nodes assemble the same parts with their own `/generate` handler for `pd` bodies
(`pdcache.server.routes.build_app`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from pdcache.engine.engine import Engine
from pdcache.offload_manager.hicache_tiers import HiCacheTiers
from pdcache.server.bridge import EngineBridge, ServerConfig
from pdcache.server.metrics import ServerMetrics
from pdcache.server.routes import ServerRoutes, build_app


def server_metrics(engine: Engine, name: str, role: str = "unified") -> ServerMetrics:
    """The app's registry: request series, engine gauges, and lower-tier series when the
    engine's scheduler has HiCache tiers (their `stats()`; device-only tiers have none);
    SGLang's series carry the model's name and `role` as `engine_type`."""
    tiers = engine.scheduler.tiers
    tier_stats = tiers.stats if isinstance(tiers, HiCacheTiers) else None
    return ServerMetrics(name, stats=engine.stats, tier_stats=tier_stats,
                         model_name=engine.config.model.name, engine_type=role)


def routes_for(engine: Engine, config: ServerConfig) -> ServerRoutes:
    """The bridge (with its metrics) and the routes of one server around `engine`."""
    metrics = server_metrics(engine, config.name, config.role)
    return ServerRoutes(EngineBridge(engine, config, metrics))


def create_app(engine: Engine, config: ServerConfig | None = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """A unified server. With `config.manage_engine` the app starts and stops the engine;
    `on_shutdown` closes what the caller owns besides it (cache tiers)."""
    config = config or ServerConfig()

    def start() -> None:
        if config.manage_engine:
            engine.start()

    def stop() -> None:
        try:
            if config.manage_engine:
                engine.shutdown()
        finally:
            if on_shutdown is not None:
                on_shutdown()

    return build_app(routes_for(engine, config), on_startup=start, on_shutdown=stop)
