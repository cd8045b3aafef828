"""`PrefillRuntime`: one prefill node process — HiCache engine, KV sender, controller, app.

Built in order, each part from the ones before it (no late lookups): the controller (it only
needs the node's name), the engine whose scheduler's `PrefillRole` hands finished PD requests to
`controller.take_prefilled`, the sender whose releases go to `controller.on_release`, then
`controller.attach(engine, sender)`.

Threads of the node: the engine thread (`start()`), HiCache's IO workers (built with the
engine), the sender's control thread and transfer workers (`start()`), the event loop (the
app), and uvicorn's. `close()` stops the readers of held pages before the engine: the sender
(it releases every room it accepted), then the controller (frees what was never released),
then the engine and its tiers.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI

from pdcache.config import NodeSetup
from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.window_pages import can_split
from pdcache.offload_manager.builder import build_tiered_engine
from pdcache.offload_manager.page_pull import PagePulls
from pdcache.offload_manager.pending import PendingPages
from pdcache.prefill_node.app import PrefillApp
from pdcache.prefill_node.controller import PrefillController
from pdcache.prefill_node.scheduler import PrefillRole
from pdcache.server.app import routes_for
from pdcache.server.bridge import ServerConfig
from pdcache.server.metrics import TransferCollector
from pdcache.server.routes import build_app
from pdcache.transfer.sender import KVSender

log = logging.getLogger(__name__)


class PrefillRuntime:
    """A prefill node: see the module docstring. Nothing runs until `start()`."""

    def __init__(self, setup: NodeSetup, model: Any, tokenizer: Any) -> None:
        if setup.tiers is None or setup.transfer is None:
            raise ValueError("a prefill node needs cache tiers and a transfer config")
        self.setup = setup
        self.config = ServerConfig.of(setup)
        self.controller = PrefillController(
            setup.name, wait_for_decode=setup.transfer.prefill_waits_for_decode)
        # page writes decode nodes announce (KVSender feeds it, HiCache waits on it or pulls
        # the pages from decode's staging through the sender: §4.10)
        self.pulls = PagePulls(setup.tiers.hicache.pending_pull)
        self.pending = PendingPages(max_ttl_s=setup.tiers.hicache.pending_max_ttl_s,
                                    pulls=self.pulls)
        role = PrefillRole(self.controller)
        self.tiered = build_tiered_engine(setup.engine, model, tokenizer, setup.tiers,
                                          role=role, pending=self.pending,
                                          window_pages=setup.cache_tiers.window_tiers)
        self.engine = self.tiered.engine
        role.use_states(self.engine.states)  # a hybrid model's state goes with its pages
        # window pages (docs/design.md §4.14): the tails are read from the sliding pool
        window = self.engine.window
        role.use_window_pages(window is not None)
        self.sender = KVSender(setup.transfer, self.engine.pool.device_kv, setup.listen_host,
                               setup.bootstrap_port or 0, on_release=self.controller.on_release,
                               prefill_id=setup.name,
                               on_requested=self.controller.decode_requested,
                               control_key=setup.security.zmq_control_key,
                               on_pages=self.pending, kv_geometry=setup.engine.model.kv_geometry.layout_key(
                                   setup.engine.cache.page_size),
                               state_geometry=setup.engine.model.state_geometry,
                               layer_kinds=_row_kinds(setup.engine.model.kv_geometry),
                               window_kv=window.pool.device_kv if window is not None else None)
        self.pulls.attach(self.sender)
        if self.pulls.mode != "never" and not self.sender.authenticated:
            log.info("pending_pull = %r pulls nothing without a cluster secret "
                     "(docs/security.md): pending pages are waited for", self.pulls.mode)
        self.controller.attach(self.engine, self.sender)
        self.routes = routes_for(self.engine, self.config)
        self.routes.bridge.metrics.registry.register(  # dropped control messages, by kind
            TransferCollector(self.sender.stats, setup.name))
        self.pd = PrefillApp(self.routes, self.controller, self.sender)
        self._started = False
        self._closed = False

    def start(self) -> None:
        """The KV bootstrap endpoint listens, then the engine runs."""
        if self._started:
            return
        self._started = True
        self.sender.start()
        self.engine.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            self.sender.close()
        self.controller.close()
        self.tiered.close()  # engine (its last releases handled), HiCache, storage

    def app(self) -> FastAPI:
        app = build_app(self.routes, pd_generate=self.pd.pd_generate,
                        health_extra=self.pd.health_extra, info_extra=self.pd.info_extra,
                        on_startup=self.start,
                        on_shutdown=self.close)
        app.state.tiered = self.tiered
        return app

    def ready_lines(self) -> list[str]:
        return [f"pdcache prefill: KV bootstrap at {self.sender.bootstrap_addr}"]


def _row_kinds(geometry: KVGeometry) -> tuple[str, ...]:
    """The layer kind of each row of the pool, which a decode with window pages needs
    (full and sliding layers: every layer has a row); () for every other model."""
    return geometry.layer_kinds if can_split(geometry) else ()
