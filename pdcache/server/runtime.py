"""How a node process runs: a `NodeRuntime` builds what the node owns from its `NodeSetup`
(no thread starts while it builds), starts its threads in `start()` and stops them in
`close()` (readers and writers of engine pages before the engine, so the engine's final drain
frees exactly what is left); `serve()` runs one runtime's app on a bound socket until
SIGINT/SIGTERM. Every role (unified, prefill, decode)
goes through `serve()`; `UnifiedRuntime` is the unified server's.

Lifecycle: the app's lifespan calls `start()` before the socket accepts requests and
`close()` after the last response, so what `ready_lines()` reports (a prefill node's KV
bootstrap address) is listening before the ready line is printed.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

from fastapi import FastAPI

from pdcache.engine.engine import Engine
from pdcache.offload_manager.builder import TieredEngine, build_tiered_engine
from pdcache.server.app import routes_for
from pdcache.server.bridge import ServerConfig
from pdcache.server.routes import build_app
from pdcache.wire.serving import serve_app

READY_PREFIX = "pdcache serve: ready at "


class NodeRuntime(Protocol):
    """What `serve()` needs of a node: built (nothing started) by `__init__`."""

    def __init__(self, setup: Any, model: Any, tokenizer: Any) -> None: ...

    def start(self) -> None:
        """Start every thread the node owns (engine, cache tiers, transfer)."""

    def close(self) -> None:
        """Stop them (transfer and offload before the engine); idempotent."""

    def app(self) -> FastAPI:
        """The node's HTTP app; its lifespan calls `start()` and `close()`."""

    def ready_lines(self) -> list[str]:
        """Lines printed (after `start()`) before the ready line, e.g. bootstrap addresses."""


class UnifiedRuntime:
    """A unified server: one engine (with HiCache tiers when the setup has them).

    Owns the engine thread (started in `start()`) and the tiers' IO threads (started when
    the engine is built, closed in `close()`)."""

    def __init__(self, setup: Any, model: Any, tokenizer: Any) -> None:
        self.setup = setup
        self.config = ServerConfig.of(setup)
        self.tiered: TieredEngine | None = None
        if setup.tiers is not None and setup.engine.cache.enable_prefix_cache:
            self.tiered = build_tiered_engine(setup.engine, model, tokenizer, setup.tiers,
                                              window_pages=setup.cache_tiers.window_tiers)
            self.engine = self.tiered.engine
        else:
            self.engine = Engine(setup.engine, model, tokenizer)
        self._closed = False

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tiered is not None:
            self.tiered.close()
        else:
            self.engine.shutdown()

    def app(self) -> FastAPI:
        return build_app(routes_for(self.engine, self.config), on_startup=self.start,
                         on_shutdown=self.close)

    def ready_lines(self) -> list[str]:
        return []


def serve(runtime: NodeRuntime, sock: socket.socket, host: str, log_level: str,
          command: str = "serve", drain_s: float = 30.0) -> int:
    """`serve_app` of `runtime`'s app, printing its `ready_lines()`; the runtime is closed
    at the end whatever happened (idempotent: the lifespan closed it unless startup failed)."""
    try:
        return serve_app(runtime.app(), sock, host, log_level, command, runtime.ready_lines,
                         drain_s=drain_s)
    finally:
        sock.close()
        runtime.close()
