"""`DecodeRuntime`: one decode node process — engine (+ DecodeOffloadManager), KV receiver,
controller, app.

Built in order, each part from the ones before it: the controller (needs nothing), the
storage backend (with offload), the engine — its `Scheduler` (made by `_scheduler`, a
method of this runtime, while the engine builds its pool: device-only tiers, `DecodeRole`)
gets the offload manager over that pool and `controller.hold_for_offload` —, the receiver
whose releases go to `controller.on_release`, then `controller.attach(engine, receiver)`.

Threads of the node: the engine thread, the offload manager's copy thread and its storage
writer, the receiver's control thread (all started by `start()`, none by a constructor), the
event loop (the app), and uvicorn's. `close()` stops the readers and writers of PD pages
before the engine: the receiver (every room released), the offload manager (its last copies
done, their holds released), the controller (frees what is left), the engine, the storage.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pdcache.config import NodeSetup
from pdcache.decode_node.app import DecodeApp
from pdcache.decode_node.controller import DecodeController
from pdcache.decode_node.metrics import OffloadStatsCollector
from pdcache.decode_node.scheduler import DecodeRole
from pdcache.engine.engine import Engine
from pdcache.engine.scheduler import Scheduler
from pdcache.engine.window_pages import WindowTails
from pdcache.kernels import KernelSet
from pdcache.offload_manager.builder import stored_geometry
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.base import StorageBackend
from pdcache.server.app import routes_for
from pdcache.server.bridge import ServerConfig
from pdcache.server.metrics import TransferCollector
from pdcache.server.routes import build_app
from pdcache.transfer.receiver import KVReceiver


def state_slots_for(setup: NodeSetup) -> int:
    """The receiver's recurrent-state slots of a hybrid model (0: none): one per PD room in
    flight (requested until decoding starts). Twice the running requests: the rooms being
    transferred beside a full batch; a room finding none is refused 503 `queue_full`, as
    when the admission queue is full (the router retries it elsewhere)."""
    if setup.engine.model.state_geometry is None:
        return 0
    return 2 * max(1, setup.engine.scheduler.max_running_requests)


class DecodeRuntime:
    """A decode node: see the module docstring. Nothing runs until `start()`."""

    def __init__(self, setup: NodeSetup, model: Any, tokenizer: Any) -> None:
        if setup.transfer is None:
            raise ValueError("a decode node needs a transfer config")
        self.setup = setup
        settings = setup.offload  # OffloadSettings (validated) or None: no offload
        self.config = ServerConfig.of(setup)
        self.controller = DecodeController()
        self.storage: StorageBackend | None = (
            create_backend(setup.storage) if settings is not None and setup.storage else None)
        self.offload: DecodeOffloadManager | None = None  # set by _scheduler
        # a sliding-window model keeps its sliding layers' pages apart (window pages,
        # docs/design.md §4.14); decode offload then stages the full layers' pages only and
        # writes the answer's window tail beside them (`_scheduler`)
        self.engine = Engine(setup.engine, model, tokenizer, make_scheduler=self._scheduler,
                             window_pages=True)
        window = self.engine.window
        state_geometry = setup.engine.model.state_geometry  # a hybrid model's (else None)
        self.receiver = KVReceiver(setup.transfer, self.engine.pool.device_kv,
                                   on_release=self.controller.on_release, decode_id=setup.name,
                                   control_key=setup.security.zmq_control_key,
                                   kv_geometry=setup.engine.model.kv_geometry.layout_key(
                                       setup.engine.cache.page_size),
                                   state_geometry=state_geometry,
                                   state_slots=state_slots_for(setup),
                                   window_kv=None if window is None else window.pool.device_kv)
        self.controller.attach(self.engine, self.receiver, self.receiver.states)
        if self.offload is not None:  # prefill peers hear of the writes, may pull (§4.10)
            self.offload.announce_to(self.receiver)
            self.receiver.serve_pulls(self.offload)
        self.routes = routes_for(self.engine, self.config)
        self.routes.bridge.metrics.registry.register(  # dropped control messages, by kind
            TransferCollector(self.receiver.stats, setup.name))
        if self.offload is not None:  # pdcache_decode_offload_* on this node's /metrics
            self.routes.bridge.metrics.registry.register(
                OffloadStatsCollector(self.offload, setup.name))
        self.pd = DecodeApp(self.routes, self.controller, self.receiver)
        self._started = False
        self._closed = False

    def _scheduler(self, **kwargs: Any) -> Scheduler:
        """`Engine(make_scheduler=...)`: the device-only scheduler with the decode role (the
        offload manager needs the engine's pool)."""
        if self.storage is not None:
            setup = self.setup
            settings = setup.offload
            assert settings is not None  # storage is only opened with offload on
            # window pages stored as prefill's tiers store them ([cache] window_tiers,
            # docs/design.md §4.14): the full layers' pages plus window tails, staged from
            # the full pool only; or every layer of every page, the sliding layers staged
            # from the window pool
            tails = setup.cache_tiers.window_tiers
            self.offload = DecodeOffloadManager(
                kwargs["pool"].device_kv, self.storage, setup.fingerprint,
                settings.staging_pages, settings.stride_pages,
                key_scheme=setup.key_scheme, key_namespace=setup.key_namespace,
                kernels=KernelSet(setup.engine.kernels), pending_ttl_s=settings.pending_ttl_s,
                window=None if tails else kwargs.get("window"),
                geometry=stored_geometry(setup.engine.model, tails))
        window = kwargs.get("window")
        tails = window is not None and self.setup.cache_tiers.window_tiers
        role = DecodeRole(self.offload, self.controller, kwargs.get("states"),
                          window_tails=WindowTails(window) if tails else None)
        return Scheduler(**kwargs, role=role)

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.offload is not None:
            self.offload.start()
        self.receiver.start()
        self.engine.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            self.receiver.close()
        if self.offload is not None:
            self.offload.close()
        self.controller.close()
        self.engine.shutdown()  # frees whatever is still reserved or held
        if self.storage is not None:
            self.storage.close()

    def app(self) -> FastAPI:
        app = build_app(self.routes, pd_generate=self.pd.pd_generate,
                        health_extra=self.pd.health_extra, info_extra=self.pd.info_extra,
                        on_startup=self.start,
                        on_shutdown=self.close)
        app.state.offload = self.offload
        return app

    def ready_lines(self) -> list[str]:
        return []
